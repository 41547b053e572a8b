"""The config reference, docs/reference/config.md, written from the config's schema
(vlft/config.schema.yaml): every key with its type, default and description, so that the page and
the validation cannot say different things. tests/workflow/test_docs.py checks the page is current;
`python -m vlft.config_reference > docs/reference/config.md` writes it again."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

SCHEMA = Path(__file__).with_name("config.schema.yaml")


def reference(schema: dict) -> str:
    """The page: the top-level keys, then every stage setting (the keys `defaults` and each stage take)."""
    definitions = schema.get("$defs", {})
    lines = [
        "# The config reference",
        "",
        "Every key of a study's config file, written from `vlft/config.schema.yaml`, the schema the",
        "workflow validates a config against. A key left out takes its default. `<name>` stands for a",
        "name of your own (a dataset's, an experiment's).",
        "",
        "## Top-level keys",
        "",
        *_table(_rows(schema, "", definitions, stop_at_stage_settings=True)),
        "",
        "## Stage settings",
        "",
        _one_line(definitions["stage_settings"].get("description", "")),
        "Each of these is a key of `defaults` and of each stage under `experiments.<name>.stages`.",
        "",
        *_table(_rows(definitions["stage_settings"], "", definitions, stop_at_stage_settings=False)),
    ]
    return "\n".join(lines) + "\n"


def _rows(node: dict, prefix: str, definitions: dict, stop_at_stage_settings: bool) -> list[tuple[str, ...]]:
    properties = dict(node.get("properties") or {})
    for part in node.get("allOf", []):  # a stage: the stage settings (their own table) and keys of its own
        properties |= part.get("properties") or {}
    rows = []
    for key, value in properties.items():
        path = f"{prefix}{key}"
        rows.append((path, _type(value, definitions), _default(value), _one_line(value.get("description", ""))))
        rows += _children(value, path, definitions, stop_at_stage_settings)
    return rows


def _children(value: dict, path: str, definitions: dict, stop_at_stage_settings: bool) -> list:
    """The keys under a key: its own properties, those of each named entry, and a list's items."""
    if stop_at_stage_settings and _refers_to_stage_settings(value):
        return []  # `defaults` and a stage: their keys are the stage settings' table
    rows = _rows(value, f"{path}.", definitions, stop_at_stage_settings)
    named = value.get("additionalProperties")
    if isinstance(named, dict):
        rows += _rows(named, f"{path}.<name>.", definitions, stop_at_stage_settings)
        rows += _children_of_items(named, f"{path}.<name>", definitions, stop_at_stage_settings)
    rows += _children_of_items(value, path, definitions, stop_at_stage_settings)
    return rows


def _children_of_items(value: dict, path: str, definitions: dict, stop: bool) -> list:
    items = value.get("items")
    if not isinstance(items, dict):
        return []
    return _rows(items, f"{path}[].", definitions, stop)


def _refers_to_stage_settings(node: dict) -> bool:
    """Whether a key's value is the stage settings themselves (`defaults`), not merely holds them."""
    refs = [node.get("$ref", "")] + [part.get("$ref", "") for part in node.get("allOf", [])]
    return any(ref.endswith("/stage_settings") for ref in refs)


def _type(value: dict, definitions: dict) -> str:
    if "enum" in value:
        return "one of " + ", ".join(f"`{v}`" for v in value["enum"])
    if _refers_to_stage_settings(value):
        return "object: the stage settings"
    kind = value.get("type")
    if kind is None and "$ref" in value:
        kind = definitions.get(value["$ref"].split("/")[-1], {}).get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind or "see description"


def _default(value: dict) -> str:
    if "default" not in value:
        return ""
    return f"`{json.dumps(value['default'])}`"


def _one_line(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    return ["| key | type | default | description |", "|---|---|---|---|"] + [
        f"| `{key}` | {kind} | {default} | {description} |" for key, kind, default, description in rows
    ]


if __name__ == "__main__":
    print(reference(yaml.safe_load(SCHEMA.read_text())), end="")
