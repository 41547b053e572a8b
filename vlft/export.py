"""A trained stage as a model of its own: the base weights with the adapter merged in, in the base
checkpoint's dtype (bf16 for Qwen's releases), as safetensors; the tokenizer, chat template and
generation settings of the base; the image processor set to the pixels the stage trained with; and a
README card naming the base, the data, the settings and the metrics. transformers loads it with
from_pretrained alone, and vLLM serves it (`vllm serve <dir>`), without PEFT or this project.

The merge is PEFT's own (merge_and_unload), the same the evaluation answers with, so the exported
model's answers are the evaluation's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vlft.files import atomic_path
from vlft.model_files import NEEDS, require_model_dir
from vlft.trained_stage import TrainedStage
from vlft.modeling import load_base_model, with_adapter

# The base checkpoint's files that are not its weights or config: copied as they are, but the
# image processor's, which gets the stage's pixels.
WEIGHTS = NEEDS["the weights"]


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    config = json.loads((model_dir / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype") or "float32"
    return getattr(torch, name)


def export_stage(
    model_dir: str | Path, stage_dir: str | Path, settings: dict, metrics: dict[str, dict], output: str | Path
) -> None:
    """`settings`: the stage's resolved training settings; `metrics`: its evaluations', by split."""
    model_dir, stage_dir = Path(model_dir), Path(stage_dir)
    require_model_dir(model_dir)
    dtype = checkpoint_dtype(model_dir)
    model = load_base_model(model_dir, torch.device("cpu"), dtype)
    merged = with_adapter(model, TrainedStage.at(stage_dir).adapter, trainable=False).merge_and_unload()
    with atomic_path(output) as tmp:
        merged.save_pretrained(tmp)  # safetensors, sharded as transformers shards
        for path in sorted(model_dir.iterdir()):
            # Hidden files are no model's: a workflow's timestamp (the demo's model is a Snakemake
            # output), a download's .gitattributes.
            if path.name.startswith(".") or path.name in WEIGHTS or (tmp / path.name).exists():
                continue
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        _set_pixels(tmp / "preprocessor_config.json", settings["min_pixels"], settings["max_pixels"])
        (tmp / "README.md").write_text(model_card(model_dir, stage_dir, settings, metrics, dtype))


def _set_pixels(config_path: Path, min_pixels: int, max_pixels: int) -> None:
    """The image processor resizes to the stage's pixel range (Qwen-VL's `size`, and the older keys
    where the base has them)."""
    if not config_path.exists():  # the settings nested in processor_config.json
        return
    config = json.loads(config_path.read_text())
    config["size"] = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if key in config:
            config[key] = value
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def model_card(model_dir: Path, stage_dir: Path, settings: dict, metrics: dict[str, dict], dtype) -> str:
    experiment, stage = stage_dir.parent.name, stage_dir.name
    rows = "".join(
        f"| {split} | {m['n']} | {m['accuracy']:.4f} | {m['loss']:.4f} |\n" for split, m in sorted(metrics.items())
    )
    data = f"dataset `{settings['dataset']}`, splits {', '.join(settings['train_splits'])}"
    if settings.get("filter"):
        data += f", filter `{json.dumps(settings['filter'])}`"
    return f"""# {experiment}/{stage}

LoRA fine-tune of `{model_dir}`, merged into its weights ({str(dtype).removeprefix('torch.')}).
Trained on {data}; answers in the `{settings['answer_format']}` format; images resized to
{settings['min_pixels']}-{settings['max_pixels']} pixels (this directory's image processor does so).
{f"Started from the adapter of `{settings['init_from']}`." if settings.get('init_from') else ""}

## Evaluation

| split | records | accuracy | loss |
|---|---|---|---|
{rows}
## Settings

```json
{json.dumps(settings, indent=2, sort_keys=True)}
```

Load it with `AutoModelForImageTextToText.from_pretrained` and `AutoProcessor.from_pretrained`, or
serve it with `vllm serve` on this directory.
"""
