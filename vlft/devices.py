"""The devices a study's jobs can be timed on, and each one's throughputs for a model: measured
(vlft/throughputs.csv, each coefficient with its source), or, for a GPU without measurements, the
nearest measured GPU's scaled by published bf16 throughput and memory bandwidth (vlft/devices.csv).
vlft.costs turns them into each job's predicted time; the config checks `planning.device` against
`known_devices()`."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

THROUGHPUTS = Path(__file__).with_name("throughputs.csv")
# Costs that do not grow with the model's size as its per-token work does: a job's own (reading its
# data, saving), what a GPU pays once, with its first job of a kind (the compile, the model's first read),
# and a reward stage's host's launches a step and a pass (its layers', not its tokens').
FIXED = (
    "train_fixed_s",
    "eval_fixed_s",
    "train_once_s",
    "eval_once_s",
    "eval_compile_s",
    "grpo_step_host_s",
    "grpo_pass_host_s",
)


@dataclass(frozen=True)
class Throughputs:
    """One device's coefficients for one model, scaled from the nearest measured model."""

    device: str
    model: str  # the measured model they come from
    values: dict[str, float]
    scale: float  # this model's compute over the measured model's: per-token times grow with it
    # Where the device has no rows of its own: how its values were scaled from a measured device's.
    derived: str = ""

    def __getitem__(self, quantity: str) -> float:
        value = self.values.get(quantity, 0.0)  # a device's table may leave a cost out: none
        if quantity.endswith("_per_s"):
            return value / self.scale
        return value if quantity in FIXED else value * self.scale


DEVICES = THROUGHPUTS.with_name("devices.csv")  # each GPU's published bf16 throughput and memory bandwidth
# What bounds each per-token quantity: the device's matrix throughput (a forward and backward, a
# prefill, the vision tower) or its memory bandwidth (a decode step reads the weights and the cache).
# The others are a job's, a process's or a host's own time (FIXED), and stay as measured.
COMPUTE_BOUND = ("train_tokens_per_s", "prefill_tokens_per_s", "vision_s_per_image_token", "train_s_per_sample")
BANDWIDTH_BOUND = ("decode_step_s", "decode_row_s", "rollout_decode_step_s", "rollout_decode_row_s")


def device_specs(table: Path = DEVICES) -> dict[str, dict]:
    with open(table, newline="") as handle:
        return {row["device"]: row for row in csv.DictReader(handle)}


def known_devices() -> list[str]:
    """Every device a plan can be made for: measured ones, those whose published figures scale a
    measured one's, and the CPU."""
    return sorted(set(devices()) | set(device_specs()), key=str.lower)


def throughputs(device: str, compute_params: float, table: Path = THROUGHPUTS) -> Throughputs | None:
    """The table's coefficients for `device` from its model nearest in size; for a GPU the table has
    no row of but devices.csv knows, the nearest measured GPU's (by bf16 throughput and memory
    bandwidth), scaled by the two; None for a device neither knows."""
    with open(table, newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["device"].lower() == device.lower()]
    if not rows:
        return scaled_from_nearest(device, compute_params, table)
    nearest = min(rows, key=lambda row: abs(math.log(float(row["compute_params"]) / compute_params)))
    chosen = [row for row in rows if row["model"] == nearest["model"]]
    values = {row["quantity"]: float(row["value"]) for row in chosen}
    return Throughputs(nearest["device"], nearest["model"], values, compute_params / float(nearest["compute_params"]))


def scaled_from_nearest(device: str, compute_params: float, table: Path = THROUGHPUTS) -> Throughputs | None:
    """`device`'s coefficients from the measured GPU nearest it in published bf16 throughput and
    memory bandwidth (the smallest sum of the two log-ratios): its compute-bound ones scaled by the
    throughputs' ratio, its bandwidth-bound ones by the bandwidths'; None where devices.csv has no
    row of it or of any measured GPU."""
    specs = {name.lower(): row for name, row in device_specs().items()}
    target = specs.get(device.lower())
    measured = [name for name in devices(table) if name.lower() in specs]
    if target is None or not measured:
        return None

    def distance(name):
        source = specs[name.lower()]
        return sum(abs(math.log(float(target[k]) / float(source[k]))) for k in ("bf16_tflops", "memory_tb_s"))

    nearest = min(measured, key=distance)
    base, source = throughputs(nearest, compute_params, table), specs[nearest.lower()]
    compute = float(target["bf16_tflops"]) / float(source["bf16_tflops"])
    bandwidth = float(target["memory_tb_s"]) / float(source["memory_tb_s"])
    values = {}
    for quantity, value in base.values.items():
        if quantity.endswith("_per_s") and quantity in COMPUTE_BOUND:
            value *= compute
        elif quantity in COMPUTE_BOUND:
            value /= compute
        elif quantity in BANDWIDTH_BOUND:
            value /= bandwidth
        values[quantity] = value
    derived = (
        f"no measurements on {target['device']}: {nearest}'s, scaled by published bf16 throughput "
        f"({float(target['bf16_tflops']):g} / {float(source['bf16_tflops']):g} TFLOP/s) and memory bandwidth "
        f"({float(target['memory_tb_s']):g} / {float(source['memory_tb_s']):g} TB/s)"
    )
    return Throughputs(target["device"], base.model, values, base.scale, derived)


def devices(table: Path = THROUGHPUTS) -> list[str]:
    with open(table, newline="") as handle:
        return sorted({row["device"] for row in csv.DictReader(handle)})
