"""The module map keeps its promises: true ``__all__`` lists, the index used only through its
public interface, maintenance verbs that do not import each other.

These read the source (``ast``); nothing is imported but the modules themselves.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from conftest import REPO

PACKAGES = {"cas": REPO / "cas", "cuda_program_cas_index": REPO / "index"}
#: The maintenance verbs: each a caller of the engine, none of another verb.
VERBS = ("cas._gc", "cas._verify", "cas._publish", "cas._import_fs", "cas._cmd_stats")


def modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found.append((name, path))
    return found


def imports_of(name: str, path: Path) -> list[tuple[str, str]]:
    """``(module, imported name)`` for every ``from X import y`` of a project module in ``path``."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = (package + ("." + node.module if node.module else "")) if node.level else (node.module or "")
        if source.split(".")[0] in PACKAGES:
            out.extend((source, alias.name) for alias in node.names)
    return out


@pytest.mark.parametrize(("name", "path"), modules(), ids=[n for n, _ in modules()])
def test_all_is_true(name: str, path: Path) -> None:
    module = importlib.import_module(name) if name != "cas._cache" else pytest.importorskip(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    for symbol in exported:
        assert hasattr(module, symbol), f"{name}.__all__ names {symbol!r}, which it does not define"


def test_every_import_between_modules_is_of_an_exported_name() -> None:
    bad = []
    for name, path in modules():
        for source, symbol in imports_of(name, path):
            module = importlib.import_module(source) if source != "cas._cache" else None
            if module is None:
                continue
            if symbol not in getattr(module, "__all__", ()):
                bad.append(f"{name} imports {symbol} from {source}, which does not export it")
    assert bad == []


def test_cas_uses_only_the_public_interface_of_the_index() -> None:
    private = [
        f"{name}: from {source} import {symbol}"
        for name, path in modules()
        if name.startswith("cas")
        for source, symbol in imports_of(name, path)
        if source.startswith("cuda_program_cas_index.")
    ]
    assert private == []


def test_maintenance_verbs_do_not_import_each_other() -> None:
    paths = dict(modules())
    crossed = [
        f"{verb} imports {source}"
        for verb in VERBS
        for source, _ in imports_of(verb, paths[verb])
        if source in VERBS and source != verb
    ]
    assert crossed == []
