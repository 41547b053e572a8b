"""ARCHITECTURE.md's table of layers is true to the code: every module of vlft/ is in one layer, and
each imports only from its own layer and those below it (imports inside functions included)."""

from __future__ import annotations

import ast
import re

from conftest import REPO

VLFT = REPO / "vlft"


def layers() -> dict[str, int]:
    """Each path the table names (a module, or a package with a trailing slash) -> its layer."""
    table = (REPO / "ARCHITECTURE.md").read_text().split("## The library, by layer")[1].split("\n## ")[0]
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
    assert not unplaced, f"modules ARCHITECTURE.md's table of layers does not name: {unplaced}"
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
