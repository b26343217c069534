"""The tree keeps its promises: packages that depend strictly downward, no circle, true
``__all__`` lists, the index used only through its public interface, maintenance verbs
that do not import each other, every verb a library function of the package with a
report of one shape, and a console script that only parses and prints.

These read the source (``ast``); nothing is imported but the modules themselves.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest
from conftest import REPO

#: The import name, and the folder each of its packages lives in.
NAME = "cuda_program_cas"
INDEX = f"{NAME}.index"
#: The floors, lowest first. A module may import from its own package and from packages on
#: lower floors only; the two packages of one floor never import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("index",),  # the index's format: keys, key ids, manifests (no I/O)
    ("_base",),  # exceptions, the fork registry, environment knobs, the logger
    ("_disk",),  # the cache's files (atomic write, layout, blobs, writer, pack format)
    ("_remote",),  # stores over the network (HTTP, Redis): an HTTP store's packs are _disk's pack format
    ("_local",),  # the local cache at run time: reader, cap, counters, ledgers, journal
    ("_shared",),  # the cluster layer: shared stores (tiers), write-back, leases, warm sets, key lists
    ("_store",),  # CacheStore, which composes the local cache and the cluster layer
    ("_cuda", "_verbs"),  # cuda.core's side; the maintenance verbs
    ("_cli",),  # the console script: parse and print
    ("",),  # the package's own __init__ and __main__
)
#: Modules of _verbs that the verbs share; every other module there is a verb.
VERB_SHARED = ("bucket", "common", "packs", "pubreport", "pubsets", "pubtarget")
#: Each verb module, and the library function it is (exported by the package, returning a report).
VERB_FUNCTIONS = {
    "clear": "clear",
    "config": "config",
    "explain": "explain",
    "gc": "collect",
    "import_filestream": "import_filestream",
    "publish": "publish",
    "repack": "repack",
    "stats": "stats",
    "verify": "verify",
}
#: Console commands that are not maintenance verbs, and the library call each fronts (none: every
#: command is a verb, so the console script needs nothing below _verbs).
NOT_VERBS: dict[str, str] = {}
#: What a console command may import from: the verbs, the base, the script itself and the index.
CLI_MAY_IMPORT = ("_verbs", "_base", "_cli", "index")


def folder_of(package: str) -> Path:
    if package == "index":
        return REPO / "index"
    return REPO / "cas" / package if package else REPO / "cas"


def modules() -> list[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of the package, the index included."""
    found = []
    for floor in FLOORS:
        for package in floor:
            dotted = f"{NAME}.{package}" if package else NAME
            for path in sorted(folder_of(package).glob("*.py")):
                found.append((dotted if path.stem == "__init__" else f"{dotted}.{path.stem}", path))
    return found


def package_of(module: str) -> str:
    """The floor package a module belongs to (``""`` for the top-level ``__init__``/``__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in _PACKAGES) else ""


_PACKAGES = {p for floor in FLOORS for p in floor if p}


def floor_of(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def test_every_folder_of_cas_is_a_package_on_a_floor() -> None:
    folders = {p.name for p in (REPO / "cas").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == _PACKAGES - {"index"}
    assert all((folder_of(p) / "__init__.py").is_file() for p in _PACKAGES)


def test_the_type_checkers_tree_links_every_entry() -> None:
    # mypy reads the package through .ci/mypy/cuda_program_cas (it cannot see setuptools' mapping).
    tree = REPO / ".ci" / "mypy" / NAME
    wanted = {p.name for p in (REPO / "cas").iterdir() if p.name != "__pycache__"} | {"index"}
    assert {p.name for p in tree.iterdir()} == wanted
    assert all(os.path.realpath(tree / n) == os.path.realpath(REPO / "cas" / n) for n in wanted - {"index"})
    assert os.path.realpath(tree / "index") == os.path.realpath(REPO / "index")


def test_packages_depend_strictly_downward() -> None:
    bad = []
    for name, path in modules():
        mine = package_of(name)
        for source, _ in imports_of(name, path):
            theirs = package_of(source)
            if theirs == mine:
                continue
            if floor_of(theirs) >= floor_of(mine):
                bad.append(f"{name} imports {source}: {theirs or NAME} is not below {mine or NAME}")
    assert bad == []


def test_the_local_cache_knows_nothing_of_shared_stores() -> None:
    # The local store is whole without the cluster layer: not even a deferred import reaches it.
    crossed = [
        f"{name} imports {source}"
        for name, path in modules()
        if package_of(name) == "_local"
        for source, _ in imports_of(name, path)
        if package_of(source) in ("_shared", "_store")
    ]
    assert crossed == []


#: The most methods ``CacheStore`` may have: it composes the local cache and the cluster layer, it is no hub.
MOST_STORE_METHODS = 25
#: The most lines a module of the library may have: split by responsibility before it grows past it.
MOST_LINES = 600


def test_the_cache_store_composes_in_few_methods() -> None:
    tree = ast.parse((folder_of("_store") / "store.py").read_text())
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheStore")
    defs = [n.name for n in ast.walk(store) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(defs) <= MOST_STORE_METHODS, defs


def test_no_module_of_the_library_is_too_long() -> None:
    long = {name: n for name, path in modules() if (n := len(path.read_text().splitlines())) > MOST_LINES}
    assert long == {}


def test_no_circle_between_modules() -> None:
    graph: dict[str, set[str]] = {name: set() for name, _ in modules()}
    for name, path in modules():
        for source, symbol in imports_of(name, path):
            target = f"{source}.{symbol}" if f"{source}.{symbol}" in graph else source
            if target in graph and target != name:
                graph[name].add(target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("circle: " + " -> ".join([*stack[stack.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def imports_of(name: str, path: Path) -> list[tuple[str, str]]:
    """``(module, imported name)`` for every ``from X import y`` of a project module in ``path``."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = (package + ("." + node.module if node.module else "")) if node.level else (node.module or "")
        if source.split(".")[0] == NAME:
            out.extend((source, alias.name) for alias in node.names)
    return out


@pytest.mark.parametrize(("name", "path"), modules(), ids=[n for n, _ in modules()])
def test_all_is_true(name: str, path: Path) -> None:
    module = importlib.import_module(name) if name != f"{NAME}._cuda.cache" else pytest.importorskip(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    for symbol in exported:
        assert hasattr(module, symbol), f"{name}.__all__ names {symbol!r}, which it does not define"


def test_every_import_between_modules_is_of_an_exported_name() -> None:
    bad = []
    for name, path in modules():
        for source, symbol in imports_of(name, path):
            module = importlib.import_module(source) if source != f"{NAME}._cuda.cache" else None
            if module is None:
                continue
            if symbol not in getattr(module, "__all__", ()):
                bad.append(f"{name} imports {symbol} from {source}, which does not export it")
    assert bad == []


def test_the_package_uses_only_the_public_interface_of_the_index() -> None:
    private = [
        f"{name}: from {source} import {symbol}"
        for name, path in modules()
        if not name.startswith(INDEX)
        for source, symbol in imports_of(name, path)
        if source.startswith(INDEX + ".")
    ]
    assert private == []


def verbs() -> list[str]:
    """The verb modules: every module of ``_verbs`` but the ones the verbs share."""
    folder = folder_of("_verbs")
    return [f"{NAME}._verbs.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem not in ("__init__", *VERB_SHARED)]


VERBS = verbs()


def test_maintenance_verbs_do_not_import_each_other() -> None:
    paths = dict(modules())
    crossed = [
        f"{verb} imports {source}"
        for verb in VERBS
        for source, _ in imports_of(verb, paths[verb])
        if source in VERBS and source != verb
    ]
    assert crossed == []


def test_every_verb_is_a_library_function_of_the_package_with_a_report() -> None:
    import typing

    package = importlib.import_module(NAME)
    report_base = importlib.import_module(f"{NAME}._verbs.common").Report
    assert {v.rsplit(".", 1)[1] for v in VERBS} == set(VERB_FUNCTIONS), "a verb module without its function here"
    for verb in VERBS:
        module = importlib.import_module(verb)
        name = VERB_FUNCTIONS[verb.rsplit(".", 1)[1]]
        function = getattr(module, name)
        assert name in module.__all__ and name in package.__all__, f"{verb}.{name} is not exported"
        assert getattr(package, name) is function
        report = typing.get_type_hints(function)["return"]
        assert isinstance(report, type) and issubclass(report, report_base), f"{verb}.{name} returns {report}"
        assert report.__name__ in package.__all__ and getattr(package, report.__name__) is report


def test_every_command_is_a_verb() -> None:
    commands = importlib.import_module(f"{NAME}._cli.main")._COMMAND_MODULES
    verbs = {v.rsplit(".", 1)[1] for v in VERBS}
    assert [c for c in commands if c not in verbs and c not in NOT_VERBS] == []
    assert set(NOT_VERBS) <= set(commands)


def test_the_console_script_only_parses_and_prints() -> None:
    # Its commands call verbs: nothing of the cache's files (_disk) or its run time (_store) directly.
    allowed = {f"{NAME}.{p}" for p in CLI_MAY_IMPORT}
    bad = []
    for name, path in modules():
        if package_of(name) != "_cli":
            continue
        sources = [source for source, _ in imports_of(name, path)]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                sources += [a.name for a in node.names if a.name.split(".")[0] == NAME]
        bad += [f"{name} imports {s}" for s in sources if ".".join(s.split(".")[:2]) not in allowed]
    assert bad == []


def test_only_the_cuda_package_imports_cuda() -> None:
    # The storage, the verbs and the console script run on a machine without CUDA.
    found = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "cuda" or n.startswith("cuda.") for n in names):
                found.append(name)
    assert found and all(name.startswith(f"{NAME}._cuda.") for name in found), found
