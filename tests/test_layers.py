"""Imports run downward only (docs/dev/architecture.md): each module of the
core, the kernels package and the architectures imports from the layers below
its own, or from its own package. Parsed, not imported: no MAX needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower number = lower layer. Same-package imports are always allowed.
LAYERS: dict[str, int] = {
    "attnquant.formats": 0,
    "attnquant.config": 0,
    "kernels": 1,
    "attnquant.files": 1,
    "attnquant.max_compat": 1,
    "attnquant.plan": 1,
    "attnquant.load": 2,
    "attnquant.graph": 2,
    "attnquant.tools": 3,
    "attnquant.__main__": 4,
    "models": 4,
}
ROOT_PACKAGE = "attnquant"
"""``import attnquant`` (for ``__version__`` or its path) is allowed from anywhere."""
UPWARD_EDGE = ("attnquant", "models")
"""The one documented edge upwards: ``attnquant.ARCHITECTURES``."""


def layer_of(module: str) -> str | None:
    return max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len, default=None)


def modules() -> list[tuple[str, Path]]:
    found = []
    for top in ("attnquant", "models", "kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((name, path))
    return found


def imports_of(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}
    return {m for m in found if m.split(".")[0] in ("attnquant", "models", "kernels")}


def test_every_module_has_a_layer() -> None:
    unplaced = [name for name, _ in modules() if name != ROOT_PACKAGE and layer_of(name) is None]
    assert not unplaced, f"add these to LAYERS (and docs/dev/architecture.md): {unplaced}"


@pytest.mark.parametrize(("name", "path"), modules(), ids=[name for name, _ in modules()])
def test_imports_run_downward(name: str, path: Path) -> None:
    own = layer_of(name)
    wrong = []
    for target in imports_of(name, path):
        if target == ROOT_PACKAGE or (name, target.split(".")[0]) == UPWARD_EDGE:
            continue
        theirs = layer_of(target)
        if theirs is None or own is None or theirs == own:
            continue  # a name imported from a module (counted by its module) or the same package
        if LAYERS[theirs] >= LAYERS[own]:
            wrong.append(f"{target} (layer {theirs})")
    assert not wrong, f"{name} (layer {own}) imports upwards or sideways: {wrong}"


def test_console_scripts_resolve() -> None:
    """Every ``[project.scripts]`` entry names a function that exists (a module
    move must carry its entry point along)."""
    import importlib
    import re

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    entries = re.findall(r'^\s*([\w-]+)\s*=\s*"([\w.]+):(\w+)"', section, re.M)
    assert entries, section
    for name, module, function in entries:
        assert callable(getattr(importlib.import_module(module), function, None)), f"{name} = {module}:{function}"
