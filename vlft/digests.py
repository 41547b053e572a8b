"""What a rerun compares, beside a job's settings: the content of the model's files and of a
dataset's raw files, never where they lie or when they were touched.

Snakemake sees an input's path and time stamp. A checkpoint replaced in place keeps both; a dataset
moved elsewhere changes the path and nothing else. So each job that reads the model or a raw split
takes a digest of that content as a param (Snakemake's params trigger reruns it when the digest
changes), and the paths it reads travel as params derived from its input, which Snakemake leaves
out of that comparison.

Cheaply: a file is hashed (sha256) once, and again only when its path, size, inode or time stamps
changed (its change time too, which no tool sets back: bytes written in place with the old
modification time restored are still seen). The digests are kept in `.snakemake/vlft/`, beside
Snakemake's records of the jobs. A dry run of a study on a 16 GB checkpoint stats its files; the
first one, or the first after a file changed, reads them (about 10 s for 16 GB). A raw split's
image list is read once per content of its records file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path

from vlft.data.records import outside_root
from vlft.files import atomic_path, text_lines

# The files of a checkpoint directory that transformers, tokenizers and peft read: weights and their
# index, configs, tokenizers' files (BPE's vocabulary and merges, WordPiece's vocabulary, SentencePiece
# and tiktoken models), the chat template, remote code. Nothing else counts (a model card, a licence,
# pictures, a note of the user's, an empty file), nor hidden files (a download tool's .cache/,
# .gitattributes): adding or editing them reruns nothing.
READ = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.json",
    "*.jinja",
    "*.py",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
)
# The files the image processor is built from: all a pixel cache depends on.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def combined(named_digests) -> str:
    """One digest of (name, digest) pairs, in the order given."""
    whole = hashlib.sha256()
    for name, digest in named_digests:
        whole.update(f"{name}\t{digest}\n".encode())
    return whole.hexdigest()


class DigestMemo:
    """sha256 of files, each computed again only when the file's path, size, inode, modification or
    change time changed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or damaged: hash again
            self.known = {}
        self.changed = False
        self.other_content: list[str] = []  # files whose content differs from what the last plan hashed
        self.model_files: dict | None = None  # the model's files as the last plan and this one count them

    def digest(self, path: str | Path) -> str:
        stat = os.stat(path)
        key = os.path.abspath(path)
        seen = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        entry = self.known.get(key)
        if entry is None or entry[:-1] != seen:
            with open(path, "rb") as handle:
                fresh = seen + [hashlib.file_digest(handle, "sha256").hexdigest()]
            if entry is not None and entry[-1] != fresh[-1]:
                self.other_content.append(str(path))
            entry, self.known[key], self.changed = fresh, fresh, True
        return entry[-1]

    def save(self) -> None:
        """Keep what was hashed for the next plan; where the results cannot be written, the next
        plan hashes again (and the job that writes there says why)."""
        if not self.changed:
            return
        try:
            with atomic_path(self.path) as tmp:
                tmp.write_text(json.dumps(self.known))
        except OSError:
            return
        self.changed = False


def model_files(model_dir: Path) -> list[Path]:
    """The files of a checkpoint a loader may read, sorted."""
    found = []
    for path in sorted(model_dir.rglob("*")):
        relative = path.relative_to(model_dir)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in READ):
            found.append(path)
    return found


def model_digests(model_dir: str | Path, memo: DigestMemo) -> dict[str, str]:
    """{"whole": the checkpoint's weights, tokenizer, template, configs and code; "processor": its
    image processor's settings alone}, as digests of content. The files it counts are kept in the
    memo, so that what changed since the last plan can be named (`model_changes`)."""
    model_dir = Path(model_dir)
    files = model_files(model_dir)
    named = [(str(p.relative_to(model_dir)), memo.digest(p)) for p in files]
    listed = memo.known.get(f"files:{model_dir.resolve()}")
    memo.model_files = {"before": listed, "now": [name for name, _ in named], "dir": model_dir}
    if listed != memo.model_files["now"]:
        memo.known[f"files:{model_dir.resolve()}"], memo.changed = memo.model_files["now"], True
    memo.save()
    return {
        "whole": combined(named),
        "processor": combined((name, digest) for name, digest in named if name in PROCESSOR_FILES),
    }


def model_changes(memo: DigestMemo) -> str | None:
    """What changed in the model's files since the last plan that counted them (added, removed, other
    content), in one line, or None: a rerun's reason is a digest, which names no file."""
    files = getattr(memo, "model_files", None)
    if not files or files["before"] is None:
        return None
    before, now = set(files["before"]), set(files["now"])
    changed = [
        str(Path(p).relative_to(files["dir"])) for p in memo.other_content if Path(p).is_relative_to(files["dir"])
    ]
    parts = [
        f"{what}: {', '.join(sorted(names))}"
        for what, names in (("added", now - before), ("removed", before - now), ("other content", changed))
        if names
    ]
    return (
        f"the model's files changed since the last plan ({'; '.join(parts)}): what read the model runs again"
        if parts
        else None
    )


def split_digest(records: str | Path, image_root: str | Path, memo: DigestMemo) -> str:
    """The content of a raw split: its records file and every distinct image it names (those that
    exist: prepare_split names the missing ones, with their lines). The image list is read once per
    content of the records file and kept beside the digests."""
    records_digest = memo.digest(records)
    listed = memo.path.parent / f"images-of-{records_digest[:32]}.json"
    try:
        images = json.loads(listed.read_text())
    except (OSError, ValueError):
        images = images_named(records)
        try:
            with atomic_path(listed) as tmp:
                tmp.write_text(json.dumps(images))
        except OSError:
            pass
    named = [("records", records_digest)]
    for image in images:
        path = Path(image_root) / image
        if outside_root(path, image_root) is None and path.is_file():  # else prepare_split refuses it
            named.append((image, memo.digest(path)))
    memo.save()
    return combined(named)


def images_named(records: str | Path) -> list[str]:
    """The distinct images a raw split names, in order, read leniently: a line that does not parse
    is prepare_split's to report, with its number."""
    images = {}
    for _, line in text_lines(records, errors="replace"):
        try:
            image = json.loads(line).get("image")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(image, str) and image:
            images[image] = None
    return list(images)
