"""The demo end to end: every output exists, training really learns, the report shows it all."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import REPO
from vlft.modeling import load_base_model

EXPERIMENT_STAGES = [
    ("exp1", "main"),
    ("exp2", "main"),
    ("exp3", "stage1"),
    ("exp3", "stage2"),
    ("exp3", "stage3"),
    ("exp4", "stage1"),
    ("exp4", "stage2"),
    ("exp5", "main"),
    ("exp6", "main"),
    ("exp7", "main"),
    ("click", "main"),
    ("click_tower", "main"),
    ("click_grpo", "sft"),
    ("click_grpo", "grpo"),
]
CLICK_EXPERIMENTS = ("click", "click_tower", "click_grpo")


def base_stage_of(experiment):
    return "screens" if experiment in CLICK_EXPERIMENTS else "base"


def metrics(workdir, experiment, stage, split):
    return json.loads((workdir / f"results/eval/{experiment}/{stage}/{split}/metrics.json").read_text())


@pytest.mark.parametrize("experiment,stage", EXPERIMENT_STAGES)
def test_every_stage_beats_the_untrained_base_model(demo_workdir, experiment, stage):
    base = metrics(demo_workdir, "base", base_stage_of(experiment), "test")["accuracy"]
    trained = metrics(demo_workdir, experiment, stage, "test")["accuracy"]
    assert trained >= base + 0.3, f"{experiment}/{stage}: {trained:.3f} vs base {base:.3f}"


def test_later_curriculum_stages_learn_what_earlier_ones_left_out(demo_workdir):
    # exp4 stage 1 sees only color and yes/no questions; stage 2 adds count and location.
    stage1 = metrics(demo_workdir, "exp4", "stage1", "test")["accuracy_by_category"]
    stage2 = metrics(demo_workdir, "exp4", "stage2", "test")["accuracy_by_category"]
    assert stage1["count"] < 0.3 and stage2["count"] > stage1["count"] + 0.3


def test_click_stage_points_inside_the_target_far_more_often_than_the_base_model(demo_workdir):
    trained = metrics(demo_workdir, "click", "main", "test")
    base = metrics(demo_workdir, "base", "screens", "test")
    assert trained["answer_format"] == base["answer_format"] == "click"
    assert trained["dataset"] == base["dataset"] == "screens"
    assert trained["n"] == trained["n_with_box"] == 200
    # The untrained model rarely says a point at all; the trained one always does, mostly in the box.
    assert base["accuracy"] <= 0.2 and trained["accuracy"] >= 0.6, (base, trained)
    assert trained["unparseable"] <= 2 and trained["mean_distance"] < 0.2
    assert set(trained["accuracy_by_category"]) == {"button", "icon"}
    rows = [json.loads(line) for line in (demo_workdir / "results/eval/click/main/test/predictions.jsonl").open()]
    assert sum(r["correct"] for r in rows) / len(rows) == trained["accuracy"]
    # Each answer as it was taught: "(x, y)" on the 0-1000 grid of a Qwen3-VL.
    assert sum(re.fullmatch(r"\(\d{1,4}, \d{1,4}\)", r["prediction"]) is not None for r in rows) >= 0.95 * len(rows)


def test_adapter_loads_with_peft_and_log_has_every_field(demo_workdir):
    adapter = demo_workdir / "results/train/exp4/stage2/adapter"
    base = load_base_model(demo_workdir / "results/demo/tiny-qwen3-vl", torch.device("cpu"), torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter))
    assert any("lora_A" in name for name, _ in model.named_parameters())
    log = [json.loads(line) for line in (adapter.parent / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, len(log) + 1))
    for field in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "memory_gb"):
        assert all(isinstance(row[field], float) for row in log), field
    assert log[-1]["loss"] < log[0]["loss"] / 3
    # Checkpoints served their purpose and are gone; they were never declared outputs.
    assert not list((demo_workdir / "results/checkpoints").glob("*/*/*/step-*"))
    # Every stage's curves, one TensorBoard run each.
    stages = {
        p.parent.relative_to(demo_workdir / "results/train")
        for p in (demo_workdir / "results/train").glob("*/*/adapter")
    }
    runs = {
        p.parent.relative_to(demo_workdir / "results/tensorboard")
        for p in (demo_workdir / "results/tensorboard").glob("*/*/events.out.tfevents.*")
    }
    assert runs == stages and len(stages) >= 8


def test_the_curriculum_is_evaluated_as_it_trains_and_keeps_its_best_adapter(demo_workdir):
    """exp4: 40 val records every 25 steps; stage 2 goes on from stage 1's steps and keeps its best."""
    stage1, stage2 = (
        json.loads((demo_workdir / f"results/train/exp4/{stage}/summary.json").read_text())
        for stage in ("stage1", "stage2")
    )
    for summary in (stage1, stage2):
        evals = summary["evaluations_during_training"]
        steps = list(range(0, summary["steps"], 25)) + [summary["steps"]]
        assert [r["step"] for r in evals] == sorted(set(steps)) and all(r["n"] == 40 for r in evals)
        assert 0 < summary["eval_share"] < 0.5
    assert stage1["evaluations_during_training"][-1]["accuracy"] > stage1["evaluations_during_training"][0]["accuracy"]
    assert stage2["steps_before"] == stage1["steps"]
    best = max(r["accuracy"] for r in stage2["evaluations_during_training"] if r["step"] > 0)
    assert stage2["kept"]["best_metric"] == "accuracy" and stage2["kept"]["accuracy"] == best
    # Its TensorBoard curves go on after stage 1's steps.
    events = EventAccumulator(str(demo_workdir / "results/tensorboard/exp4/stage2")).Reload()
    assert [e.step for e in events.Scalars("eval/accuracy")] == [
        stage1["steps"] + r["step"] for r in stage2["evaluations_during_training"]
    ]
    assert "eval/accuracy/count" in events.Tags()["scalars"]
    # exp4 stage 1 is watched, exp3 stage 1 is not: the same adapter all the same (a repeat).
    exp3 = json.loads((demo_workdir / "results/train/exp3/stage1/summary.json").read_text())
    assert exp3["data_and_settings"] == stage1["data_and_settings"]


# The demo's noise in a test accuracy: two standard errors of a share on its 200 test records at
# the accuracies its stages reach (0.6 to 0.9): 2 * sqrt(0.25 / 200), about 7 points.
DEMO_ACCURACY_NOISE = 0.07


def pairs_preferred(steps: list[dict]) -> tuple[float, int]:
    """The share of the steps' pairs whose chosen answer gains on the rejected one, and their number
    (a step's samples are its pairs' two answers)."""
    pairs = [r["samples"] // 2 for r in steps]
    return sum(r["rewards/accuracies"] * n for r, n in zip(steps, pairs)) / sum(pairs), sum(pairs)


def test_the_preference_stage_learns_its_pairs_and_keeps_its_answers(demo_workdir):
    """exp7, DPO from exp1's adapter: the share of its steps' pairs whose chosen answer gains on the
    rejected one rises over its steps, and held-out pairs are preferred after them; its accuracy
    stays within the demo's noise of exp1's."""
    log = [json.loads(line) for line in (demo_workdir / "results/train/exp7/main/log.jsonl").open()]
    tenth = max(1, len(log) // 10)
    (first, first_pairs), (last, last_pairs) = (pairs_preferred(log[:tenth]), pairs_preferred(log[-tenth:]))
    # A rise beyond noise: two standard errors of the difference of two shares, each over its
    # tenth's pairs (some 60 a tenth here: 0.16). At the first steps the policy is the reference,
    # and a pair's margin is the rounding between its reference pass and its step's forward: an
    # exact tie (not preferred) where both laid it out alike, a coin's toss where they did not
    # (0.06 then 0.35 at step 1; the first tenth 0.49 then 0.62, the last 0.81 either way).
    noise = 2 * math.sqrt(first * (1 - first) / first_pairs + last * (1 - last) / last_pairs)
    assert last > first + noise and log[-1]["rewards/margins"] > 0, (first, last, noise)
    assert all(r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"]) for r in log)
    start = metrics(demo_workdir, "exp1", "main", "test")["accuracy"]
    tuned = metrics(demo_workdir, "exp7", "main", "test")["accuracy"]
    assert tuned >= start - DEMO_ACCURACY_NOISE, (start, tuned)
    events = EventAccumulator(str(demo_workdir / "results/tensorboard/exp7/main")).Reload()
    assert {"train/rewards/accuracies", "train/rewards/margins"} <= set(events.Tags()["scalars"])
    summary = json.loads((demo_workdir / "results/train/exp7/main/summary.json").read_text())
    assert summary["preference_accuracy_end"] > summary["preference_accuracy_start"]
    # Its held-out pairs, the val split's (the first of its eval_splits), judged after its last step:
    # preferred as the training pairs are by then (they are made alike), above chance.
    val_pairs = sum(1 for line in (demo_workdir / "results/prepared/shapes/val.jsonl").open() if '"rejected"' in line)
    assert summary["held_out_pairs"] == val_pairs > 0
    assert summary["held_out_preference_accuracy"] > 0.6 and summary["held_out_reward_margin"] > 0, summary
    assert {"eval/rewards/accuracies", "eval/rewards/margins"} <= set(events.Tags()["scalars"])
    page = (demo_workdir / "results/report/index.html").read_text().replace("<wbr>", "")  # headers' breaks
    section = page.split("<h2>Preference stages</h2>")[1].split("<h2>")[0]
    assert "<td>exp7</td>" in section and "<td>exp1/main</td>" in section and "<td>exp1</td>" not in section
    assert "held_out_preference_accuracy" in section


def test_the_reward_stage_raises_its_starts_point_in_box_accuracy(demo_workdir):
    """click_grpo: GRPO from a 3-epoch SFT click stage, 60 steps of 8 instructions x 8 sampled points.
    Its point-in-box accuracy on the test split beats its start's by more than the demo's noise
    (at the demo's seed 0: 0.515 to 0.715; with the stages' seed 1, 2, 3 instead, +0.155 to +0.19:
    see the README);
    its steps' mean reward rises; the report draws its reward curve beside its start."""
    start = metrics(demo_workdir, "click_grpo", "sft", "test")["accuracy"]
    tuned = metrics(demo_workdir, "click_grpo", "grpo", "test")["accuracy"]
    assert tuned >= start + DEMO_ACCURACY_NOISE, (start, tuned)
    log = [json.loads(line) for line in (demo_workdir / "results/train/click_grpo/grpo/log.jsonl").open()]
    summary = json.loads((demo_workdir / "results/train/click_grpo/grpo/summary.json").read_text())
    assert summary["reward_end"] > summary["reward_start"], summary
    assert all(r["completions/max_length"] <= 12 and r["kl"] >= 0 for r in log)
    events = EventAccumulator(str(demo_workdir / "results/tensorboard/click_grpo/grpo")).Reload()
    assert {"train/reward", "train/rewards/click_in_box/mean", "train/kl"} <= set(events.Tags()["scalars"])
    page = (demo_workdir / "results/report/index.html").read_text()
    section = page.split("<h2>Reward stages</h2>")[1].split("<h2>")[0]
    assert "<td>click_grpo/sft</td>" in section and "reward_end" in section


def test_chain_of_thought_stage_generates_reasoning_then_answer(demo_workdir):
    rows = [json.loads(line) for line in (demo_workdir / "results/eval/exp5/main/test/predictions.jsonl").open()]
    with_reasoning = [r for r in rows if "Final answer:" in r["prediction"] and len(r["prediction"]) > 30]
    assert len(with_reasoning) > 0.9 * len(rows)


def test_report_has_every_job_beside_the_base_model(demo_workdir):
    report = demo_workdir / "results/report"
    page = (report / "index.html").read_text()
    for experiment, stage in EXPERIMENT_STAGES:
        assert f"<td>{experiment}</td>" in page and f"<td>{stage}</td>" in page
    # Loss curves, accuracy by category (a panel per split), accuracy during training (exp4's),
    # the reward stage's rewards.
    assert page.count('<figure class="chart"') == 4 and "<h2>Accuracy during training</h2>" in page
    assert all((report / name).stat().st_size > 0 for name in ("loss_curves.png", "accuracy_by_category.png"))
    assert "<script" not in page and 'src="http' not in page  # self-contained: images inline
    results = (report / "results.csv").read_text().splitlines()
    assert results[0].startswith("experiment,stage,split,accuracy,ci95_low,ci95_high,loss")
    # The shapes' stages and base model on val and test; the click stages and base model on test.
    clicks = sum(experiment in CLICK_EXPERIMENTS for experiment, _ in EXPERIMENT_STAGES)
    assert len(results) == 1 + 2 * (len(EXPERIMENT_STAGES) - clicks + 1) + clicks + 1
    # Each stage beside the base model on its own dataset: the click stage beside base/screens.
    table = {tuple(row.split(",")[:3]): row for row in results[1:]}
    header = results[0].split(",")
    for experiment, stage in EXPERIMENT_STAGES:
        row = dict(zip(header, table[experiment, stage, "test"].split(",")))
        base = metrics(demo_workdir, "base", base_stage_of(experiment), "test")["accuracy"]
        assert float(row["base_accuracy"]) == base, (experiment, stage)  # pandas writes floats that read back exactly
    jobs = (report / "jobs.csv").read_text().splitlines()
    assert len(jobs) == 1 + len(EXPERIMENT_STAGES) and "wall_time_s" in jobs[0]


@pytest.mark.parametrize("experiment, dataset", [("exp5", "shapes"), ("click", "screens")])
def test_predict_answers_as_the_stages_evaluation_does(demo_workdir, tmp_path, experiment, dataset):
    """scripts/predict.py, given the stage alone, finds its base model, pixels and answer format, and
    answers each record of the test split as the evaluation did; a click's point is drawn."""
    from PIL import Image

    records = [json.loads(line) for line in (demo_workdir / f"results/prepared/{dataset}/test.jsonl").open()][:6]
    asked = tmp_path / "asked.jsonl"
    asked.write_text(
        "".join(
            json.dumps({"image": f"results/demo/{dataset}/images/{r['image']}", "question": r["question"]}) + "\n"
            for r in records
        )
    )
    # Images relative to the questions' file: here, the demo's folder.
    (tmp_path / "results").symlink_to(demo_workdir / "results")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/predict.py"), str(demo_workdir / f"results/train/{experiment}/main")]
        + ["--questions", str(asked), "--drawn", str(tmp_path / "drawn")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    evaluated = [
        json.loads(line) for line in (demo_workdir / f"results/eval/{experiment}/main/test/predictions.jsonl").open()
    ]
    assert [a["answer"] for a in answers] == [p["prediction"] for p in evaluated[: len(records)]]
    assert [a["question"] for a in answers] == [r["question"] for r in records]
    if experiment == "click":
        assert [a["point"] for a in answers] == [p["point"] for p in evaluated[: len(records)]]
        for answer, record in zip(answers, records):
            with Image.open(answer["drawn"]) as drawn:
                assert drawn.size == (record["width"], record["height"])
    else:
        assert not (tmp_path / "drawn").exists()


def test_an_exported_stage_loads_alone_and_answers_as_its_evaluation(demo_workdir, tmp_path):
    """`vlft export results/train/exp4/stage2`: transformers loads it with from_pretrained alone; its
    logits are base + adapter's; its answers on the test split are the evaluation's, word for word."""
    import yaml
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from tests.helpers import snakemake
    from vlft.generation.evaluate import evaluate_split
    from vlft.plan import build_plan

    snakemake(demo_workdir, "--cores", "2", "results/export/exp4/stage2/config.json")
    export = demo_workdir / "results/export/exp4/stage2"
    stage = demo_workdir / "results/train/exp4/stage2"
    config = yaml.safe_load((demo_workdir / "config/config.yaml").read_text())
    plan = build_plan(config)
    settings = plan.stage("exp4", "stage2").settings
    size = AutoImageProcessor.from_pretrained(export).size
    assert (size["shortest_edge"], size["longest_edge"]) == (settings["min_pixels"], settings["max_pixels"])
    assert AutoTokenizer.from_pretrained(export).chat_template
    card = (export / "README.md").read_text()
    assert "# exp4/stage2" in card and "Started from the adapter of `exp4/stage1`." in card

    # Text through both in float64: the merge rounds each merged weight once to the checkpoint's
    # float32 (2^-24 of it); through 2 layers of 64-wide sums that stays near 1e-6 of the logits,
    # where an adapter left out or merged twice moves them by far more than 1e-3.
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float64).eval()
    base = load_base_model(demo_workdir / "results/demo/tiny-qwen3-vl", torch.device("cpu"), torch.float64)
    unmerged = PeftModel.from_pretrained(base, str(stage / "adapter")).eval()
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, unmerged(input_ids=ids).logits
    scale = b.abs().max()
    assert (a - b).abs().max() <= 1e-5 * scale
    with torch.no_grad(), unmerged.disable_adapter():
        plain = unmerged(input_ids=ids).logits
    assert (plain - b).abs().max() > 1e-3 * scale  # the adapter changes them: the check above can fail

    eval_settings = plan.eval_settings("exp4", "stage2", resolve_evaluation(config))
    evaluate_split(
        str(export),
        None,
        str(demo_workdir / "results/prepared/shapes/test.jsonl"),
        str(demo_workdir / "results/cache/images/shapes/test/4096-16384"),
        eval_settings,
        tmp_path / "predictions.jsonl",
        tmp_path / "metrics.json",
    )
    ours = [json.loads(line)["prediction"] for line in (tmp_path / "predictions.jsonl").open()]
    evaluated = [
        json.loads(line)["prediction"]
        for line in (demo_workdir / "results/eval/exp4/stage2/test/predictions.jsonl").open()
    ]
    assert ours == evaluated


def resolve_evaluation(config: dict) -> dict:
    from vlft.config import resolve_config

    return resolve_config(config)["evaluation"]


def test_vllm_serves_an_exported_stage(demo_workdir):
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (it needs a CUDA GPU)")
    from tests.helpers import snakemake

    snakemake(demo_workdir, "--cores", "2", "results/export/exp4/stage2/config.json")
    model = vllm.LLM(str(demo_workdir / "results/export/exp4/stage2"), max_model_len=512)
    [output] = model.generate(["Hello"], vllm.SamplingParams(max_tokens=4, temperature=0))
    assert output.outputs[0].token_ids


def test_the_run_says_where_its_results_are_first_and_who_won_and_where_the_report_is_last(demo_workdir):
    import pandas as pd

    from vlft.report.study import winners

    said = (demo_workdir.parent / "terminal.txt").read_text().strip().splitlines()
    assert "Results of this study: results/" in said
    # Read top to bottom, no warning a researcher cannot act on: the libraries' API changes, addressed
    # to this code, and CUDA's complaints on a machine without it.
    noise = ("deprecated", "warning", "Cannot re-initialize CUDA")
    assert [line for line in said if any(word.lower() in line.lower() for word in noise)] == []
    # Its own progress as each job finished: jobs done of all, time spent, time left by the forecast.
    progress = [
        re.match(r"Study: (\d+) of (\d+) jobs done .*; (.+) spent; about (.+) left by the forecast", line)
        for line in said
    ]
    counts = [(int(m.group(1)), int(m.group(2))) for m in progress if m]
    [total] = {total for _, total in counts}
    assert [done for done, _ in counts] == list(range(1, total + 1))
    assert said.index("Results of this study: results/") < next(i for i, m in enumerate(progress) if m)
    assert any(line.startswith("Study: its data and model made, the forecast: ") for line in said)
    [done] = [line for line in said if line.startswith("Study done in ")]
    assert re.search(
        r"against .+ forecast at \d+ jobs at once \(--cores \d+\); its GPU jobs took .+ against .+ predicted \(\d", done
    )
    expected = winners(pd.read_csv(demo_workdir / "results/report/results.csv", keep_default_na=False))
    # The run's own last words, before Snakemake names its log file.
    end = said.index("The report: results/report/index.html")
    assert [line for line in said[end + 1 :] if not line.startswith(("Complete log", "Elapsed time"))] == []
    last = said[end - len(expected) : end]
    for line, row in zip(last, expected.itertuples(), strict=True):
        name = f"{row.dataset}/{row.split}" if row.dataset else row.split
        assert line.startswith(f"{name}: {row.best} won, accuracy {row.accuracy:.3f} of {row.n}")
