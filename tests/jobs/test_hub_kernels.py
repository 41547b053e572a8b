"""No kernel is fetched at run time: transformers would take some layers' kernels from the Hub where
the `kernels` package is installed (a Qwen3.5's Gated DeltaNet and norms among them), unless
USE_HUB_KERNELS says no when it is imported; every job starts with it saying no (vlft.jobs.launch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = """
import os
import transformers.integrations.hub_kernels as hub
from vlft.modeling import load_base_model
import torch

model = load_base_model({model!r}, torch.device("cpu"), torch.float32)
# The word transformers goes by: read once as it was imported (before 5.25), or as a model loads.
said = getattr(hub, "_TRANSFORMERS_USE_HUB_KERNELS", None) or os.environ.get("USE_HUB_KERNELS", "YES")
print(type(model).__name__, said, getattr(model, "_use_kernels", False))
"""


@pytest.mark.parametrize("warm", ["0", "1"], ids=["started anew", "in a warm process"])
def test_a_job_loads_a_qwen3_5_with_transformers_hub_kernels_off_whatever_the_environment_says(tmp_path, warm):
    from vlft.demo.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "model", family="qwen3_5")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(model=str(tmp_path / "model")))
    # What a user's shell may say; TMPDIR: the warm process's socket of this test's own.
    env = os.environ | {"USE_HUB_KERNELS": "1", "VLFT_WARM_START": warm, "TMPDIR": str(tmp_path)}

    def said(*command: str) -> list[str]:
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout.split()

    assert said(sys.executable, "-m", "vlft.jobs.launch", str(script)) == [
        "Qwen3_5ForConditionalGeneration",
        "0",
        "False",
    ]
    # The same script run by hand reads the shell's word: the job's "0" is the launcher's doing.
    assert said(sys.executable, str(script))[1] == "1"
