"""The import contract: ray_velo's packages are layers, each importing only layers below it, as
its ``__init__`` docstring says ("May import: ..."), so a newcomer reads the house from the door
and a change that makes a lower layer reach up, or two packages import each other, fails here
(docs/architecture.md §1). Every import counts: at module level, inside a function, and under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import ray_velo

ROOT = pathlib.Path(ray_velo.__file__).parent

#: The layers, lowest first: a unit (a package, or a module at the top of ray_velo/) may import
#: only the units before it. ``ray_velo`` is the public facade (its ``__init__``), which the
#: tools above it use as any user would.
LAYERS = (
    "errors", "config", "_ray", "protocol", "metrics", "memory", "ucx", "wire", "state",
    "agent", "local", "owner", "consumer", "actors", "client", "rdt", "api", "staging",
    "ray_velo", "ops", "testing", "testbed", "bench", "cli",
)  # fmt: skip
#: Modules at the top of ray_velo/ besides ``__init__`` (issue 39: at most eight).
TOP_MODULES_MAX = 8


def unit_files() -> dict[str, list[pathlib.Path]]:
    """Each unit's source files (``actors`` through its symlink)."""
    units: dict[str, list[pathlib.Path]] = {"ray_velo": [ROOT / "__init__.py"]}
    for path in sorted(ROOT.iterdir()):
        if path.suffix == ".py" and path.name != "__init__.py":
            units[path.stem] = [path]
        elif path.is_dir() and (path / "__init__.py").exists():
            units[path.name] = sorted(path.resolve().rglob("*.py"))
    return units


def imported_units(path: pathlib.Path) -> dict[str, int]:
    """The units a file imports, each with the line of its first import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "ray_velo":
                continue
            # `from ray_velo import api` imports the api unit; `import ray_velo` the facade
            unit = parts[1] if len(parts) > 1 and parts[1] in LAYERS else "ray_velo"
            found.setdefault(unit, node.lineno)
    return found


def declared(unit: str, files: list[pathlib.Path]) -> set[str] | None:
    """The units a package's docstring says it may import (None for a top-level module)."""
    init = [p for p in files if p.name == "__init__.py" and p.parent.name == unit]
    if not init:
        return None
    doc = ast.get_docstring(ast.parse(init[0].read_text())) or ""
    match = re.search(r"May import: ([\w, \n]*)\.", doc)
    assert match, f"ray_velo/{unit}/__init__.py's docstring does not say what it may import"
    return {name.strip() for name in match.group(1).replace("\n", " ").split(",") if name.strip()}


def test_every_unit_has_a_place_in_the_layers() -> None:
    assert set(unit_files()) == set(LAYERS)


def test_at_most_eight_modules_at_the_top() -> None:
    top = [p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= TOP_MODULES_MAX, f"{len(top)} modules at the top of ray_velo/: {top}"


@pytest.mark.parametrize("unit", [u for u in LAYERS if u != "ray_velo"])
def test_a_layer_imports_only_layers_below_it(unit: str) -> None:
    files = unit_files()[unit]
    below = set(LAYERS[: LAYERS.index(unit)])
    allowed = declared(unit, files)
    if allowed is not None:
        assert allowed <= below, f"{unit}'s docstring allows layers above it: {allowed - below}"
    else:
        allowed = below
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {other}"
        for path in files
        for other, line in imported_units(path).items()
        if other != unit and other not in allowed
    ]
    assert not offenders, offenders


def test_the_contract_catches_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The check is not vacuous: a lower layer reaching up, even lazily or for types only, is
    seen."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ray_velo.agent.core import AgentCore\n"
        "def f():\n    import ray_velo.client.session\n"
        "from ray_velo import api\n"
    )
    assert imported_units(source) == {"agent": 3, "client": 5, "api": 6}


def facade_slips(source: str) -> list[str]:
    """Each ``rv.X`` in ``source`` (``rv`` an alias of ``import ray_velo``) where X is no public
    name of the facade, no dunder, and no module the source imports by its full name."""
    tree = ast.parse(source)
    aliases, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ray_velo":
                    aliases.add(alias.asname or "ray_velo")
                elif alias.name.startswith("ray_velo.") and alias.asname is None:
                    modules.add(alias.name.split(".")[1])
    return [
        f"{node.lineno}: {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr not in ray_velo.__all__
        and not node.attr.startswith("__")
        and node.attr not in modules
    ]


def test_the_facade_is_reached_only_for_its_public_names() -> None:
    """``rv.X`` names a public name of ``ray_velo`` (its ``__all__``), a dunder, or a module
    the file imports by its full name: the facade's lazy ``__getattr__`` returns ``Any`` to
    mypy, so ``rv.session`` (a module that moved) type-checked and failed only at run time."""
    repo = ROOT.parent
    files = [*ROOT.rglob("*.py"), *(ROOT / "actors").resolve().rglob("*.py")]
    files += [*(repo / "tests").rglob("*.py"), *(repo / "examples").rglob("*.py")]
    offenders = {str(p): found for p in files if (found := facade_slips(p.read_text()))}
    assert not offenders, offenders
    probe = "import ray_velo as rv\nimport ray_velo.cli\nrv.session.current(); rv.put(1); ray_velo.cli\n"
    assert facade_slips(probe) == ["3: rv.session"]
