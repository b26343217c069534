"""The canonical encoding of cuda.compute ops and arguments (cas/_cuda/opkey.py): every change is another key.

No cuda.compute here: the encoder needs none. Ops are made from source by
``exec`` (as a user's module defines them), so every part a build depends on
can be varied: the body's operator and constants, a closure value, a global
value, a called helper and its body, the argument dtypes.
"""

from __future__ import annotations

import enum
import json
import types

import numpy as np
import pytest
from conftest import REPO, run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_program_cas._cuda.opkey import Uncacheable, arg_part, encode_op, encode_value

_numbers = st.one_of(st.integers(-3, 3), st.floats(-2, 2, allow_nan=False, width=32))
SPECS = st.fixed_dictionaries(
    {
        "op": st.sampled_from(["+", "-", "*"]),
        "const": _numbers,
        "closure": _numbers,
        "glob": _numbers,
        "helper": st.one_of(st.none(), _numbers),  # None: the op calls no helper
        "dtype": st.sampled_from(["int32", "int64", "float32", "float64"]),
        "name": st.sampled_from(["op", "combine"]),
    }
)

_MAKE = '''
def make_op(spec):
    """The op ``spec`` describes, defined as a module would define it; and its argument's key."""
    import numpy as np
    from cuda_program_cas._cuda.opkey import arg_part, encode_op
    ns = {"__name__": "userops", "G": spec["glob"], "np": np}
    call = " + helper(a)" if spec["helper"] is not None else ""
    src = (
        "def helper(x):\\n"
        f"    return x * {spec['helper']!r}\\n"
        "def outer(c):\\n"
        f"    def {spec['name']}(a, b):\\n"
        f"        return (a {spec['op']} b) + {spec['const']!r} + c + G{call}\\n"
        f"    return {spec['name']}\\n"
    )
    exec(compile(src, "userops.py", "exec", dont_inherit=True), ns)  # not this file's __future__ flags
    op = ns["outer"](spec["closure"])
    return encode_op(op) + arg_part("d_in", np.zeros(1, dtype=spec["dtype"]))
'''
_ns: dict[str, object] = {}
exec(_MAKE, _ns)
make_key = _ns["make_op"]


def _same_inputs(a: dict, b: dict) -> bool:
    # Equal as values and as types (1 and 1.0 are other constants to the compiled code).
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and all(type(a[k]) is type(b[k]) for k in a)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SPECS, SPECS)
def test_every_change_of_an_ops_inputs_is_another_key(a: dict, b: dict) -> None:
    assert (make_key(a) == make_key(b)) == _same_inputs(a, b)


@settings(max_examples=4, deadline=None)
@given(st.lists(SPECS, min_size=5, max_size=25))
def test_the_same_inputs_give_the_same_key_in_a_fresh_process(specs: list[dict]) -> None:
    here = [make_key(s).hex() for s in specs]
    code = _MAKE + "import json, sys\nprint(json.dumps([make_op(s).hex() for s in json.loads(sys.argv[1])]))\n"
    for seed in ("0", "4242"):  # another hash seed: no set or dict order leaks into a key
        proc = run_python(code, json.dumps(specs), env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == here


def test_a_changed_helper_body_or_called_function_is_another_key() -> None:
    def build(body: str) -> bytes:
        ns: dict[str, object] = {"__name__": "m"}
        exec(f"def helper(x):\n    {body}\ndef op(a, b):\n    return helper(a) + b\n", ns)
        return encode_op(ns["op"])  # type: ignore[arg-type]

    assert build("return x * 2") != build("return x * 3")
    assert build("return x * 2") == build("return x * 2")
    # Recursion (a helper calling itself) is encoded by a back reference, not followed forever.
    assert build("return helper(x - 1) if x else 0") != build("return helper(x - 2) if x else 0")


def test_line_numbers_and_docstring_free_moves_do_not_change_the_key() -> None:
    a: dict[str, object] = {"__name__": "m"}
    b: dict[str, object] = {"__name__": "m"}
    exec("def op(a, b):\n    return a + b\n", a)
    exec("\n\n\n# moved down\ndef op(a, b):\n    return a + b\n", b)
    assert encode_op(a["op"]) == encode_op(b["op"])  # type: ignore[arg-type]


class _Kind(enum.Enum):
    PLUS = 1
    MAX = 2


def test_enums_by_type_and_value_and_numpy_values_by_bits() -> None:
    assert encode_value(_Kind.PLUS) != encode_value(_Kind.MAX)
    assert encode_value(_Kind.PLUS) != encode_value(1)
    assert encode_value(0.0) != encode_value(-0.0)
    assert encode_value(np.int32(1)) != encode_value(np.int64(1))
    assert encode_value(np.arange(3)) != encode_value(np.arange(3)[::-1].copy())
    assert encode_value({"b": 1, "a": 2}) == encode_value({"a": 2, "b": 1})
    assert arg_part("d_in", np.zeros(4, np.float32)) == arg_part("d_in", np.ones(9, np.float32))  # state, not code
    assert arg_part("d_in", np.zeros(1, np.float32)) != arg_part("d_out", np.zeros(1, np.float32))


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (object(), "builtins.object"),
        (types.ModuleType("settings"), "module 'settings'"),
        (type("Local", (), {})(), "Local"),
        (lambda: None, None),  # a function is encoded, never refused
    ],
)
def test_what_cannot_be_encoded_is_uncacheable_and_named(value: object, named: str | None) -> None:
    ns: dict[str, object] = {"__name__": "m", "V": value}
    exec("def op(a, b):\n    return a + V\n", ns)
    if named is None:
        encode_op(ns["op"])  # type: ignore[arg-type]
        return
    with pytest.raises(Uncacheable) as info:
        encode_op(ns["op"])  # type: ignore[arg-type]
    assert named in info.value.reason and "global 'V'" in info.value.reason


def test_an_unbound_closure_cell_is_uncacheable() -> None:
    ns: dict[str, object] = {"__name__": "m"}
    exec(
        "def outer():\n    def op(a, b):\n        return a + later\n    if False:\n        later = 1\n    return op\n",
        ns,
    )
    with pytest.raises(Uncacheable, match="'later' is not bound"):
        encode_op(ns["outer"]())  # type: ignore[operator]


class _Base:
    """A device array whose interface its base class defines (as cupy.ndarray inherits it)."""

    def __init__(self, typestr: str, shape: tuple[int, ...]) -> None:
        self._iface = {"typestr": typestr, "shape": shape, "data": (0, False), "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return self._iface


class _DeviceArray(_Base):
    pass


def test_device_arrays_are_keyed_by_dtype_whichever_class_defines_their_interface() -> None:
    small, large = _DeviceArray("<f4", (3,)), _DeviceArray("<f4", (1000,))
    assert arg_part("d_in", small) == arg_part("d_in", large)  # shape and address: run-time state
    assert arg_part("d_in", small) != arg_part("d_in", _DeviceArray("<i4", (3,)))
    assert arg_part("d_in", small) != arg_part("d_in", np.zeros(3, np.float32))  # a host value is another kind


def test_build_refuses_what_is_not_a_cuda_compute_factory_naming_it(tmp_path) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    def make_reduce_into(**kwargs: object) -> None:  # the name of a factory, not one
        raise AssertionError("never called")

    with ContentAddressedProgramCache(tmp_path / "cas") as cache:
        for fake in (len, make_reduce_into):
            with pytest.raises(TypeError, match="not one of cuda.compute's make_\\* factories: .*"):
                cache.build(fake, d_in=None)
        assert cache.counters()["misses"] == 0 and len(cache) == 0  # nothing looked up, nothing stored
