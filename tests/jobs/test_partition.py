"""What a SLURM partition offers, read from sinfo, against what jobs ask for (vlft.jobs.partition).
The lines a planned study prints against the test cluster are checked in tests/jobs/test_slurm.py."""

from __future__ import annotations

import pytest

from vlft.jobs.partition import Partition, Request, gpu_count, minutes, over_line, parse_sinfo


@pytest.mark.parametrize(
    "limit, expected",
    [
        ("infinite", None),
        ("UNLIMITED", None),
        ("30", 30),
        ("30:00", 30),
        ("2:00:00", 120),
        ("1-12:00:00", 2160),
        ("0:30:01", 31),
    ],
)
def test_sinfo_time_limits_read_as_minutes(limit, expected):
    assert minutes(limit) == expected


@pytest.mark.parametrize(
    "gres, expected",
    [("(null)", 0), ("gpu:2", 2), ("gpu:h100:4(S:0-1)", 4), ("gpu:a100:2,gpu:h100:2", 4), ("shard:8", 0)],
)
def test_gpus_counted_from_the_nodes_gres(gres, expected):
    assert gpu_count(gres) == expected


def test_a_partition_of_several_node_kinds_offers_the_largest_of_each():
    text = "32|256000|gpu:h100:4(S:0-1)|2-00:00:00|12\n64+|512000|(null)|2-00:00:00|4\n"
    expected = Partition("gpu", cpus=64, mem_mb=512000, gpus=4, time_limit_min=2880, nodes=16)
    assert parse_sinfo("gpu", text) == expected
    assert parse_sinfo("gpu", "") is None  # a partition sinfo does not know


def test_a_request_beyond_the_partition_is_one_line_naming_its_keys_and_one_within_none():
    partition = Partition("debug", cpus=4, mem_mb=21695, gpus=2, time_limit_min=None)
    asks = Request("train exp1/main", "gpu", 4, "resources.gpus of the stage or of defaults")
    assert over_line(partition, asks) == (
        "partition debug offers at most 2 GPUs a node, but train exp1/main asks for 4 "
        "(resources.gpus of the stage or of defaults): it would wait in the queue forever or be refused"
    )
    assert over_line(partition, Request("evaluate", "gpu", 2, "evaluation.resources.gpus")) is None
    # No time limit: any runtime fits.
    assert over_line(partition, Request("evaluate", "runtime", 10**6, "evaluation.resources.runtime")) is None
    limited = Partition("short", cpus=4, mem_mb=1000, gpus=0, time_limit_min=120)
    assert over_line(limited, Request("retries", "runtime", 480, "max_runtime")) == (
        "partition short offers at most 120 min a job, but retries asks for 480 min (max_runtime): "
        "it would wait in the queue forever or be refused"
    )
    # Nodes are a job's: a stage across more nodes than the partition has.
    stage = Request("train exp1/main", "nodes", 3, "resources.nodes of the stage or of defaults")
    assert over_line(limited, stage).startswith(
        "partition short offers at most 1 nodes, but train exp1/main asks for 3 "
    )
    assert over_line(limited, Request("train exp1/main", "nodes", 1, "resources.nodes")) is None
