"""A long job's progress as one updating line (tqdm, on stderr): training's steps, an evaluation's
answers, a cache's images. In the terminal, through the rule's `| tee`, it rewrites itself in place;
in the job's log it is a few `\r`-separated updates, at most one every 5 s, so a 50-hour stage's log
stays readable."""

from __future__ import annotations

from tqdm import tqdm

EVERY_S = 5
# Set by a process whose work is short and interactive (a chat's turns): no lines at all.
hidden = False


def progress_line(total: int, what: str, *, initial: int = 0, shown: bool = True) -> tqdm:
    """`shown` false (a process other than the main one of a multi-GPU job): nothing is printed."""
    return tqdm(total=total, initial=initial, desc=what, mininterval=EVERY_S, disable=hidden or not shown)
