"""What a model directory must hold for every job to load it: checked when the config is read (so
that a checkpoint copied in part fails in one sentence before any job runs) and again by the jobs
that load it. Without it, transformers raised a traceback with advice for the Hub that does not
apply, and only once prepare_split had run."""

from __future__ import annotations

import json
from pathlib import Path

from vlft.errors import InputError
from vlft.families import family_problem

# Each need, and the files of which any one meets it (transformers' own names and fallbacks).
NEEDS = {
    "the model's config": ["config.json"],
    "the tokenizer": ["tokenizer.json", "vocab.json"],
    "the weights": [
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ],
}
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def model_dir_problem(model_dir: str | Path) -> str | None:
    """Why `model_dir` cannot be loaded as a checkpoint (the files it lacks), or None; said of it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return "is not a directory"
    missing = [
        f"{' or '.join(names)} ({need})"
        for need, names in NEEDS.items()
        if not any((model_dir / n).is_file() for n in names)
    ]
    if not _has_image_processor(model_dir):
        missing.insert(1, "preprocessor_config.json (the image processor's settings)")
    for index in WEIGHT_INDEXES:
        if (model_dir / index).is_file():
            shards = sorted(set(json.loads((model_dir / index).read_text()).get("weight_map", {}).values()))
            missing += [f"{shard} (named by {index})" for shard in shards if not (model_dir / shard).is_file()]
    if not missing:
        return None
    return f"lacks {', '.join(missing)}: copy every file of the checkpoint there"


def require_model_dir(model_dir: str | Path) -> None:
    if problem := model_dir_problem(model_dir):
        raise InputError(model_dir, problem)


def _has_image_processor(model_dir: Path) -> bool:
    return _image_processor_settings(model_dir) is not None


def _image_processor_settings(model_dir: Path) -> dict | None:
    """preprocessor_config.json, or the image processor's settings nested in processor_config.json."""
    if (model_dir / "preprocessor_config.json").is_file():
        return json.loads((model_dir / "preprocessor_config.json").read_text())
    nested = model_dir / "processor_config.json"
    return json.loads(nested.read_text()).get("image_processor") if nested.is_file() else None


def checkpoint_pixels(model_dir: str | Path) -> tuple[int, int]:
    """The image area range (min_pixels, max_pixels) the checkpoint's own image processor resizes
    to: `size` {shortest_edge, longest_edge} as transformers writes it now (Qwen3-VL), or
    min_pixels / max_pixels as Qwen2-VL's and Qwen2.5-VL's processors were saved."""
    model_dir = Path(model_dir)
    settings = _image_processor_settings(model_dir)
    if settings is None:
        raise InputError(model_dir, "has no preprocessor_config.json to read the image processor's pixel range from")
    size = settings.get("size") or {}
    low, high = size.get("shortest_edge", settings.get("min_pixels")), size.get(
        "longest_edge", settings.get("max_pixels")
    )
    if not (isinstance(low, int) and isinstance(high, int)):
        raise InputError(
            model_dir / "preprocessor_config.json", "names no pixel range (size or min_pixels / max_pixels)"
        )
    return low, high


def hub_processor_dir(hub_id: str, revision: str | None) -> Path:
    """Where Hugging Face's cache holds `hub_id`'s image processor settings, fetched alone (a few KB,
    by the plan, where the driver runs) while the model itself is not fetched yet."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            return Path(hf_hub_download(hub_id, name, revision=revision)).parent
        except EntryNotFoundError:
            continue
    raise InputError(hub_id, "has no preprocessor_config.json or processor_config.json on the Hub")


def hub_files_dir(hub_id: str, revision: str | None, names: tuple[str, ...]) -> Path | None:
    """Where Hugging Face's cache holds these small files of `hub_id` (its config, image processor
    and tokenizer: what a plan counts with), each fetched alone where the cache lacks it; None where
    one cannot be had (offline, or not on the Hub)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path([hf_hub_download(hub_id, name, revision=revision) for name in names][0]).parent
    except Exception:  # noqa: BLE001 (offline, gated, missing: the plan predicts nothing, and says so)
        return None


def model_config_file(model: dict) -> Path | None:
    """The checkpoint's config.json: in `model.path`, or, for a Hub id not fetched yet, fetched alone
    (a few KB, as the plan fetches the image processor's settings); None where neither can be had."""
    local = Path(model["path"]) / "config.json"
    if local.is_file():
        return local
    if "hub_id" in model and (fetched := hub_files_dir(model["hub_id"], model.get("revision"), ("config.json",))):
        return fetched / "config.json"
    return None


def fetch_model(hub_id: str, revision: str | None, link: str | Path) -> Path:
    """The model `hub_id` at `revision` (its main branch where None) from the Hugging Face Hub, into
    Hugging Face's own cache (HF_HOME: shared with every other tool, downloaded once however many
    studies use it; HF_TOKEN for gated models; HF_HUB_OFFLINE=1 takes what the cache holds), and
    `link` made a symbolic link to that snapshot, the model directory the study's jobs read. Replaced
    atomically: a job never sees it half made. Checked as every model directory is."""
    from huggingface_hub import snapshot_download

    snapshot = Path(snapshot_download(hub_id, revision=revision))
    if problem := model_dir_problem(snapshot):
        raise InputError(snapshot, f"{hub_id} {problem}")
    if problem := family_problem(snapshot / "config.json"):
        raise InputError(snapshot / "config.json", problem)
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    partial = link.with_name(f".{link.name}.partial")
    partial.unlink(missing_ok=True)
    partial.symlink_to(snapshot.resolve(), target_is_directory=True)
    partial.replace(link)
    return snapshot
