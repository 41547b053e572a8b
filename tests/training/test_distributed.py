"""Data-parallel stages and evaluations: N processes take the step, and give the answers, that one
process does. On the CPU the processes talk over gloo, as they talk over nccl between GPUs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import yaml
from tests import ranks
from tests.helpers import FLOAT64_RTOL, REPO, assert_close_normwise, planned_outputs, snakemake, train_float64
from safetensors.torch import load_file

from vlft.jobs import distributed
from vlft.training.reference import REFERENCE_FILE
from vlft.files import read_jsonl
from vlft.training.rollouts import Rollouts as ROLLOUTS_CLASS
from vlft.training.train import StageInputs


def test_shares_are_balanced_by_tokens_and_keep_every_sample_in_its_order():
    lengths = [50, 10, 400, 30, 30, 200, 90, 5, 5]
    samples = [SimpleNamespace(name=i, input_ids=[0] * n) for i, n in enumerate(lengths)]
    shares = distributed.share_by_tokens(samples, 3)
    assert sorted(s.name for share in shares for s in share) == list(range(len(lengths)))
    for share in shares:
        assert [s.name for s in share] == sorted(s.name for s in share)
    loads = [sum(len(s.input_ids) for s in share) for share in shares]
    # Longest first, each to the lightest share so far: 400 | 200+10 | 90+50+30+30+5+5.
    assert loads == [400, 210, 210]
    # More shares than samples: the extra shares are empty, and it is the same on every call.
    assert distributed.share_by_tokens(samples[:2], 3) == [[samples[0]], [samples[1]], []]


def test_a_stage_across_nodes_starts_one_launcher_a_node_which_meet_on_the_first_node():
    """The srun line of the job's batch step, and each node's torchrun options, from what SLURM sets
    (the run itself is tests/jobs/test_slurm.py's, on two emulated nodes)."""
    assert distributed.across_nodes(2, 8, {"SLURM_JOB_ID": "4711"}) == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=8",
    ]
    with pytest.raises(SystemExit, match=r"resources.nodes: 2: a stage across nodes runs as one SLURM job of 2 nodes"):
        distributed.across_nodes(2, 8, {})
    task = {"SLURM_JOB_ID": "4711", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
    first, other = (distributed.rendezvous(2, task | {"SLURM_NODEID": node}) for node in ("0", "1"))
    assert (
        first[:4]
        == other[:4]
        == ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.1.2.3:24711", "--rdzv-id=4711"]
    )
    assert (first[4], other[4]) == ("--rdzv-conf=is_host=1", "--rdzv-conf=is_host=0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_in_process(
    rank: int, size: int, port: int, inputs, settings: dict, out, parallelism: str = "replicate", stop=None
) -> None:
    """One process of a data-parallel job, set up as torchrun sets up its processes (spawned: the
    environment it sets is its own)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    try:
        train_float64(inputs, settings, out, stop, parallelism)
    finally:
        distributed.leave()


@pytest.mark.parametrize(
    "layout",
    [{}, {"packing": False, "max_batch_tokens": 1500, "grad_accum": 2, "micro_batch": 4}],
    ids=["packed", "padded-under-a-token-budget"],
)
def test_two_processes_take_the_steps_one_process_takes(uneven_stage, layout, tmp_path):
    inputs, settings = uneven_stage
    assert_two_processes_take_one_process_steps(inputs, settings | layout, tmp_path)


# Steps of two images: each process takes one whole. Steps of one image: whole groups would leave
# one process idle, so the image is cut in two, each half with the prefix (vlft.forward.image_groups).
# A cut changes the layout, not only the order of a sum across processes: the first steps agree to
# float64 rounding, and from the third AdamW amplifies that rounding (tests/forward/test_image_groups.py's
# loss-curve test says how) to up to 1e-6.
ONE_IMAGE_A_STEP = {"micro_batch": 4}
CUT_LAYOUT_RTOL = 1e-6


@pytest.mark.parametrize("step", [{}, ONE_IMAGE_A_STEP], ids=["two-images-a-step", "one-image-a-step-cut"])
def test_two_processes_with_image_groups_take_the_steps_one_process_takes(grouped_stage, step, tmp_path):
    inputs, settings = grouped_stage
    assert_two_processes_take_one_process_steps(inputs, settings | step, tmp_path, CUT_LAYOUT_RTOL if step else None)
    shares = [row["rank_tokens"] for row in read_jsonl(tmp_path / "two/log.jsonl")]
    assert all(min(tokens) > 0 for tokens in shares)  # neither process idles
    assert all(max(tokens) < 1.3 * min(tokens) for tokens in shares), shares


@pytest.mark.parametrize("step", [{}, ONE_IMAGE_A_STEP], ids=["two-images-a-step", "one-image-a-step-cut"])
def test_two_processes_take_the_dpo_steps_one_process_takes(grouped_stage, step, tmp_path):
    """A preference stage: an image's pairs shared between processes (a cut falls between pairs), and
    the reference, computed in shares before the first step and gathered, is the one a single
    process computes."""
    inputs, settings = grouped_stage
    later_rtol = CUT_LAYOUT_RTOL if step else None
    assert_two_processes_take_one_process_steps(inputs, settings | {"method": "dpo"} | step, tmp_path, later_rtol)
    one, two = (
        json.loads(next((tmp_path / name / "ckpt").glob(f"*/{REFERENCE_FILE}")).read_text())["logps"]
        for name in ("one", "two")
    )
    assert sorted(two) == sorted(one) and len(one) == 48
    for key, (chosen, rejected) in one.items():
        assert two[key] == pytest.approx([chosen, rejected], rel=FLOAT64_RTOL), key


def _train_noting_draws(rank: int, size: int, port: int, inputs, settings: dict, out, parallelism: str) -> None:
    """One process of a data-parallel reward stage, each rollout's questions it draws noted in
    `out`'s folder (drawn-RANK.jsonl). The rank's own methods are put back after (tests/ranks.py
    keeps ranks from one test to the next)."""
    unpatched = ROLLOUTS_CLASS._sample, ROLLOUTS_CLASS._logps
    note_draws(out.parent / f"drawn-{rank}.jsonl")
    try:
        _train_in_process(rank, size, port, inputs, settings, out, parallelism)
    finally:
        ROLLOUTS_CLASS._sample, ROLLOUTS_CLASS._logps = unpatched


def note_draws(path) -> None:
    """Each rollout's questions that this process's GRPO stages draw answers to, a line each in
    `path`, and the questions whose answers each pass without gradients goes over (the reference's,
    the rollout's log-probabilities), in `path` with "passed" for "drawn"."""
    from vlft.training.rollouts import Rollouts

    sample, passes = Rollouts._sample, Rollouts._logps

    def noted(self, keys, *args, **kwargs):
        with open(path, "a") as out:
            out.write(json.dumps(list(keys)) + "\n")
        return sample(self, keys, *args, **kwargs)

    def passed(self, samples, share, *args, **kwargs):
        with open(str(path).replace("drawn", "passed"), "a") as out:
            out.write(json.dumps([key for keys in share for key in keys]) + "\n")
        return passes(self, samples, share, *args, **kwargs)

    Rollouts._sample, Rollouts._logps = noted, passed


# Two images a step, one image a step (cut between its questions), and two images a step learned
# twice a rollout with a KL (its prompts computed twice: each process learns the batcher's share of
# the answers all processes drew, and passes over its own draws for the reference's and the
# rollout's log-probabilities); the rollouts of 7 steps, and how the prompts are computed.
GRPO_LAYOUTS = {
    "two-images-a-step": ({"micro_batch": 8}, 7, "once a step"),
    "one-image-a-step-cut": (ONE_IMAGE_A_STEP, 7, "once a step"),
    "learned-twice-a-rollout-with-a-kl": (
        {"micro_batch": 8, "num_iterations": 2, "beta": 0.04},
        4,
        "twice a step (num_iterations 2",
    ),
}


@pytest.mark.parametrize("layout", GRPO_LAYOUTS)
def test_two_processes_draw_a_share_each_of_the_grpo_steps_and_take_the_steps_one_process_takes(
    grouped_stage, layout, monkeypatch, capfd, tmp_path
):
    """A reward stage: each process draws the answers to its share of a step's questions (each
    answer with its own seed: the answers one process draws), both gather them all and score the
    step alike, and each learns its share from the prompts' forward its own rollout kept, as one
    process learns them all. A step of one image is cut between its questions, so neither idles."""
    inputs, settings = grouped_stage
    step, rollouts, prompts = GRPO_LAYOUTS[layout]
    grpo = {
        "method": "grpo",
        "num_generations": 2,
        "max_completion_length": 6,
        "rewards": {"tests.training.test_grpo:answer_length_reward": 1.0},
    }
    with monkeypatch.context() as patched:
        for name in ("_sample", "_logps"):  # put back after the one process's run
            patched.setattr(ROLLOUTS_CLASS, name, getattr(ROLLOUTS_CLASS, name))
        note_draws(tmp_path / "drawn-one.jsonl")
        assert_two_processes_take_one_process_steps(
            inputs, settings | grpo | step, tmp_path, CUT_LAYOUT_RTOL, target=_train_noting_draws
        )
    one, two = (read_jsonl(tmp_path / name / "log.jsonl") for name in ("one", "two"))
    assert [row["reward"] for row in two] == [row["reward"] for row in one]
    drawn = {who: read_jsonl(tmp_path / f"drawn-{who}.jsonl") for who in ("one", 0, 1)}
    assert len(drawn["one"]) == len(drawn[0]) == len(drawn[1]) == rollouts
    for whole, first, second in zip(drawn["one"], drawn[0], drawn[1]):
        assert first and second and not set(first) & set(second)  # neither idles; none drawn twice
        assert sorted(first + second) == sorted(whole)
    assert all(len(row["rank_tokens"]) == 2 and min(row["rank_tokens"]) > 0 for row in two)  # what each learned
    # Each process's passes without gradients go over its own draws alone (two a rollout: the
    # reference's and the rollout's log-probabilities), where the stage has any.
    for who in (0, 1):
        passes = tmp_path / f"passed-{who}.jsonl"
        passed = read_jsonl(passes) if passes.exists() else []
        assert passed == ([keys for keys in drawn[who] for _ in range(2)] if "beta" in step else [])
    if "beta" in step:
        # The KL to the starting weights, once they moved (the first step's warm-up rate is 0).
        assert all(row["kl"] > 0 for row in two[2:])
        assert [row["kl"] for row in two] == pytest.approx([row["kl"] for row in one], rel=CUT_LAYOUT_RTOL)
    # The prompts computed alike by the one process and by the two (their main process says how).
    assert capfd.readouterr().out.count(f"grpo: each prompt computed {prompts}") == 2


def assert_two_processes_take_one_process_steps(
    inputs,
    settings,
    tmp_path,
    later_rtol: float | None = None,
    target=_train_in_process,
    processes: int = 2,
    parallelism: str = "replicate",
):
    """The same losses, gradient norms and adapter: to FLOAT64_RTOL, or from the third step on to
    `later_rtol` where the processes' layout differs from the one process's. `target`: what each
    of the `processes` (two by default, their outputs in `two`) runs (_train_in_process's arguments)."""
    # One process: this one, as a job outside torchrun (nothing of torchrun's in its environment).
    assert "WORLD_SIZE" not in os.environ and "RANK" not in os.environ
    if not (tmp_path / "one").exists():  # where a test has not trained it already
        train_float64(inputs, settings, tmp_path / "one")
    args = (processes, free_port(), inputs, settings, tmp_path / "two", parallelism)
    ranks.spawn(target, args=args, nprocs=processes)

    one, two = (read_jsonl(tmp_path / name / "log.jsonl") for name in ("one", "two"))
    assert [row["step"] for row in two] == list(range(1, 8))
    # The same loss and gradient norm at every step, in float64, where the two sums' different
    # orders stay far below the tolerance (tests/helpers.py's FLOAT64_RTOL says why).
    for key in ("loss", "grad_norm"):
        assert [row[key] for row in two[:2]] == pytest.approx([row[key] for row in one[:2]], rel=FLOAT64_RTOL), key
        later = later_rtol or FLOAT64_RTOL
        assert [row[key] for row in two[2:]] == pytest.approx([row[key] for row in one[2:]], rel=later), key
    a, b = (load_file(tmp_path / name / "adapter/adapter_model.safetensors") for name in ("one", "two"))
    assert a.keys() == b.keys()
    for key in a:
        assert_close_normwise(b[key], a[key], later_rtol or FLOAT64_RTOL, key)
    # A real difference shows: the first step's loss is far from the last's (an SFT stage's falls;
    # a DPO stage's first is log 2 exactly, its policy still the reference, and moves off it).
    # A grpo stage's loss is about 0 at every step (its advantages sum to 0 a group): its adapter moved.
    if settings.get("method") == "grpo":
        assert any(float(t.abs().max()) > 0 for k, t in a.items() if "lora_B" in k)
    else:
        assert abs(one[-1]["loss"] - one[0]["loss"]) > 0.1 * one[0]["loss"]


def train_command(inputs: StageInputs, settings: dict, out, processes: int) -> list[str]:
    return [
        sys.executable,
        str(REPO / "scripts/train.py"),
        "--model",
        inputs.model_dir,
        "--prepared",
        *inputs.prepared,
        "--caches",
        *inputs.caches,
        "--settings",
        json.dumps(settings),
        "--checkpoints",
        str(out / "ckpt"),
        "--checkpoint-every",
        "1000",
        "--adapter",
        str(out / "adapter"),
        "--log",
        str(out / "log.jsonl"),
        "--summary",
        str(out / "summary.json"),
        "--threads",
        "2",
        "--processes",
        str(processes),
        "--cpu-fallback",  # CPU processes stand in for GPUs here
        "1",
    ]


# A 2-process run of this many steps is long enough that a signal, sent once step 3 is logged, finds
# the job running: steps take 50 ms or more here, so the rest leave it over 1.8 s to arrive, where
# the test sends it within 50 ms (the step at which it stops is read from the output, not assumed).
SIGNALLED_RUN_STEPS = 40


@pytest.fixture(scope="module")
def uninterrupted_run(uneven_stage, tmp_path_factory):
    """The signalled run's stage, uninterrupted, in 2 processes."""
    inputs, settings = uneven_stage
    whole = tmp_path_factory.mktemp("whole")
    command = train_command(inputs, settings | {"max_steps": SIGNALLED_RUN_STEPS}, whole, 2)
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return whole


@pytest.mark.parametrize(
    "sig, to_every_process, resume",
    [(signal.SIGTERM, True, True), (signal.SIGUSR1, False, False), (signal.SIGINT, True, False)],
    ids=[
        "SIGTERM-to-every-process-as-SLURM-sends-it",
        "SIGUSR1-to-the-launcher-as-kill-sends-it",
        "SIGINT-to-every-process-as-Ctrl-C-sends-it",
    ],
)
def test_a_signal_stops_every_process_at_one_step_with_one_checkpoint_and_the_rerun_resumes_there(
    uneven_stage, uninterrupted_run, sig, to_every_process, resume, tmp_path
):
    """Each signal stops both processes at one step with one checkpoint, said once. The rerun's
    resuming from that checkpoint is one path whichever signal left it: taken once, after SLURM's
    (a rerun takes 25 s of CI's 2 cores)."""
    inputs, settings = uneven_stage
    steps = SIGNALLED_RUN_STEPS
    settings = settings | {"max_steps": steps}
    whole = uninterrupted_run

    split = tmp_path / "split"
    job = subprocess.Popen(
        train_command(inputs, settings, split, 2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while not any(len(read_jsonl(log)) >= 3 for log in split.glob("ckpt/*/log.jsonl")):
        assert job.poll() is None and time.time() < deadline, "the job ended or stalled before step 3"
        time.sleep(0.05)
    if to_every_process:
        os.killpg(job.pid, sig)
    else:
        os.kill(job.pid, sig)
    output, _ = job.communicate(timeout=120)
    assert job.returncode != 0, output
    name = signal.Signals(sig).name
    saving = re.findall(rf"{name} received after step (\d+) of {steps}: saving a checkpoint", output)
    assert len(saving) == 1, output  # said once, by the process that saves
    step = int(saving[0])
    assert 3 <= step < steps
    assert f"stopped: {name} received: stopped after step {step} of {steps} with a checkpoint saved" in output
    assert [p.name for p in split.glob("ckpt/*/step-*")] == [f"step-{step:08d}"]
    assert not (split / "adapter").exists()
    if not resume:
        return

    resumed = subprocess.run(train_command(inputs, settings, split, 2), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step {step}" in resumed.stdout
    assert json.loads((split / "summary.json").read_text())["resumed_from_step"] == step
    assert [row["step"] for row in read_jsonl(split / "log.jsonl")] == list(range(1, steps + 1))
    # The very computation, stopped and resumed: equal bit for bit.
    a, b = (load_file(root / "adapter/adapter_model.safetensors") for root in (whole, split))
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_an_evaluation_shared_by_two_processes_writes_what_one_process_writes(demo_workdir, tmp_path):
    """Through the workflow: the evaluation given 2 GPUs (2 CPU processes here) answers each batch
    as the 1-process evaluation of the demo did."""
    import shutil

    workdir = tmp_path / "work"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    config_file = workdir / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["evaluation"]["resources"]["gpus"] = 2
    config_file.write_text(yaml.safe_dump(config))
    target = "results/eval/exp1/main/val/metrics.json"
    # GPUs are a resource: giving more reruns nothing by itself.
    assert planned_outputs(workdir, "--cores", "2", target) == set()
    snakemake(workdir, "--cores", "2", "--forcerun", target)
    log = (workdir / "results/logs/evaluate/exp1/main/val.log").read_text()
    assert "the split shared out among 2 processes" in log, log
    one, two = (root / "results/eval/exp1/main/val" for root in (demo_workdir, workdir))
    assert read_jsonl(two / "predictions.jsonl") == read_jsonl(one / "predictions.jsonl")
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    timing = ("wall_time_s", "samples_per_s")
    assert {k: v for k, v in m2.items() if k not in timing} == {k: v for k, v in m1.items() if k not in timing}
    assert m1["n"] > config["evaluation"]["batch_size"]  # more than one batch: both processes answered
