"""Data parallelism over the processes of one job: one process per GPU (on a machine without GPUs,
CPU processes talking over gloo, as the tests run them).

A job given N GPUs starts its script once; the script re-executes itself under torchrun
(`relaunch`), which starts the N processes and sets RANK, WORLD_SIZE and LOCAL_RANK for them, and
`join` connects them. In training every optimizer step's samples are shared out by tokens
(`share_by_tokens`), each process runs forward and backward on its share, and the LoRA gradients and
the loss are summed with one all-reduce (`sum_across`), so that every process takes the very step a
single process would take. Not torch's DistributedDataParallel: its bucketed overlap of
communication with backward buys nothing for LoRA's few MB of gradients, and it needs every process
to run the same number of backward passes a step, while token-balanced shares may differ in
micro-batches (or be empty, in a step of fewer samples than processes).
"""

from __future__ import annotations

import heapq
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Asked of torchrun through its own environment variables (PET_ + option name; older versions ignore
# what they lack): pass SIGUSR1 on to the processes too, not only its default SIGTERM, SIGINT, SIGHUP
# and SIGQUIT (without it torchrun dies of SIGUSR1 and leaves them running), and give them time to
# finish their step and save the checkpoint before it kills them (30 s by default). The launcher
# overwrites TORCHELASTIC_SIGNALS_TO_HANDLE from its option, so setting that one does nothing.
TORCHRUN_SETTINGS = {
    "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    "PET_SHUTDOWN_TIMEOUT": "300",
}


@dataclass(frozen=True)
class Group:
    """This process's place among the job's processes; a group of one outside torchrun."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """The process that writes the job's outputs, logs and checkpoints."""
        return self.rank == 0


# Set for the launchers srun starts, one a node, so that each becomes torchrun rather than srun again.
NODE_LAUNCHER = "VLFT_NODE_LAUNCHER"


def relaunch(processes: int, threads_each: int, nodes: int = 1) -> None:
    """Re-execute this script as `processes` processes a node under torchrun, unless that is done
    already (or one process in all is asked for). The job's pid becomes torchrun's, which forwards
    signals. Across the `nodes` of a SLURM job: first srun, which starts this script once a node
    (`across_nodes`), each of which then becomes its node's torchrun, the nodes meeting at a c10d
    rendezvous on the job's first node (`rendezvous`)."""
    if processes * nodes <= 1 or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(TORCHRUN_SETTINGS)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_each))
    sys.stdout.flush()
    if nodes > 1 and NODE_LAUNCHER not in os.environ:
        os.environ[NODE_LAUNCHER] = "1"
        command = across_nodes(nodes, threads_each * processes, os.environ)
        os.execvp(command[0], [*command, sys.executable, *sys.argv])
    where = rendezvous(nodes, os.environ) if nodes > 1 else ["--standalone", "--nnodes=1"]
    torchrun = ["-m", "torch.distributed.run", *where, f"--nproc-per-node={processes}"]
    # "--": the script's own options are never read as (abbreviations of) torchrun's.
    os.execv(sys.executable, [sys.executable, *torchrun, "--", *sys.argv])


def across_nodes(nodes: int, threads: int, env) -> list[str]:
    """The srun line that starts one launcher on each of the SLURM job's `nodes` (the rule's command
    runs in the job's batch step, on its first node: profiles/slurm's `mpi` resource). Each gets
    the node's `threads` CPUs; a step gets the job's GPUs and memory on its nodes by default."""
    if "SLURM_JOB_ID" not in env:
        raise SystemExit(
            f"resources.nodes: {nodes}: a stage across nodes runs as one SLURM job of {nodes} nodes "
            "(snakemake --profile profiles/slurm); this job runs outside SLURM. Give nodes: 1 to train it here."
        )
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={threads}"]


def rendezvous(nodes: int, env) -> list[str]:
    """torchrun's options for one node's launcher (an srun task) of a job across `nodes`: the job's
    first node, from which srun started the launchers, hosts the c10d store, at a port its job id
    picks (two jobs sharing a first node pick different ones). The nodes' ranks follow the order
    of their host names, the same in every attempt."""
    port = RENDEZVOUS_PORTS[0] + int(env["SLURM_JOB_ID"]) % (RENDEZVOUS_PORTS[1] - RENDEZVOUS_PORTS[0])
    first = env["SLURM_NODEID"] == "0"
    return [
        f"--nnodes={nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={env['SLURM_LAUNCH_NODE_IPADDR']}:{port}",
        f"--rdzv-id={env['SLURM_JOB_ID']}",
        f"--rdzv-conf=is_host={int(first)}",
    ]


# The ports a rendezvous may take, below Linux's ephemeral range (32768 on).
RENDEZVOUS_PORTS = (20000, 30000)


def launched_rank() -> int:
    """This process's rank as torchrun set it, before `join`: 0 outside torchrun."""
    return int(os.environ.get("RANK", 0))


def join() -> Group:
    """Connect this process to the job's others (nccl between GPUs, gloo on the CPU)."""
    size = int(os.environ.get("WORLD_SIZE", 1))
    if size == 1:
        return Group()
    group = Group(int(os.environ["RANK"]), size, int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(group.local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return group


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def share_by_tokens(samples: list, parts: int, length=lambda sample: len(sample.input_ids)) -> list[list]:
    """`samples` (or image groups, never cut, with their `length`) shared out into `parts` lists
    of near-equal token counts: each sample, longest first, goes to the part with the fewest tokens
    so far (ties to the lowest part). Each part keeps the samples' own order. The same on every
    process: it depends on the samples alone."""
    loads = [(0, part) for part in range(parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(samples)), key=lambda i: -length(samples[i])):
        tokens, part = heapq.heappop(loads)
        shares[part].append(index)
        heapq.heappush(loads, (tokens + length(samples[index]), part))
    return [[samples[i] for i in sorted(share)] for share in shares]


def sum_across(params: list[torch.Tensor], extra: torch.Tensor) -> None:
    """Sum, in place over all processes, the gradients of `params` and the tensor `extra` (a step's
    loss and metric sums), in one all-reduce. A process whose share of the step was empty contributes zeros."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [extra.reshape(-1).to(grads[0].dtype)])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    extra.copy_(flat[flat.numel() - extra.numel() :].view_as(extra))


def broadcast_from_main(params: list[torch.Tensor]) -> None:
    """Every process starts from the main process's values (as DistributedDataParallel does)."""
    for p in params:
        dist.broadcast(p.data, src=0)


def any_of(flag: bool, device: torch.device) -> bool:
    """True on every process when `flag` is true on any."""
    tensor = torch.tensor([int(flag)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gathered(obj) -> list:
    """`obj` of every process, in rank order."""
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects
