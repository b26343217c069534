"""Which header names a file gives NVRTC: the scan the front door's candidates come from (its shadows module).

Every literal ``#include``, ``#include_next``, ``__has_include`` (and a macro that hands
its argument to ``__has_include``) is found with its kind, whatever the blanks; a name
made by a macro is reported, so that the record guards directories instead.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_program_cas._cuda.shadows import ANGLED, NEXT, QUOTED, Computed, directives

SPELLING = st.text(st.characters(codec="ascii", exclude_characters='<>"\n\r\0\\'), min_size=1, max_size=20).filter(
    lambda s: s.strip() == s and s != ""
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["include", "include_next", "has", "has_next"]), st.booleans(), SPELLING)),
    st.sampled_from(["", " ", "\t", "  "]),
)
def test_every_literal_include_name_is_found_with_its_kind(names: list[tuple[str, bool, str]], blank: str) -> None:
    lines = []
    want = []
    for directive, angled, name in names:
        spelled = f"<{name}>" if angled else f'"{name}"'
        if directive.startswith("include"):
            lines.append(f"{blank}#{blank}{directive}{blank}{spelled}")
        else:
            lines.append(f"#if __has_include{'_next' if directive == 'has_next' else ''}({blank}{spelled})\n#endif")
        nxt = directive.endswith("next")
        want.append((NEXT if nxt else ANGLED if angled else QUOTED, name))
    assert sorted(directives("\n".join(lines).encode())) == sorted(want)


@pytest.mark.parametrize(
    "text",
    [
        b"#include HEADER\n",
        b"#  include_next MACRO(x)\n",
        b"#if __has_include(NAME)\n#endif\n",
        b"#define W(x) __has_include(x)\n#if W(OTHER)\n#endif\n",
    ],
)
def test_a_name_made_by_a_macro_is_seen(text: bytes) -> None:
    with pytest.raises(Computed):
        directives(text, [b"W"] if b"W(" in text else [])


def test_a_wrapper_of_literal_names_gives_its_names() -> None:
    text = b'#define HAS(x) __has_include(x)\n#if HAS(<a/b.h>) || HAS("c.h")\n#endif\n#ifdef __has_include\n#endif\n'
    assert sorted(directives(text, [b"HAS"])) == [(ANGLED, "a/b.h"), (QUOTED, "c.h")]
