"""What the docs hold against what the code is: the index names every page once, the variable
table names exactly the registry, the code map is the tree, and the README's switch comment
says what each value means."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

from cuda_program_cas._base.config import VARIABLES

DOCS = REPO / "docs"


def test_the_index_names_every_page_once_with_what_it_answers() -> None:
    index = (DOCS / "index.md").read_text()
    listed = re.findall(r"^- \[[^\]]+\]\(([^)]+)\): \S", index, re.MULTILINE)
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert sorted(name for name in listed if not name.startswith("../")) == pages
    assert len(listed) == len(set(listed))
    assert "../CHANGELOG.md" in listed


def test_the_variable_table_names_exactly_the_variables_the_package_reads() -> None:
    text = (DOCS / "variables.md").read_text()
    rows = re.findall(r"^\| `(CUDA_PROGRAM_CAS\w*)` \|", text, re.MULTILINE)
    assert rows == [v.name for v in VARIABLES]  # each once, in the order config lists them


def test_the_code_map_is_the_tree() -> None:
    text = (DOCS / "design.md").read_text()
    block = text.split("\n## The code map\n", 1)[1]
    listing = re.search(r"\$ ls ([^\n]+)\n(.*?)\n```", block, re.DOTALL)
    assert listing is not None
    folders = listing.group(1).split()
    lines = dict(line.split(":", 1) for line in listing.group(2).splitlines())
    assert list(lines) == folders
    for folder in folders:
        files = sorted(
            p.name
            for p in (REPO / folder).iterdir()
            if p.name not in ("__init__.py", "__pycache__", "py.typed") and (p.suffix in (".py", ".pth"))
        )
        assert lines[folder].split() == files, folder


def test_the_switch_s_values_are_said_as_they_are() -> None:
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.strip().startswith("export CUDA_PROGRAM_CAS=1"))
    assert "1: on" in line and "read-only:" in line and "0:" in line
    assert not re.search(r"=1\s+#\s*read-only", line)  # 1 is not read-only


def test_cache_store_s_public_names_are_exactly_the_documented_ones(tmp_path: Path) -> None:
    # The table of python-api.md is CacheStore's whole public API: a name the class grows, or one it
    # loses, fails here until the page says so (what the CUDA layer needs goes through store.inner).
    from cuda_program_cas import CacheStore

    text = (DOCS / "python-api.md").read_text()
    table = text.split("Its public names,\nall of them", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([^`]+)` \|", table, re.MULTILINE)
    documented = {row.split("(")[0] for row in rows}
    store = CacheStore(tmp_path / "c")
    public = {n for n in dir(store) if not n.startswith("_")} | {"len"}
    assert len(rows) == len(documented)
    assert documented == public
    assert len(store) == 0  # the one dunder the table lists
