"""The config file: checked against its JSON schema, and every key it leaves out taken from the
schema's documented defaults.

A user's config file is the whole config. The workflow reads the demo (config/config.yaml) only
when no --configfile is given, so nothing of the demo leaks into a user's study; and the defaults
live in one place, the schema, where each is documented beside its key.

Snakemake's own `validate` is not used: it fills a schema's defaults into every object the schema
describes, stages included, so a stage would get the built-in learning rate instead of inheriting
the one in `defaults`; and it reports an error as a dump of the schema rather than one sentence.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from vlft.errors import ConfigError

# In the package (workflow/schemas/config.schema.yaml links to it): a workflow deployed from a release
# checks its config with the vlft installed from that release, where no workflow/ is beside it.
SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


@functools.cache
def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _defaults_of(node: dict):
    """The default of a schema node: its own, or for an object, those of its properties."""
    if "default" in node:
        return copy.deepcopy(node["default"])
    return {key: _defaults_of(prop) for key, prop in node.get("properties", {}).items() if _has_default(prop)}


def _has_default(node: dict) -> bool:
    return "default" in node or any(_has_default(p) for p in node.get("properties", {}).values())


def duplicate_key(text: str) -> tuple[str, int, int] | None:
    """The first key written twice in one mapping of a YAML text, with the lines of both (YAML
    keeps the last silently: an experiment written twice, or a second `experiments:` section,
    would drop the first without a word); None where there is none."""
    nodes = [yaml.compose(text, Loader=yaml.SafeLoader)]
    while nodes:
        node = nodes.pop()
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        return key.value, seen[key.value], key.start_mark.line + 1
                    seen[key.value] = key.start_mark.line + 1
                nodes.append(value)
        elif isinstance(node, yaml.SequenceNode):
            nodes.extend(node.value)
    return None


def check_config_files(paths: list[str | Path]) -> None:
    """Each config file read as YAML with no key written twice in one mapping."""
    for path in map(Path, paths):
        if (found := duplicate_key(path.read_text())) is not None:
            key, first, again = found
            shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
            raise ConfigError(
                f"{shown}: key '{key}' is written twice in one mapping, at lines {first} and {again}; "
                "YAML would keep only the second"
            )


# What a training method's shared keys mean where a stage leaves them null (TRL's defaults for each
# trainer): resolved by the plan, and again by a job given params without them.
METHOD_DEFAULTS = {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}, "grpo": {"beta": 0.0, "loss_type": "dapo"}}


def stage_defaults() -> dict:
    """What every stage starts from before the config's `defaults` and the stage's own keys."""
    return _defaults_of(load_schema()["$defs"]["stage_settings"])


def _fill_defaults(schema: dict, value: dict) -> None:
    # Only the config's own sections: stage settings are resolved by the plan, through `defaults`.
    # A section the file leaves out is filled only where the schema gives it a default (`{}` for
    # an optional section whose keys have defaults): `demo`, which has none, stays absent.
    for key, prop in schema.get("properties", {}).items():
        if key not in value and "default" in prop:
            value[key] = copy.deepcopy(prop["default"])
        if isinstance(value.get(key), dict) and "properties" in prop:
            _fill_defaults(prop, value[key])


def _key_path(path) -> str:
    key = ""
    for part in path:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key or "the config"


@functools.cache
def _known_keys() -> tuple[str, ...]:
    keys = set()

    def walk(node):
        if isinstance(node, dict):
            keys.update(node.get("properties", {}))
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(load_schema())
    return tuple(sorted(keys))


NAME_RULE = "letters, digits, '_', '-' and '.', beginning with a letter or digit: no '.' or '..', slash or whitespace"
UNKNOWN_KEY_VALIDATORS = ("additionalProperties", "unevaluatedProperties")


def _sentence(error) -> str:
    where = _key_path(error.absolute_path)
    if error.validator in UNKNOWN_KEY_VALIDATORS:
        unknown = [name for name in re.findall(r"'([^']+)'", error.message) if name not in _known_keys()]
        if unknown:
            close = difflib.get_close_matches(unknown[0], _known_keys(), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return f"{where}: unknown key '{unknown[0]}'{hint}"
    if error.validator == "pattern" and error.schema is load_schema()["$defs"]["name"]:
        # A key of the config (an experiment, dataset or split) or a stage's `name`: either
        # becomes a folder of the results, so it must be a name and never a path.
        return f"{where}: '{error.instance}' is not a valid name ({NAME_RULE})"
    if error.validator == "required":
        missing = re.match(r"'([^']+)'", error.message).group(1)
        return f"{_key_path([*error.absolute_path, missing])}: required, but the config does not set it"
    return f"{where}: {error.message}"


def resolve_config(config: dict) -> dict:
    """The config checked against the schema, with the schema's defaults for every section it leaves
    out; raises ConfigError with one sentence naming the key."""
    errors = list(Draft202012Validator(load_schema()).iter_errors(config))
    # A stage key of the wrong type also makes its section report every key as unevaluated (the
    # failed part of the schema evaluates nothing): the key itself is the error to name.
    specific = [e for e in errors if e.validator not in UNKNOWN_KEY_VALIDATORS]
    error = best_match(specific or errors)
    if error is not None:
        raise ConfigError(_sentence(error))
    resolved = copy.deepcopy(config)
    _fill_defaults(load_schema(), resolved)
    model = resolved["model"]
    if "path" not in model and "hub_id" not in model:
        raise ConfigError("model: set path (a local model directory) or hub_id (the model's Hugging Face Hub id)")
    # A model named by its Hub id is read through a link in the working directory (vlft.model_files).
    model.setdefault("path", f"models/{model.get('hub_id')}")
    check_device(resolved["planning"].get("device"))
    return resolved


def check_device(device: str | None) -> None:
    """A `planning.device` the forecast can time jobs on (vlft.costs): measured, or scaled from a
    measured one by its published figures; a name it does not know is one sentence naming those it does."""
    from vlft.devices import known_devices

    known = known_devices()
    if device is None or device.lower() in (name.lower() for name in known):
        return

    def plain(name):  # as typed in a hurry: the letters O, I and l for digits, spaces and dashes left out
        return name.lower().translate(str.maketrans("oil", "011", " -_"))

    by_plain = {plain(name): name for name in known}
    close = difflib.get_close_matches(plain(device), list(by_plain), n=1, cutoff=0.75)
    hint = f" (did you mean '{by_plain[close[0]]}'?)" if close else ""
    raise ConfigError(f"planning.device: '{device}' is no device the forecast knows{hint}; it knows {', '.join(known)}")


def results_directory(config: dict, config_files: list) -> str:
    """Where a study's outputs land: its `results`, else results/<its config file's name> (the last
    --configfile given), or results for the demo: two studies never share one by default."""
    if config.get("results"):
        return checked_results(config["results"])
    if "demo" in config or not config_files:
        return "results"
    return f"results/{Path(config_files[-1]).name.split('.')[0]}"


def checked_results(results: str) -> str:
    """`results` where it can be a study's own directory: jobs create, replace and remove files under
    it, so never the file system's root, the home directory, or the study's directory or one above it."""
    where = Path(results).resolve()
    here = Path.cwd().resolve()
    if where == Path(where.anchor):
        why = "the file system's root"
    elif where == Path.home().resolve():
        why = "your home directory"
    elif here == where or here.is_relative_to(where):
        why = "the study's own directory" if here == where else f"a directory above the study's ({here})"
    else:
        return results
    raise ConfigError(
        f"results: '{results}' is {why}: the study's outputs need a directory of their own, which its jobs "
        "write and clean up (results/<study>, say)"
    )
