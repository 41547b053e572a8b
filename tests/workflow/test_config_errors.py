"""Config errors: one sentence naming the key (or the model directory's missing file), before any job."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.helpers import REPO, copy_workflow, snakemake
from vlft.config import NAME_RULE, resolve_config
from vlft.errors import ConfigError
from vlft.plan import build_plan


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("config"))


def config_error(workdir, edit) -> str:
    """The one line Snakemake prints for a config edited by `edit`, which must stop the dry run."""
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    edit(config)
    (workdir / "config/bad.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "--dry-run", "--configfile", "config/bad.yaml", check=False)
    assert result.returncode != 0
    assert not (workdir / "results").exists()
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Invalid config: ")]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0].removeprefix("Invalid config: ")


def stage(config, experiment, index):
    return config["experiments"][experiment]["stages"][index]


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda c: stage(c, "exp1", 0).update(learnin_rate=0.1),
            "experiments.exp1.stages[0]: unknown key 'learnin_rate' (did you mean 'learning_rate'?)",
        ),
        (lambda c: c["defaults"].update(epoch=3), "defaults: unknown key 'epoch' (did you mean 'epochs'?)"),
        (lambda c: c.update(evaluaton={}), "the config: unknown key 'evaluaton' (did you mean 'evaluation'?)"),
        (lambda c: c["defaults"].update(micro_batch="four"), "defaults.micro_batch: 'four' is not of type 'integer'"),
        (
            lambda c: c["defaults"].update(order="randm"),
            "defaults.order: 'randm' is not one of ['random', 'given', 'by_field']",
        ),
        (lambda c: c.pop("model"), "model: required, but the config does not set it"),
        (
            lambda c: c.update(planning={"device": "H1OO"}),
            "planning.device: 'H1OO' is no device the forecast knows (did you mean 'H100'?); it knows A100, B200, "
            "cpu, H100, H200, L40S, MI300X, RTX 4090",
        ),
        (
            lambda c: stage(c, "exp2", 0).update(dataset="kvasir"),
            "experiments.exp2.stages[0].dataset: unknown dataset 'kvasir' (the config defines: screens, shapes)",
        ),
        (
            lambda c: stage(c, "exp3", 1).update(eval_splits=["dev"]),
            "experiments.exp3.stages[1].eval_splits: unknown split 'dev' of dataset 'shapes' (it has: test, train, val)",
        ),
        (
            lambda c: stage(c, "exp4", 1).update(init_from="stage0"),
            "experiments.exp4.stages[1].init_from: stage 'exp4/stage0' does not exist (stages: click/main, "
            "click_grpo/sft, click_grpo/grpo, click_tower/main, exp1/main, "
            "exp2/main, exp3/stage1, exp3/stage2, exp3/stage3, exp4/stage1, exp4/stage2, exp5/main, exp6/main, exp7/main)",
        ),
        (
            lambda c: c["demo"]["datasets"].update(buttons=c["demo"]["datasets"].pop("screens")),
            "demo.datasets.buttons: not a dataset of the config (it defines: screens, shapes)",
        ),
        (
            lambda c: c["demo"]["datasets"]["screens"]["sizes"].pop("test"),
            "demo.datasets.screens.sizes: must give a size for each split of datasets.screens (test, train), "
            "and for no other",
        ),
        (
            lambda c: c["datasets"].update(base=c["datasets"].pop("screens"))
            or stage(c, "click", 0).update(dataset="base"),
            "datasets.base: the name is reserved unless it is the defaults' dataset",
        ),
        (
            lambda c: stage(c, "exp1", 0).update(image_groups=True, packing=False),
            "experiments.exp1.stages[0].image_groups: needs packing: true (a group is laid out in one packed row)",
        ),
        (
            lambda c: c["experiments"].update({"..": c["experiments"]["exp1"]}),
            f"experiments: '..' is not a valid name ({NAME_RULE})",
        ),
        (
            lambda c: stage(c, "exp3", 1).update(name="my stage"),
            f"experiments.exp3.stages[1].name: 'my stage' is not a valid name ({NAME_RULE})",
        ),
    ],
    ids=[
        "typo-in-stage",
        "typo-in-defaults",
        "typo-at-top",
        "wrong-type",
        "not-an-option",
        "missing-key",
        "device-typo",
        "unknown-dataset",
        "unknown-split",
        "init-from-missing-stage",
        "demo-dataset-not-in-datasets",
        "demo-dataset-without-a-split",
        "base-reserved-as-a-dataset-name",
        "image-groups-without-packing",
        "dot-dot-experiment",
        "stage-name-with-a-space",
    ],
)
def test_config_error_is_one_sentence_naming_the_key(workdir, edit, message):
    assert config_error(workdir, edit) == message


@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "../x", "my exp", "tab\tname", "", "é"])
@pytest.mark.parametrize("where", ["experiment", "stage", "dataset", "split", "demo split size"])
def test_every_name_that_becomes_a_folder_is_checked_by_one_pattern(name, where):
    """Experiments, stages, datasets and splits all name folders of the results: one rule for all."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    if where == "experiment":
        config["experiments"][name] = config["experiments"]["exp1"]
    elif where == "stage":
        stage(config, "exp1", 0)["name"] = name
    elif where == "dataset":
        config["datasets"][name] = config["datasets"]["shapes"]
    elif where == "split":
        config["datasets"]["shapes"]["splits"][name] = "x.jsonl"
    else:
        config["demo"]["datasets"]["shapes"]["sizes"][name] = 1
    with pytest.raises(ConfigError, match=re.escape(f"'{name}' is not a valid name ({NAME_RULE})")):
        resolve_config(config)


def test_names_with_dots_inside_are_valid():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["lr1e-4_v1.5"] = config["experiments"]["exp1"]
    assert "lr1e-4_v1.5" in resolve_config(config)["experiments"]


def test_cli_prints_a_config_error_as_one_sentence(tmp_path, tiny_model_dir):
    """A job's own config check (the vision cache's size budget) prints one line, not a tuple."""
    from vlft.demo.shapes import make_dataset
    from vlft.caches.image_cache import PixelSettings, build_image_cache
    from vlft.modeling import load_image_processor
    from vlft.data.records import prepare_split

    make_dataset({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 2}, seed=0)
    prepare_split(tmp_path / "train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    settings = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(tmp_path / "prepared.jsonl", tmp_path / "images", tmp_path / "pixels", settings)
    output = tmp_path / "vision"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/cache_vision.py"),
            "--pixels",
            str(tmp_path / "pixels"),
            "--model",
            str(tiny_model_dir),
            "--max-gb",
            "1e-9",
            "--gpus",
            "0",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    size = float(re.search(r"would take (\S+) GB", result.stderr).group(1))
    # The last line of stderr (transformers' weight-loading progress bar comes before it), and the only error.
    assert result.stderr.count("error: ") == 1 and result.stderr.splitlines()[-1] == (
        f"error: vision_cache_max_gb: the vision cache {output} would take {size:.3g} GB, more than the 1e-09 GB "
        "it allows; raise vision_cache_max_gb or set vision_cache: false for the experiments that use it"
    )
    assert not output.exists()


def test_init_from_cycle():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp4"]["stages"][0]["init_from"] = "stage2"
    with pytest.raises(ConfigError, match=r"cycle: exp4/stage1 -> exp4/stage2 -> exp4/stage1"):
        build_plan(config)


def test_init_from_with_a_different_lora_shape():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"]["exp4"]["stages"][1]["lora_r"] = 8
    with pytest.raises(ConfigError, match=r"experiments.exp4.stages\[1\].lora_r: must equal that of 'exp4/stage1'"):
        build_plan(config)


def test_every_path_a_rule_passes_is_quoted(workdir):
    """A results directory with a space in its name: each job's command, as Snakemake runs it, gives
    every path whole (an unquoted one splits in two: `unrecognized arguments`)."""
    # The demo's datasets and model are made under the results directory too: all of it moves.
    text = (workdir / "config/config.yaml").read_text().replace("results/", "my results/")
    config = yaml.safe_load(text)
    config["results"] = "my results"
    (workdir / "config/spaced.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "--dry-run", "--printshellcmds", "--configfile", "config/spaced.yaml")
    commands = [
        line[line.index("scripts/") :].split(" 2>&1")[0]  # after the launcher (vlft.jobs.launch)
        for line in result.stdout.splitlines()
        if "python -m vlft.jobs.launch " in line
    ]
    scripts = {command.split()[0] for command in commands}
    assert {"scripts/train.py", "scripts/evaluate.py", "scripts/cache_images.py", "scripts/report.py"} <= scripts
    arguments = [argument for command in commands for argument in shlex.split(command)]
    assert "--init-adapter" in arguments and "--adapter" in arguments
    paths = [a for a in arguments if "results" in a]
    assert paths and all(a.startswith("my results/") or "=my results/" in a for a in paths), paths
    assert "my" not in arguments


@pytest.mark.parametrize(
    "remove, lacks",
    [
        (["preprocessor_config.json"], "preprocessor_config.json (the image processor's settings)"),
        (["tokenizer.json"], "tokenizer.json or vocab.json (the tokenizer)"),
        (
            ["model.safetensors"],
            "model.safetensors or model.safetensors.index.json or pytorch_model.bin or pytorch_model.bin.index.json "
            "(the weights)",
        ),
    ],
)
def test_a_model_directory_copied_in_part_is_one_sentence_before_any_job(
    workdir, tiny_model_dir, tmp_path, remove, lacks
):
    """It was a transformers traceback with advice for the Hub, after prepare_split had run."""
    partial = tmp_path / "model"
    shutil.copytree(tiny_model_dir, partial)
    for name in remove:
        (partial / name).unlink()

    def use_partial_model(config):  # a study's own config: the demo's makes its model
        config.clear()
        config["model"] = {"path": str(partial)}
        config["datasets"] = {"mine": {"image_root": "my/images", "splits": {"train": "my/train.jsonl"}}}
        config["experiments"] = {"only": {"stages": [{"name": "main", "eval_splits": ["train"]}]}}

    problem = f"lacks {lacks}: copy every file of the checkpoint there"
    assert config_error(workdir, use_partial_model) == f"model.path: {partial} {problem}"
    if remove != ["preprocessor_config.json"]:
        return
    # A job given it (the directory changed after the run began, or a script run by hand) says the same.
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/cache_images.py"),
            "--records",
            "none",
            "--image-root",
            "none",
            "--model",
            str(partial),
        ]
        + ["--min-pixels", "4096", "--max-pixels", "16384", "--output", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and result.stderr == f"error: {partial}: {problem}\n"


@pytest.mark.parametrize("family", ["qwen3_5_moe", "llava"])
def test_a_checkpoint_of_a_family_not_trained_here_is_one_sentence_before_any_job(workdir, tmp_path, family):
    """A tiny Qwen3.5 (transformers' own classes) once trained without a word, its packed samples
    mixed by its DeltaNet layers, and then every evaluation died in the decode cache. A family not
    trained here yet (the Qwen3.5 MoE: its published config, which transformers loads) and a family
    it does not know at all are refused, naming the file, the model_type and what it trains."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig
    from vlft.demo.tiny_model import make_tiny_model

    model = tmp_path / "model"
    make_tiny_model(model, family="qwen3_5")  # its tokenizer and processor; the MoE's config in place of its own
    Qwen3_5MoeConfig().save_pretrained(model)
    assert AutoConfig.from_pretrained(model).text_config.num_experts > 1
    if family == "llava":
        settings = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(settings | {"model_type": "llava"}))

    def use_model(config):
        config.clear()
        config["model"] = {"path": str(model)}
        config["datasets"] = {"mine": {"image_root": "my/images", "splits": {"train": "my/train.jsonl"}}}
        config["experiments"] = {"only": {"stages": [{"name": "main", "eval_splits": ["train"]}]}}

    trained = (
        "Qwen3-VL (qwen3_vl), Qwen3-VL (MoE) (qwen3_vl_moe), Qwen2.5-VL (qwen2_5_vl), Qwen2-VL (qwen2_vl), "
        "Qwen3.5 / Qwen3.6 (qwen3_5)"
    )
    said = {
        "qwen3_5_moe": "names model_type 'qwen3_5_moe' (Qwen3.5 / Qwen3.6 (MoE)), which this version does not train "
        "yet: its experts beside the Gated DeltaNet layers have not run through these rules yet; the dense "
        "Qwen3.5 / Qwen3.6 models (qwen3_5) train",
        "llava": "names model_type 'llava', a family this version does not know",
    }[family]
    assert (
        config_error(workdir, use_model)
        == f"model: {model / 'config.json'} {said}; the families it trains are {trained}"
    )


def test_a_sharded_checkpoint_missing_a_shard_is_one_sentence(tiny_model_dir, tmp_path):
    from vlft.model_files import model_dir_problem

    sharded = tmp_path / "model"
    shutil.copytree(tiny_model_dir, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert model_dir_problem(sharded) == (
        "lacks model-00002-of-00002.safetensors (named by model.safetensors.index.json): "
        "copy every file of the checkpoint there"
    )
    (sharded / "preprocessor_config.json").rename(sharded / "moved.json")
    nested = {"image_processor": json.loads((sharded / "moved.json").read_text())}
    (sharded / "processor_config.json").write_text(json.dumps(nested))
    (sharded / "model-00001-of-00002.safetensors").rename(sharded / "model-00002-of-00002.safetensors")
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert model_dir_problem(sharded) is None  # the processor's settings nested in processor_config.json do


@pytest.mark.parametrize(
    "duplicated, lines",
    [
        ("  exp1:\n    stages:\n      - name: again\n", "exp1"),  # an experiment written twice
        ("experiments:\n  other:\n    stages:\n      - name: main\n", "experiments"),  # a second section
    ],
)
def test_a_key_written_twice_is_one_sentence_naming_both_lines(workdir, duplicated, lines):
    """YAML keeps the last of a key written twice: the first experiment, or every experiment of a
    first `experiments:` section, would be dropped without a word."""
    text = (workdir / "config/config.yaml").read_text()
    if duplicated.startswith("  "):  # under experiments:
        text = text.replace("experiments:\n", "experiments:\n" + duplicated, 1)
    else:
        text += duplicated
    (workdir / "config/twice.yaml").write_text(text)
    first = text.splitlines().index(f"  {lines}:" if duplicated.startswith("  ") else f"{lines}:") + 1
    again = len(text.splitlines()) - text.splitlines()[::-1].index(
        f"  {lines}:" if duplicated.startswith("  ") else f"{lines}:"
    )
    result = snakemake(workdir, "--dry-run", "--configfile", "config/twice.yaml", check=False)
    assert result.returncode != 0
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Invalid config: ")]
    assert said == [
        f"Invalid config: config/twice.yaml: key '{lines}' is written twice in one mapping, at lines "
        f"{min(first, again)} and {max(first, again)}; YAML would keep only the second"
    ], (result.stdout + result.stderr)


@pytest.mark.skipif(
    os.getuid() == 0 and not shutil.which("setpriv"),
    reason="as root, needs setpriv to give up its right to write anywhere",
)
@pytest.mark.parametrize("ran_before", [True, False])
def test_a_study_one_cannot_write_is_one_sentence_even_for_a_dry_run(tmp_path, ran_before):
    """Another user's study (or one on a read-only file system): Snakemake writes its records there
    even for a dry run, which ended in a 30-line traceback. Root writes anywhere, so as root the
    run gives up that right (setpriv), as another user has none."""
    study = copy_workflow(tmp_path / "theirs")
    if ran_before:
        snakemake(study, "--dry-run")
    subprocess.run(["chmod", "-R", "a-w", str(study)], check=True)
    as_another = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.getuid() == 0 else []
    try:
        result = subprocess.run(
            [*as_another, sys.executable, "-m", "snakemake", "--dry-run"],
            cwd=study,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(study)], check=True)
    said = result.stdout + result.stderr
    assert result.returncode != 0
    blocked = study / ".snakemake" if ran_before else study
    assert (
        f"Snakemake keeps this study's records and lock in {study / '.snakemake'}, and {blocked} is not writable by you"
        in said
    ), said
    assert "Traceback" not in said and "PermissionError" not in said
