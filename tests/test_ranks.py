"""The ranks the data-parallel tests train in (tests/ranks.py) fail a test as spawned processes
would: a rank that raises fails the call with its traceback, even while another rank waits, and
what the ranks print reaches the test's captured output."""

from __future__ import annotations

import time

import pytest

from tests import ranks


def _raise_on_rank_one_while_rank_zero_waits(rank: int, message: str) -> None:
    if rank == 1:
        raise ValueError(message)
    time.sleep(600)  # as a rank waits in a collective for one that failed


def _say_rank(rank: int, word: str) -> None:
    print(f"{word} from rank {rank}")


def test_a_rank_that_raises_fails_the_call_and_the_ranks_serve_the_next_test(capfd):
    started = time.time()
    with pytest.raises(RuntimeError, match=r"rank 1 raised:[\s\S]*ValueError: lost the gradient"):
        ranks.spawn(_raise_on_rank_one_while_rank_zero_waits, ("lost the gradient",), nprocs=2)
    assert time.time() - started < 300  # the waiting rank was ended, not waited for
    ranks.spawn(_say_rank, ("hello",), nprocs=2)
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out
