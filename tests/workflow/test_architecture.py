"""docs/design.md's table of layers is true to the code: every module of vlft/ is in one layer, and
each imports only from its own layer and those below it (imports inside functions included)."""

from __future__ import annotations

import ast
import re

from tests.helpers import REPO

VLFT = REPO / "vlft"


def layers() -> dict[str, int]:
    """Each path the table names (a module, or a package with a trailing slash) -> its layer."""
    table = (REPO / "docs" / "design.md").read_text().split("## The library, by layer")[1].split("\n## ")[0]
    named = {}
    for number, modules in re.findall(r"^\| (\d+) \| ([^|]+) \|", table, re.M):
        for path in re.findall(r"`vlft/([^`]+)`", modules):
            named[path] = int(number)
    return named


def layer_of(path: str, named: dict[str, int]) -> int | None:
    """The layer of a module's path under vlft/ (its package's, where the table names the package)."""
    if path in named:
        return named[path]
    package = path.split("/")[0] + "/"
    return named.get(package)


def imports_of(file) -> set[str]:
    """The vlft modules a file imports, as paths under vlft/ (a name imported from a package counts
    as its module where it is one)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vlft":
            base = node.module.split(".")[1:]
            for alias in node.names:
                found.add(
                    "/".join(base + [alias.name])
                    if (VLFT.joinpath(*base, alias.name + ".py")).exists()
                    else "/".join(base)
                )
        elif isinstance(node, ast.Import):
            found |= {"/".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "vlft"}
    return {name for name in found if name}


def module_path(name: str) -> str:
    """`forward/packing` -> `forward/packing.py`; a package -> its directory with a slash."""
    return f"{name}/" if (VLFT / name).is_dir() else f"{name}.py"


def test_every_module_is_in_a_layer_and_imports_nothing_above_it():
    named = layers()
    files = [f for f in VLFT.rglob("*.py") if f != VLFT / "__init__.py"]
    unplaced = [str(f.relative_to(VLFT)) for f in files if layer_of(str(f.relative_to(VLFT)), named) is None]
    assert not unplaced, f"modules docs/design.md's table of layers does not name: {unplaced}"
    upward = []
    for file in files:
        own = layer_of(str(file.relative_to(VLFT)), named)
        for name in imports_of(file):
            target = layer_of(module_path(name), named)
            if target is not None and target > own:
                upward.append(
                    f"{file.relative_to(VLFT)} (layer {own}) imports vlft/{module_path(name)} (layer {target})"
                )
    assert not upward, "\n".join(upward)


def test_the_check_finds_an_import_that_runs_back_up(tmp_path):
    """The check itself: a layer-1 module that imported training would be named."""
    named = layers()
    assert layer_of("files.py", named) == 1 and layer_of("training/grpo.py", named) == 9
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from vlft.training.grpo import answer_id\n")
    assert imports_of(probe) == {"training/grpo"} and layer_of(module_path("training/grpo"), named) == 9


def test_no_module_imports_itself_through_others():
    """No import circle between modules (a name a package's __init__ holds counts as the package)."""
    graph = {}
    for file in VLFT.rglob("*.py"):
        if file == VLFT / "__init__.py":
            continue
        own = str(file.relative_to(VLFT).with_suffix(""))
        own = own.removesuffix("/__init__")
        graph[own] = {name for name in imports_of(file) if name != own}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError(" -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        path.append(module)
        for target in graph.get(module, ()):
            visit(target)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def rule_table() -> list[tuple[str, str, list[str]]]:
    """docs/design.md's rule -> script -> library function table: (rule or command, script, functions)."""
    rows = re.findall(
        r"^\| `([^`]+)`[^|]*\| `(scripts/[^`]+)` \| (.+) \|$", (REPO / "docs" / "design.md").read_text(), re.M
    )
    return [(rule, script, re.findall(r"`(vlft\.[\w.]+)`", functions)) for rule, script, functions in rows]


def workflow_rules() -> dict[str, str]:
    """Each rule of the workflow -> the script its shell command runs ('' for a rule of no script)."""
    rules = {}
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        text = smk.read_text()
        # A rule's body runs to the next rule; a rule named in a loop (`name: f"make_demo_{...}"`) by its name's pattern.
        for block in re.split(r"^\s*(?=rule\b|checkpoint\b)", text, flags=re.M):
            if not re.match(r"rule\b|checkpoint\b", block):
                continue
            named = re.match(r"(?:rule|checkpoint) (\w+):", block) or re.search(r'name:\s*f"(\w+)\{\w+\}"', block)
            name = named.group(1) + ("<dataset>" if named.group(0).startswith("name") else "")
            script = re.search(r"(scripts/\w+\.py)", block)
            rules[name] = script.group(1) if script else ""
    return rules


def test_the_rule_script_function_table_is_true_to_the_workflow_and_the_scripts():
    """Every rule that runs a script is in the table with that script; each script there imports each
    library function the table names, and that module defines it."""
    table = rule_table()
    rules = workflow_rules()
    assert {rule for rule, script in rules.items() if script} == {r for r, _, _ in table if not r.startswith("vlft ")}
    for rule, script, functions in table:
        if not rule.startswith("vlft "):
            assert rules[rule] == script, f"the table says {rule} runs {script}; its command runs {rules[rule]}"
        imported = imports_of(REPO / script) | {
            "/".join(n.module.split(".")[1:] + [a.name])
            for n in ast.walk(ast.parse((REPO / script).read_text()))
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("vlft")
            for a in n.names
        }
        for function in functions:
            whole = function.removeprefix("vlft.").replace(".", "/")
            if (VLFT / whole).is_dir():  # a package of functions (the importers)
                assert whole in imported, f"{script} does not import {function}"
                continue
            module, _, name = function.removeprefix("vlft.").rpartition(".")
            path = module.replace(".", "/")
            defines = VLFT / f"{path}.py" if (VLFT / f"{path}.py").exists() else VLFT / path / "__init__.py"
            assert re.search(rf"^(def|class) {name}\b", defines.read_text(), re.M), f"{function} is not defined"
            uses = f"{path}/{name}" in imported or (path in imported and f".{name}(" in (REPO / script).read_text())
            assert uses, f"{script} does not call {function}"


def test_the_table_check_sees_a_rule_the_table_does_not_name(tmp_path):
    """The check itself: the workflow's rules as it reads them include every rule that runs a script."""
    rules = workflow_rules()
    assert rules["train"] == "scripts/train.py" and rules["make_demo_<dataset>"] == "scripts/make_demo_dataset.py"
    assert rules["report_inputs"] == "" and rules["keep_best_arms"] == "scripts/keep_best_arms.py"
    assert len(rule_table()) == 14
