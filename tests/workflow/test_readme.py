"""Every command the README and the user guide (docs/) show runs as written: each shell line of
their bash blocks is run here (dry, with -n added, where it needs a cluster or a GPU), so the docs
cannot drift from what works. A line they gain without a way to run it here fails this test."""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import DEMO_COMMAND, REPO, copy_demo_upstream, copy_workflow, need
from vlft.config import resolve_config
from vlft.plan import build_plan

EXAMPLE = "config/examples/kvasir-vqa-qwen3-vl-8b.yaml"
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest'


# The README and every page of the user guide: each command they show is run here as written.
DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def docs_text() -> str:
    return "\n".join(page.read_text() for page in DOC_PAGES)


def readme_commands() -> list[str]:
    """The shell lines of the README's and the guide's bash blocks: continuations joined, comments
    dropped, each command once (the README and a page may show the same one)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", docs_text(), re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if command and command not in commands:
                commands.append(command)
    return commands


def shell(command: str, cwd: Path, env: dict | None = None) -> str:
    result = subprocess.run(
        command, shell=True, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


KVASIR_IMPORTS = [
    "python scripts/import_dataset.py kvasir-vqa --parquet kvasir-vqa/data/*.parquet --out data/kvasir",
    "python scripts/import_dataset.py kvasir-vqa-x1 --x1 kvasir-vqa-x1/data/*.parquet --parquet kvasir-vqa/data/*.parquet "
    "--out data/kvasir-x1",
]


def published_kvasir(directory: Path, n_images: int = 12) -> None:
    """Kvasir-VQA and Kvasir-VQA-x1 in the files and shapes the Hub publishes, where the README's
    import commands expect them, as `hf download` lays them out: kvasir-vqa/data/*.parquet,
    kvasir-vqa-x1/data/{train,test}-*.parquet."""
    import pandas as pd
    from tests.data.test_importers import kvasir_parquet, x1_rows

    (directory / "kvasir-vqa/data").mkdir(parents=True)
    kvasir_parquet(directory / "kvasir-vqa/data/raw-00000-of-00001.parquet", n_images=n_images)
    (directory / "kvasir-vqa-x1/data").mkdir(parents=True)
    rows = x1_rows(n_images * 4, images=n_images)
    pd.DataFrame(rows[: n_images * 3]).to_parquet(directory / "kvasir-vqa-x1/data/train-00000-of-00001.parquet")
    pd.DataFrame(rows[n_images * 3 :]).to_parquet(directory / "kvasir-vqa-x1/data/test-00000-of-00001.parquet")


@pytest.fixture(scope="module")
def kvasir_workdir(tmp_path_factory, tiny_model_dir):
    """A clone where the README's commands made the Kvasir example's datasets from Kvasir-VQA and
    Kvasir-VQA-x1 as published, and the example points at a tiny Qwen3-VL, as the README asks."""
    workdir = copy_workflow(tmp_path_factory.mktemp("kvasir"))
    published_kvasir(workdir)
    for command in KVASIR_IMPORTS:
        assert f"\n{command}\n" in docs_text().replace("\\\n   ", ""), command
        shell(command, workdir)
    example = workdir / EXAMPLE
    text = example.read_text().replace("/path/to/models/Qwen3-VL-8B-Instruct", str(tiny_model_dir))
    assert "/path/to" not in text
    example.write_text(text)
    return workdir


# The example's plan: its 8 stages, each evaluated on its dataset's val split, the base model on
# both datasets' val; the pixel caches of the 4 splits, the vision cache of the Kvasir-VQA train split.
KVASIR_STAGES = list(build_plan(resolve_config(yaml.safe_load((REPO / EXAMPLE).read_text()))).stages)
KVASIR_SPLITS = [f"{d}/{s}" for d in ("kvasir", "kvasir-x1") for s in ("train", "val")]
KVASIR_PLAN = {
    *(f"results/kvasir/train/{s}/adapter" for s in KVASIR_STAGES),
    *(f"results/kvasir/eval/{s}/val/predictions.jsonl" for s in KVASIR_STAGES + ["base/base", "base/kvasir-x1"]),
    *(f"results/kvasir/prepared/{s}.jsonl" for s in KVASIR_SPLITS),
    *(f"results/kvasir/cache/images/{s}/3136-1336320" for s in KVASIR_SPLITS),
    "results/kvasir/cache/vision/kvasir/train/3136-1336320",
    "results/kvasir/report/inputs.json",
    "results/kvasir/report/index.html",
    "rule:all",
}


def run_quick_start_demo(command, fixture, tmp_path):
    # The demo fixture (conftest) runs the second half; CI's fresh machine has just run the install.
    assert command == f"pip install -e . && {DEMO_COMMAND}"
    assert (fixture("demo_workdir") / "results/report/index.html").exists()


def run_test_suite(command, fixture, tmp_path):
    # This very run is that command: .ci/run runs it, word for word.
    assert command == TEST_COMMAND
    assert TEST_COMMAND in (REPO / ".ci/run").read_text()


FAST_PART = 'python -m pytest -m "not slow"'
# Tests whose whole file runs a pipeline, a killed driver or a browser: none is in the fast part.
PIPELINE_FILES = ("test_demo_pipeline.py", "test_slurm.py", "test_killed_driver.py", "test_report_browser.py")


def run_fast_part(command, fixture, tmp_path):
    """Listed as written with --collect-only, not run a second time: this very run runs every test."""
    assert command == FAST_PART
    listed = shell(f"{command} --collect-only -q", REPO)
    selected = [line for line in listed.splitlines() if "::" in line]
    assert len(selected) > 100, listed[-2000:]
    assert not [test for test in selected if test.split("::")[0].endswith(PIPELINE_FILES)]
    assert not [test for test in selected if "test_readme_command_runs_as_written" in test]


def run_dry_run(command, fixture, tmp_path):
    assert "Nothing to be done" in shell(command, fixture("demo_workdir"))


def run_dag(command, fixture, tmp_path):
    need("dot")
    workdir = copy_workflow(tmp_path / "dag")
    shell(command, workdir)
    svg = (workdir / "dag.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "train" in svg and "report" in svg


def run_keep_best(command, fixture, tmp_path):
    """Three learning rates over a two-stage curriculum on the demo's data and model: a dry run plans
    the arms' first stage and the comparison only; the run trains stage2 for the best arm alone, and
    the report says which arms stopped and why."""
    import json

    workdir = copy_demo_upstream(fixture("demo_workdir"), tmp_path / "demo")
    planned = shell(command.replace("--cores all", "-n"), workdir)
    assert "checkpoint keep_best_arms:" in planned and "/stage2/" not in planned, planned[-3000:]
    shell(command, workdir)
    results = workdir / "results/demo-keep-best"
    kept = json.loads((results / "sweeps/lr/kept.json").read_text())
    arms = ["lr.learning_rate-0.0002", "lr.learning_rate-0.002", "lr.learning_rate-0.02"]
    assert (
        kept["candidates"] == arms and len(kept["kept"]) == 1 and set(kept["stopped"]) == set(arms) - set(kept["kept"])
    )
    best = max(arms, key=lambda arm: (kept["values"][arm], -arms.index(arm)))
    assert kept["kept"] == [best]
    for arm in arms:
        assert (results / "train" / arm / "stage1/summary.json").is_file()
        assert (results / "train" / arm / "stage2").exists() == (arm == best), arm
        measured = json.loads((results / "eval" / arm / "stage1/val/metrics.json").read_text())["accuracy"]
        assert kept["values"][arm] == measured
    page = (results / "report/index.html").read_text()
    assert "Arms stopped early" in page
    for arm, why in kept["stopped"].items():
        assert f"stopped: {why}" in page and arm in page
    # Nothing is left to do: the stopped arms' stage2 is no job of the plan once the comparison ran.
    assert "Nothing to be done" in shell(command.replace("--cores all", "-n"), workdir)


def run_kvasir_plan(command, fixture, tmp_path):
    """A dry run, as written, or with -n added where it would train an 8B-sized setup."""
    kvasir_workdir = fixture("kvasir_workdir")
    if " -n" not in command:
        command += " -n"
    output = shell(command, kvasir_workdir, env={"HOME": str(kvasir_workdir / "home")})
    planned = {m.group(1).split(",")[0].strip() for m in re.finditer(r"^\s+output: (.+)$", output, re.MULTILINE)}
    assert len(KVASIR_STAGES) == 8 and planned | {"rule:all"} == KVASIR_PLAN
    assert len([p for p in planned if p.endswith("predictions.jsonl")]) == 10
    # Its last lines: each training and evaluation job's predicted time on the example's H100, the total.
    table = output[output.index("Predicted time of the jobs that would run, on H100 (planning.device") :]
    for stage in KVASIR_STAGES:
        assert re.search(rf"^  train {re.escape(stage)} +\d+(\.\d+)? (s|min|h)  [\d,]+ samples", table, re.M), table
    assert re.search(r"^  cache_vision kvasir/train +\d+(\.\d+)? (s|min|h)  [\d,]+ images", table, re.M), table
    assert re.search(r"^  total: \d+\.\d\d GPU-hours; wall time ", table, re.M), table
    return output


SMOKE_SAMPLES = [
    "python scripts/import_dataset.py sample --from data/kvasir --images train=32 val=8 test=8 --out data/kvasir-smoke",
    "python scripts/import_dataset.py sample --from data/kvasir-x1 --images train=12 val=4 test=4 --out "
    "data/kvasir-x1-smoke",
]


def run_kvasir_smoke(command, fixture, tmp_path):
    """The samples, from the README's imports; the smoke study planned (its GPU jobs run on the GPU:
    benchmarks/workflow_gpu.py --study kvasir-smoke), its model from a Hugging Face cache holding
    the tiny Qwen3-VL under the Hub id it names, as on a machine that fetched it."""
    import json

    from tests.workflow.test_deployed import hub_cache_holding

    workdir = fixture("kvasir_workdir")
    for sample in SMOKE_SAMPLES:
        summary = json.loads(shell(sample, workdir).strip().splitlines()[-1])
        out = workdir / sample.split("--out ")[1]
        source = workdir / sample.split("--from ")[1].split()[0]
        for split in summary:  # each split's records, kept or left out, and no other
            assert summary[split]["records"] == len((out / f"{split}.jsonl").read_text().splitlines())
            whole = len((source / f"{split}.jsonl").read_text().splitlines())
            assert summary[split]["records"] + summary[split]["records_left_out"] == whole
        assert 0 < summary["train"]["images"] <= 32
    if command in SMOKE_SAMPLES:
        return
    home = tmp_path / "hf-home"
    hub_cache_holding(home, "Qwen/Qwen3-VL-8B-Instruct", fixture("tiny_model_dir"))
    output = shell(command + " -n", workdir, env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    jobs = re.findall(r"^rule (\w+):", output, re.MULTILINE)
    assert jobs.count("fetch_model") == 1 and jobs.count("train") == 4 and "report" in jobs
    assert jobs.count("evaluate") == 6  # 4 stages and the base model on each dataset's val


def run_kvasir_on_slurm(command, fixture, tmp_path):
    # The site profile the README describes, in the home directory `~` names.
    site = fixture("kvasir_workdir") / "home/my-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "config.yaml").write_text("default-resources: {slurm_account: myaccount, slurm_partition: gpu}\n")
    output = run_kvasir_plan(command, fixture, tmp_path)
    train_jobs = re.findall(r"^rule train:\n(?:\s+.*\n)*?\s+resources: (.*)$", output, re.MULTILINE)
    assert len(train_jobs) == len(KVASIR_STAGES)
    for resources in train_jobs:
        assert "slurm_account=myaccount" in resources and "slurm_partition=gpu" in resources
        assert "gpu=1" in resources
        # The example leaves runtime to the prediction: its predicted time x 1.5, at least 15 minutes.
        runtime, predicted = (
            int(re.search(rf"\b{key}=(\d+)", resources).group(1)) for key in ("runtime", "predicted_s")
        )
        assert predicted > 0 and runtime == max(15, math.ceil(predicted * 1.5 / 60)), resources


def run_slurm_trial(command, fixture, tmp_path):
    # The test cluster (scripts/slurm_cluster.sh, which CI starts): the demo planned as written,
    # no max-threads; the demo run through it is tests/jobs/test_slurm.py's.
    fixture("slurm_cluster")
    cpus = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%c"], capture_output=True, text=True).stdout.split()[0]
    output = shell(command, copy_workflow(tmp_path / "trial"))
    assert "rule train:" in output and "rule report:" in output
    capped = f"partition debug: its nodes have {cpus} CPUs, so jobs that ask for more threads"
    assert (capped in output) == (int(cpus) < 8)  # the rules ask for up to 8


REPORT_FILES = (
    "index.html",
    "results.csv",
    "accuracy_by_category.csv",
    "jobs.csv",
    "loss_curves.png",
    "accuracy_by_category.png",
    "reward_curves.png",  # the demo has a reward stage (click_grpo)
)


def run_retrain(command, fixture, tmp_path):
    """Rebuilds exp4 stage 2 (-f), or it and what depends on it (-R); nothing else."""
    workdir = tmp_path / "work"
    shutil.copytree(fixture("demo_workdir"), workdir, symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in (workdir / "results").rglob("*") if p.is_file()}
    shell(command, workdir)
    changed = {
        str(p.relative_to(workdir).parent if "adapter" in p.parts else p.relative_to(workdir))
        for p, mtime in before.items()
        if p.exists() and p.stat().st_mtime_ns != mtime
    }
    # Logs and checkpoints are no outputs: a run appends to its log and renews its kept result.
    changed = {c for c in changed if not c.startswith(("results/logs/", "results/checkpoints/"))}
    stage = {
        "results/train/exp4/stage2/adapter",
        "results/train/exp4/stage2/log.jsonl",
        "results/train/exp4/stage2/summary.json",
    }
    downstream = {
        f"results/eval/exp4/stage2/{split}/{name}"
        for split in ("val", "test")
        for name in ("predictions.jsonl", "metrics.json")
    }
    downstream |= {f"results/report/{name}" for name in REPORT_FILES}
    assert changed == (stage | downstream if " -R " in command else stage)


def run_snakemake_report(command, fixture, tmp_path):
    import zipfile

    workdir = tmp_path / "work"
    shutil.copytree(fixture("demo_workdir"), workdir, symlinks=True)
    shell(command, workdir)
    names = zipfile.ZipFile(workdir / "report.zip").namelist()
    for item in REPORT_FILES:
        assert any(name.endswith(item) and "/data/raw/" in name for name in names), (item, names[:20])


def run_import(command, fixture, tmp_path):
    """Each importer on files in its published format, at the paths the README names."""
    import json

    import pandas as pd
    from tests.data.test_importers import chat_fixtures, jpeg_bytes

    workdir = copy_workflow(tmp_path / "work")
    published_kvasir(workdir, n_images=6)
    (workdir / "chat").mkdir()
    sharegpt, _, _ = chat_fixtures(workdir / "chat")
    (workdir / "chat/train.json").write_text(json.dumps(sharegpt))
    (workdir / "screenspot").mkdir()
    clicks = [{"img_filename": "web_1.png", "bbox": [5, 5, 20, 10], "instruction": "click OK", "data_type": "text"}]
    (workdir / "screenspot/screenspot_web.json").write_text(json.dumps(clicks))
    (workdir / "ScreenSpot/data").mkdir(parents=True)  # the Hub mirror: screenshots inside, boxes in fractions
    mirror = [
        {
            "file_name": "web_1.png",
            "bbox": [0.1, 0.1, 0.5, 0.5],
            "instruction": "click OK",
            "image": {"bytes": jpeg_bytes(0)},
        }
    ]
    pd.DataFrame(mirror).to_parquet(workdir / "ScreenSpot/data/test-00000-of-00001.parquet")
    (workdir / "rlaif-v").mkdir()
    pairs = [
        {"image": {"bytes": jpeg_bytes(i)}, "question": "What?", "chosen": "Noise.", "rejected": "A cat."}
        for i in range(2)
    ]
    pd.DataFrame(pairs).to_parquet(workdir / "rlaif-v/train-00000.parquet")

    from tests.data.test_importers import hub_vqa_parquet, rl_layouts, slake

    slake(workdir / "SLAKE")
    hub_vqa_parquet(workdir / "vqa-rad")
    rl_layouts(workdir)
    summary = json.loads(shell(command, workdir).strip().splitlines()[-1])
    out = command.split("--out ")[1].split()[0]
    assert summary["records"] > 0
    written = list((workdir / out).glob("*.jsonl"))
    assert {path.stem for path in written} <= {"train", "val", "test"}
    assert sum(len(path.read_text().splitlines()) for path in written) == summary["records"]
    read_as = next((said for name, said in RL_LAYOUTS_READ_AS.items() if f"/{name}" in command), None)
    if read_as is not None:  # an RL layout: its solution read as our answer, or its target as a click
        assert summary.get(read_as) == summary["records"], (read_as, summary)


# What each RL layout's rows become, by the summary's count (the README's command names the directory).
RL_LAYOUTS_READ_AS = {
    "swift-grpo": "answers_from_solution",
    "clevr-r1": "answer_tags_read",
    "rec": "click_records",
    "GUI-R1": "click_records",
    "android_control": "click_records",
}


def run_from_own_directory(command, fixture, tmp_path):
    """A study in a directory of its own, the workflow elsewhere (tests/workflow/test_deployed.py's study)."""
    from tests.workflow.test_deployed import a_study_of_ones_own

    clone = copy_workflow(tmp_path / "clone")
    study = a_study_of_ones_own(tmp_path / "study", fixture("tiny_model_dir"), "my-study.yaml")
    said = shell(command.replace("<clone>", str(clone)), study)
    assert (study / "results/my-study/report/index.html").is_file()
    assert not (study / "scripts").exists() and not (clone / "results").exists()
    assert "Results of this study: results/my-study/" in said
    assert "The report: results/my-study/report/index.html" in said
    # Exported from the study's directory with no other argument: its config and the cores found.
    shell("vlft export results/my-study/train/only/main", study)
    exported = study / "results/my-study/export/only/main"
    assert (exported / "config.json").is_file() and not [p for p in exported.iterdir() if p.name.startswith(".")]


def run_env(command, fixture, tmp_path):
    output = shell(command, tmp_path)
    assert "torch: " in output and "workflow commit: " in output and "GPUs: " in output


CLICK_EXAMPLE = "config/examples/click-qwen3-vl-8b.yaml"


def run_click_plan(command, fixture, tmp_path):
    """The click example with the user's paths put in: a small set of screens and a tiny Qwen3-VL."""
    from tests.data.test_clicks import make_click_split

    workdir = copy_workflow(tmp_path / "work")
    data = tmp_path / "screenshots"
    for seed, split in enumerate(("train", "val", "test")):
        make_click_split(data, split, 4, seed)
    example = workdir / CLICK_EXAMPLE
    text = example.read_text().replace("/path/to/models/Qwen3-VL-8B-Instruct", str(fixture("tiny_model_dir")))
    text = text.replace("/path/to/screenshots/images", str(data / "images")).replace("/path/to/screenshots", str(data))
    assert "/path/to" not in text
    example.write_text(text)
    output = shell(command, workdir)
    planned = {m.group(1).split(",")[0].strip() for m in re.finditer(r"^\s+output: (.+)$", output, re.MULTILINE)}
    evaluations = {
        f"results/clicks/eval/{s}/{split}/predictions.jsonl"
        for s in ("click/main", "base/base")
        for split in ("val", "test")
    }
    assert {"results/clicks/train/click/main/adapter", *evaluations} <= planned, planned


def run_demo_qwen3_5(command, fixture, tmp_path):
    """The demo's chain on a tiny Qwen3.5, beside the demo's data: every stage beats the untrained
    base model, GRPO beats the SFT stage it starts from (its prompts computed twice a step, as the
    log says), the report compares them all; then its stages answer through predict and chat as
    their evaluations did, and one exports to a Qwen3.5 checkpoint transformers loads."""
    import json

    from transformers import AutoConfig

    workdir = copy_demo_upstream(fixture("demo_workdir"), tmp_path / "demo")
    shell(command, workdir)
    results = workdir / "results/demo-qwen3_5"
    assert AutoConfig.from_pretrained(results / "tiny-qwen3_5").model_type == "qwen3_5"

    def accuracy(job: str, split: str) -> float:
        return json.loads((results / "eval" / job / split / "metrics.json").read_text())["accuracy"]

    for job, base in [
        ("exp1/main", "base/base"),
        ("exp7/main", "base/base"),
        ("click_grpo/sft", "base/screens"),
        ("click_grpo/grpo", "base/screens"),
    ]:
        assert accuracy(job, "test") > accuracy(base, "test") + 0.3, job
    assert accuracy("click_grpo/grpo", "test") > accuracy("click_grpo/sft", "test")
    said = (results / "logs/train/click_grpo/grpo.log").read_text()
    assert "each prompt computed twice a step (the model's linear-attention layers" in said
    page = (results / "report/index.html").read_text()
    assert all(job in page for job in ("exp1/main", "exp7/main", "click_grpo/sft", "click_grpo/grpo"))

    stage, record = "results/demo-qwen3_5/train/exp1/main", "results/demo/shapes/images/test/00000.png"
    evaluated = json.loads((results / "eval/exp1/main/test/predictions.jsonl").open().readline())
    question = json.loads((workdir / "results/demo/shapes/test.jsonl").open().readline())["question"]
    predicted = shell(f"vlft predict {stage} --image {record} --question {shlex.quote(question)}", workdir)
    assert [json.loads(line)["answer"] for line in predicted.splitlines() if line.startswith("{")] == [
        evaluated["prediction"]
    ]
    said = subprocess.run(
        f"vlft chat {stage} --image {record}",
        shell=True,
        cwd=workdir,
        input=f"{question}\n/quit\n",
        capture_output=True,
        text=True,
    )
    assert said.returncode == 0 and said.stdout.splitlines()[-1] == evaluated["prediction"], said.stderr
    shell(f"vlft export {stage} --cores 2", workdir)  # its config found in config/examples
    assert AutoConfig.from_pretrained(results / "export/exp1/main").model_type == "qwen3_5"


def run_export(command, fixture, tmp_path):
    """In the demo's directory (an output no other job reads); what it holds is checked in
    tests/workflow/test_demo_pipeline.py."""
    demo = fixture("demo_workdir")
    shell(command, demo)
    export = demo / "results/export/exp4/stage2"
    # The model's files alone: no file of Snakemake's (a directory output would hold its timestamp).
    assert {p.name for p in export.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "preprocessor_config.json",
        "README.md",
    }
    assert not [p.name for p in export.iterdir() if p.name.startswith(".")]


def run_chat(command, fixture, tmp_path):
    """Typed lines, in the demo's directory: the first answer is the evaluation's to that record."""
    import json

    demo = fixture("demo_workdir")
    said = subprocess.run(
        command, shell=True, cwd=demo, input="How many shapes are there?\n/quit\n", capture_output=True, text=True
    )
    assert said.returncode == 0, said.stderr
    evaluated = json.loads((demo / "results/eval/exp5/main/test/predictions.jsonl").open().readline())
    assert said.stdout.splitlines()[-1] == evaluated["prediction"]


def run_predict(command, fixture, tmp_path):
    """In a directory of its own beside the demo's results: the answer is the evaluation's to that
    record (the first of the test split), and a click is drawn."""
    import json

    demo = fixture("demo_workdir")
    for part in ("results", "scripts"):
        (tmp_path / part).symlink_to(demo / part)
    answers = [json.loads(line) for line in shell(command, tmp_path).splitlines() if line.startswith("{")]
    experiment = command.split("results/train/")[1].split("/")[0]
    evaluated = json.loads((demo / f"results/eval/{experiment}/main/test/predictions.jsonl").open().readline())
    assert [a["answer"] for a in answers] == [evaluated["prediction"]] and evaluated["id"].startswith("00000")
    assert [(tmp_path / a["drawn"]).is_file() for a in answers if experiment == "click"] == (
        [True] if experiment == "click" else []
    )


RL_IMPORTS = (
    "python scripts/import_dataset.py chat --json swift-grpo/train.jsonl --image-root swift-grpo/images --out data/swift-grpo",
    "python scripts/import_dataset.py vqa --files clevr-r1/train.jsonl --image-root clevr-r1/images --out data/clevr-r1",
    "python scripts/import_dataset.py vqa --files rec/refcoco_train.json --image-root rec/images --out data/refcoco",
    "python scripts/import_dataset.py vqa --files geometry3k/data/train-00000-of-00001.parquet --out data/geometry3k",
    "python scripts/import_dataset.py vqa --files GUI-R1/train.parquet --out data/gui-r1",
    "python scripts/import_dataset.py vqa --files android_control/test.jsonl --image-root android_control/images "
    "--answer gt --out data/android-control",
    "python scripts/import_dataset.py screenspot --json UI-R1/train.json --image-root UI-R1/images --bbox xyxy "
    "--split train --out data/ui-r1",
)


RUNNERS = {
    "pip install -e . && snakemake --cores all": run_quick_start_demo,
    TEST_COMMAND: run_test_suite,
    FAST_PART: run_fast_part,
    "snakemake -n": run_dry_run,
    "snakemake --configfile config/examples/demo-keep-best.yaml --cores all": run_keep_best,
    "snakemake --configfile config/examples/demo-qwen3_5.yaml --cores all": run_demo_qwen3_5,
    "snakemake --dag | dot -Tsvg > dag.svg": run_dag,
    f"snakemake --configfile {EXAMPLE} -n": run_kvasir_plan,
    f"snakemake --configfile {EXAMPLE} --cores all": run_kvasir_plan,
    f"snakemake --configfile {EXAMPLE} --cores all --resources gpu=4": run_kvasir_plan,
    f"snakemake all --configfile {EXAMPLE} --profile profiles/slurm --default-resources slurm_account=myaccount "
    "slurm_partition=gpu": run_kvasir_on_slurm,
    f"snakemake all --configfile {EXAMPLE} --profile profiles/slurm --profile ~/my-site": run_kvasir_on_slurm,
    "snakemake all --profile profiles/slurm --default-resources slurm_account=demo slurm_partition=debug "
    "--dry-run": run_slurm_trial,
    **{sample: run_kvasir_smoke for sample in SMOKE_SAMPLES},
    "snakemake --configfile config/examples/kvasir-vqa-smoke.yaml --cores all": run_kvasir_smoke,
    "snakemake --report report.zip": run_snakemake_report,
    "snakemake --cores all -f results/train/exp4/stage2/adapter": run_retrain,
    "snakemake --cores all -R results/train/exp4/stage2/adapter": run_retrain,
    "python scripts/import_dataset.py kvasir-vqa --parquet kvasir-vqa/data/*.parquet --out data/kvasir": run_import,
    "python scripts/import_dataset.py kvasir-vqa-x1 --x1 kvasir-vqa-x1/data/*.parquet --parquet kvasir-vqa/data/*.parquet "
    "--out data/kvasir-x1": run_import,
    "python scripts/import_dataset.py chat --json chat/train.json --image-root chat/images --out data/chat": run_import,
    "python scripts/import_dataset.py screenspot --json screenspot/screenspot_web.json --out data/screenspot": run_import,
    "python scripts/import_dataset.py screenspot --parquet ScreenSpot/data/test-*.parquet --out data/screenspot-hub": run_import,
    "python scripts/import_dataset.py pairs --parquet rlaif-v/*.parquet --out data/rlaif-v": run_import,
    "python scripts/import_dataset.py vqa --files SLAKE/train.json SLAKE/validate.json SLAKE/test.json --image-root "
    "SLAKE/imgs --category content_type --keep q_lang=en --out data/slake": run_import,
    "python scripts/import_dataset.py vqa --files vqa-rad/data/*.parquet --out data/vqa-rad": run_import,
    **{command: run_import for command in RL_IMPORTS},
    f"snakemake --configfile {CLICK_EXAMPLE} -n": run_click_plan,
    "snakemake -s <clone>/Snakefile --configfile my-study.yaml --cores all": run_from_own_directory,
    "vlft env": run_env,
    "vlft chat results/train/exp5/main --image results/demo/shapes/images/test/00000.png": run_chat,
    "vlft export results/train/exp4/stage2": run_export,
    "python scripts/predict.py results/train/exp5/main --image results/demo/shapes/images/test/00000.png "
    '--question "How many shapes are there?"': run_predict,
    "python scripts/predict.py results/train/click/main --image results/demo/screens/images/test/00000.png "
    '--question "Click the OK button."': run_predict,
}


def test_every_readme_command_has_a_runner():
    commands = readme_commands()
    assert len(commands) == len(set(commands))
    assert set(commands) == set(RUNNERS), f"README commands without a runner: {set(commands) - set(RUNNERS)}"


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs_as_written(command, request, tmp_path):
    from tests.readme_pipelines import BACKGROUND_COMMANDS
    from tests.slurm_runs import README_PIPELINES_RUN

    if command in BACKGROUND_COMMANDS:
        request.getfixturevalue("demo_workdir")  # which starts them (tests/conftest.py)
    background = request.session.stash.get(README_PIPELINES_RUN, None)
    if background is not None and command in background.outcomes:
        outcome = background.outcomes[command]
        assert outcome.ran.wait(timeout=3600), f"`{command}` still ran in the background after an hour"
        if outcome.error is not None:
            raise outcome.error
        return
    RUNNERS[command](command, request.getfixturevalue, tmp_path)
