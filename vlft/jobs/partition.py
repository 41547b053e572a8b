"""What a SLURM partition's nodes offer, against what the study's jobs ask for, said at plan time.

A job that asks for more CPUs, memory or GPUs than any node of its partition has waits in the queue
forever (`PENDING (PartitionConfig)`, without a message anywhere Snakemake shows), and one that asks
for more time than the partition allows is refused or waits the same way. As Snakemake plans the
jobs (dry runs too), before any is submitted, the rules (workflow/rules/resources.smk) read the
partition once with `sinfo` and:

- CPUs: caps every job's threads at the nodes' CPUs (our jobs use the threads they get) and says so
  in one line;
- memory and GPUs (a node's), time and nodes (a job's): says in one line for each planned job that
  asks for more, with the keys that set it, and what the partition offers. Those are not changed: a GPU count or a memory request is the
  user's to lower, and a site may route such a job elsewhere (set-resources).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    name: str
    cpus: int  # of its largest node
    mem_mb: int
    gpus: int
    time_limit_min: int | None  # None: no limit
    nodes: int = 1


@dataclass(frozen=True)
class Request:
    """One job kind's request: `job` says which (`train exp1/main`), `keys` what sets its value."""

    job: str
    resource: str  # mem_mb, gpu, runtime or nodes
    value: int
    keys: str


def minutes(limit: str) -> int | None:
    """sinfo's time limit ("infinite", "30:00", "2:00:00", "1-12:00:00") in minutes."""
    if limit.strip().lower() in ("infinite", "unlimited", "n/a"):
        return None
    days, _, clock = limit.strip().rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    hours, mins, secs = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + hours * 60 + mins + (1 if secs else 0)


def gpu_count(gres: str) -> int:
    """GPUs in a node's gres ("gpu:2", "gpu:h100:4(S:0-1)", "(null)")."""
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        total += int(match.group(1)) if match else 0
    return total


def parse_sinfo(name: str, text: str) -> Partition | None:
    """`sinfo -h -p NAME -o "%c|%m|%G|%l|%D"`: one line per kind of node; the largest of each counts,
    and the nodes of all."""
    rows = [line.split("|") for line in text.splitlines() if line.count("|") == 4]
    if not rows:
        return None
    limits = [minutes(row[3]) for row in rows]
    return Partition(
        name=name,
        cpus=max(int(row[0].rstrip("+")) for row in rows),
        mem_mb=max(int(row[1].rstrip("+")) for row in rows),
        gpus=max(gpu_count(row[2]) for row in rows),
        time_limit_min=None if None in limits else max(limits),
        nodes=sum(int(row[4]) for row in rows),
    )


def read_partition(name: str) -> Partition | None:
    """The partition as sinfo describes it; None where sinfo is missing or does not know it (the
    submission itself then says what is wrong)."""
    try:
        done = subprocess.run(
            ["sinfo", "-h", "-p", name, "-o", "%c|%m|%G|%l|%D"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sinfo(name, done.stdout) if done.returncode == 0 else None


def cpu_line(partition: Partition) -> str:
    """Said once where some job asks for more threads than a node has CPUs (they are capped)."""
    return (
        f"partition {partition.name}: its nodes have {partition.cpus} CPUs, so jobs that ask for more threads "
        f"(the rules' threads, resources.threads of a stage, evaluation.threads) get {partition.cpus}; a partition of larger nodes gives them more"
    )


# What a partition offers, a node's or a job's, and the unit of a request.
OFFERS = {"mem_mb": "{} MB of memory a node", "gpu": "{} GPUs a node", "runtime": "{} min a job", "nodes": "{} nodes"}
UNITS = {"mem_mb": " MB", "runtime": " min"}


def over_line(partition: Partition, request: Request) -> str | None:
    """One line where a job asks for more than the partition offers (it would wait in the queue
    forever, or be refused); None where it fits."""
    limits = {"mem_mb": partition.mem_mb, "gpu": partition.gpus, "runtime": partition.time_limit_min}
    limit = (limits | {"nodes": partition.nodes}).get(request.resource)  # None: one it does not bound
    if limit is None or request.value <= limit:
        return None
    unit = UNITS.get(request.resource, "")
    return (
        f"partition {partition.name} offers at most {OFFERS[request.resource].format(limit)}, but {request.job} "
        f"asks for {request.value}{unit} ({request.keys}): it would wait in the queue forever or be refused"
    )
