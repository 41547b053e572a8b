"""Warm starts on a GPU machine (vlft.jobs.warm_start): a job handed to a warm process uses CUDA as its
own process would, with the GPUs its CUDA_VISIBLE_DEVICES names, and gives the same result; and how
long a job waits before its first line, its own imports against a warm process's.

    python benchmarks/warm_start_gpu.py

Runs a small job script (torch, transformers and peft imported, then a seeded matrix product and a
tiny Qwen3-VL forward pass on the GPU) three ways: in its own process (VLFT_WARM_START=0), as the
first job (it starts the warm process and waits for its imports) and as a later job (served warm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import time
started = float(__import__("sys").argv[1])  # an argument: a variable of its own would need a warm process of its own
from vlft.jobs.warm_start import hand_off, serving_a_job

hand_off()
import json, os, torch, transformers, peft  # noqa: E401,E402
from transformers import AutoModelForImageTextToText

device = os.environ.get("JOB_DEVICE", "cuda")

imported = time.time() - started
torch.manual_seed(0)
x = torch.randn(2048, 2048, device=device)
product = (x @ x).double().sum().item()
model = AutoModelForImageTextToText.from_pretrained(os.environ["TINY_MODEL"]).to(device)
ids = torch.arange(5, 69, device=device)[None]
logits = model(input_ids=ids).logits.double()
print(json.dumps({"warm": serving_a_job(), "imported_s": imported, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "device": torch.cuda.get_device_name() if device == "cuda" else device, "count": torch.cuda.device_count(), "product": product,
                  "logits_sum": logits.sum().item(), "logits_abs": logits.abs().sum().item()}))
"""


def run_job(script: Path, env: dict) -> dict:
    result = subprocess.run(
        [sys.executable, str(script), repr(time.time())], env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise SystemExit(f"job failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    notes = [line for line in result.stderr.splitlines() if "vlft.jobs.warm_start" in line]
    return json.loads(result.stdout.strip().splitlines()[-1]) | {"notes": notes}


def main():
    work = Path(tempfile.mkdtemp(prefix="warm-start-"))
    from vlft.demo.tiny_model import make_tiny_model

    make_tiny_model(work / "tiny")
    script = work / "job.py"
    script.write_text(JOB)
    env = os.environ | {
        "TINY_MODEL": str(work / "tiny"),
        "CUDA_VISIBLE_DEVICES": "0",
    }
    rows = {
        "own process": run_job(script, env | {"VLFT_WARM_START": "0"}),
        "first job (starts the warm process)": run_job(script, env | {"VLFT_WARM_START": "1"}),
        "later job (served warm)": run_job(script, env | {"VLFT_WARM_START": "1"}),
    }
    print(f"{'job':<38} {'warm':<5} {'to first line, s':>16}  {'GPU':<22} result")
    for name, row in rows.items():
        print(
            f"{name:<38} {str(row['warm']):<5} {row['imported_s']:>16.2f}  {row['device'][:22]:<22} "
            f"{row['product']!r} {row['logits_sum']!r} {row['notes']}"
        )
    same = {(r["product"], r["logits_sum"], r["logits_abs"], r["count"]) for r in rows.values()}
    print("results identical:", len(same) == 1)
    (Path(os.environ.get("OUT", work)) / "warm_start_gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
