"""A stage whose processes shard the frozen base (resources.parallelism: shard, vlft.training.sharding)
takes the steps one process takes, computes the reference it computes, and stops and resumes as it
does, on any number of processes: in float64, two and four CPU processes talking over gloo."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests import ranks
from tests.helpers import FLOAT64_RTOL, StopAfter, assert_close_normwise, train_float64
from tests.training.test_distributed import (
    CUT_LAYOUT_RTOL,
    _train_in_process,
    assert_two_processes_take_one_process_steps,
    free_port,
)
from vlft.files import read_jsonl
from vlft.jobs.stopping import Preempted
from vlft.training.reference import REFERENCE_FILE


def _shard_and_look(rank: int, size: int, port: int, model_dir: str, out) -> None:
    """One of `size` processes: the tiny model with a fresh adapter, sharded as a stage shards it; what
    each of its parameters is, by name, in `out`/RANK.json."""
    import os

    from torch.distributed.tensor import DTensor

    from vlft.config import stage_defaults
    from vlft.jobs import distributed
    from vlft.training.sharding import shard_frozen_base
    from vlft.modeling import load_base_model, with_new_adapter

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    group = distributed.join()
    model = with_new_adapter(load_base_model(model_dir, torch.device("cpu"), torch.float64), stage_defaults())
    whole = {name: p.numel() for name, p in model.named_parameters()}
    shard_frozen_base(model, group, torch.device("cpu"))
    held = {
        name: {
            "sharded": isinstance(p, DTensor),
            "held": (p.to_local() if isinstance(p, DTensor) else p).numel(),
            "whole": whole[name],
            "trains": p.requires_grad,
        }
        for name, p in model.named_parameters()
    }
    (out / f"{rank}.json").write_text(json.dumps(held))
    distributed.leave()


def test_each_process_holds_its_share_of_every_decoder_layer_and_the_whole_adapter(tiny_model_dir, tmp_path):
    ranks.spawn(_shard_and_look, args=(2, free_port(), str(tiny_model_dir), tmp_path), nprocs=2)
    first, second = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    layers = [name for name in first if ".language_model.layers." in name]
    frozen = [name for name in layers if not first[name]["trains"]]
    adapter = [name for name in first if first[name]["trains"]]
    assert frozen and adapter and all(".lora_" in name for name in adapter)
    for name in frozen:  # split by rows between the two, nothing held twice
        assert first[name]["sharded"] and second[name]["sharded"], name
        assert first[name]["held"] + second[name]["held"] == first[name]["whole"], name
        assert first[name]["held"] < first[name]["whole"], name
    for name in adapter:  # whole in each
        assert not first[name]["sharded"] and first[name]["held"] == first[name]["whole"], name
    # Outside the decoder layers (embeddings, head, the tower) the weights stay whole.
    assert not any(first[name]["sharded"] for name in first if name not in layers)
    held = sum(first[name]["held"] for name in first) / sum(first[name]["whole"] for name in first)
    layer_share = sum(first[name]["whole"] for name in frozen) / sum(first[name]["whole"] for name in first)
    assert held == pytest.approx(1 - layer_share / 2, abs=0.01)


SHARDED_LAYOUTS = {
    # 49 samples in steps of 8: the seventh step holds one sample, so one process computes a filler.
    "packed-2-processes": ("uneven_stage", {}, 2, None),
    # Steps of two images of 4 questions on 4 processes: each image cut in two.
    "image-groups-4-processes": ("grouped_stage", {}, 4, CUT_LAYOUT_RTOL),
    # A preference stage: the reference computed in shares, fillers and all, then gathered.
    "dpo-2-processes": ("uneven_stage", {"method": "dpo"}, 2, None),
    # A mixture of experts, LoRA on its experts' weights too (PEFT's target_parameters).
    "moe-2-processes": ("moe_stage", {}, 2, None),
}


@pytest.mark.parametrize("layout", SHARDED_LAYOUTS)
def test_sharded_processes_take_the_steps_one_process_takes(layout, request, tmp_path):
    stage, options, processes, later_rtol = SHARDED_LAYOUTS[layout]
    inputs, settings = request.getfixturevalue(stage)
    settings = settings | options
    assert_two_processes_take_one_process_steps(
        inputs, settings, tmp_path, later_rtol, processes=processes, parallelism="shard"
    )
    summary = json.loads((tmp_path / "two/summary.json").read_text())
    assert summary["processes"] == processes and summary["sharded_base"]
    log = read_jsonl(tmp_path / "two/log.jsonl")
    assert all(len(row["rank_tokens"]) == processes for row in log)
    if stage == "uneven_stage":  # the last step's one sample: the other process computed a filler alone
        assert sorted(log[-1]["rank_tokens"])[0] == 0
    if stage == "moe_stage":  # LoRA on both of every layer's expert weights, trained with the rest
        adapter = load_file(tmp_path / "two/adapter/adapter_model.safetensors")
        for layer in (0, 1):
            assert len([k for k in adapter if f"layers.{layer}.mlp.experts." in k and "lora_B" in k]) == 2
        assert all(float(adapter[k].abs().max()) > 0 for k in adapter if "lora_B" in k)
    if options.get("method") == "dpo":
        one, sharded = (
            json.loads(next((tmp_path / name / "ckpt").glob(f"*/{REFERENCE_FILE}")).read_text())["logps"]
            for name in ("one", "two")
        )
        assert sorted(sharded) == sorted(one)  # each pair once: no filler's in it
        for key, pair in one.items():
            assert sharded[key] == pytest.approx(pair, rel=FLOAT64_RTOL), key


def _train_until_stopped(rank: int, size: int, port: int, inputs, settings: dict, out, parallelism: str) -> None:
    """A process of a sharded stage that a SIGTERM reaches while step 3 runs: it saves and stops."""
    try:
        _train_in_process(rank, size, port, inputs, settings, out, parallelism, StopAfter(3))
    except Preempted:
        pass


def test_a_sharded_stage_stopped_resumes_on_another_number_of_processes_to_the_adapter_one_process_makes(
    uneven_stage, tmp_path
):
    """Two sharded processes stop after step 3 with one checkpoint; four resume from it (the
    adapter and optimizer are whole in every process, so any number can), and the stage ends with
    the adapter one process makes without stopping."""
    inputs, settings = uneven_stage
    train_float64(inputs, settings, tmp_path / "one")
    ranks.spawn(_train_until_stopped, args=(2, free_port(), inputs, settings, tmp_path / "two", "shard"), nprocs=2)
    assert [p.name for p in (tmp_path / "two/ckpt").glob("*/step-*")] == ["step-00000003"]
    assert not (tmp_path / "two/adapter").exists()
    ranks.spawn(_train_in_process, args=(4, free_port(), inputs, settings, tmp_path / "two", "shard"), nprocs=4)

    assert json.loads((tmp_path / "two/summary.json").read_text())["resumed_from_step"] == 3
    one, resumed = (read_jsonl(tmp_path / name / "log.jsonl") for name in ("one", "two"))
    assert [row["step"] for row in resumed] == list(range(1, 8))
    assert [len(row["rank_tokens"]) for row in resumed] == [2] * 3 + [4] * 4
    for key in ("loss", "grad_norm"):
        assert [row[key] for row in resumed] == pytest.approx([row[key] for row in one], rel=FLOAT64_RTOL), key
    a, b = (load_file(tmp_path / name / "adapter/adapter_model.safetensors") for name in ("one", "two"))
    assert a.keys() == b.keys()
    for key in a:
        assert_close_normwise(b[key], a[key], FLOAT64_RTOL, key)
