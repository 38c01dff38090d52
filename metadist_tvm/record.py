"""Recorded TE calls: how each operator of a TE graph can be built again at other shapes.

A ``te.compute`` is defined for fixed shapes. Every operator that MetaDist
may split is a *call*: a builder function (a ``tvm.topi`` operator, a user
function returning ``te.compute`` tensors, or for a plain compute the
:class:`~metadist_tvm.rebuild.ComputeRebuilder` of its body) with its tensor
arguments and its static arguments. :class:`Call` keeps both; :meth:`Call.build` runs the
builder again on placeholders of any shapes and dtypes, which is how a
device's shard kernel (and every discovery run) is made.

Calls are recorded when the graph is built through :data:`topi` (a mirror of
``tvm.topi`` in which every operator records itself) or through functions
decorated with :func:`op`; calls for plain computes are made when tracing
meets them (:mod:`metadist_tvm.plain`). Tracing walks the compute DAG from the
outputs and finds, for each tensor, the call that made it.
"""

from __future__ import annotations

import functools
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import tvm
from tvm import te

# keys of ops whose second argument (``newshape``) is the target shape: run at the local target shape
RESHAPE_KEYS = {"te.topi.reshape": 1}


@dataclass(frozen=True)
class Slot:
    """Where tensor input ``index`` of a call goes in its argument template."""

    index: int


@dataclass(eq=False)
class Call:
    """One builder application: ``fn(*args, **kwargs)`` with tensor inputs replaced by :class:`Slot`.

    ``key`` is the MetaOp key (``te.topi.nn.dense``, ``te.<builder name>``);
    ``inputs``/``outputs`` are the original tensors when the call was recorded
    while building a graph (empty for a call made up by ``rules_for``).
    """

    key: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    n_inputs: int
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    fixed: bool = False  # it runs only on its own placeholders (``inputs``), at their shapes
    info: dict = field(default_factory=dict)  # more static attrs (a rebuilt compute's body text)
    opaque: str = ""  # why the op cannot be split (it then runs replicated), or "" when it can

    @property
    def fn_name(self) -> str:
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"

    @property
    def reshape_arg(self) -> int | None:
        """Position of the target-shape argument for a reshape op, else None."""
        return RESHAPE_KEYS.get(self.key)

    @functools.cached_property
    def cache_key(self) -> tuple:
        """What makes two calls build the same kernel at the same shapes: key, builder, static arguments."""
        import json

        return (self.key, id(self.fn), json.dumps(self.attrs(), sort_keys=True))

    def attrs(self) -> dict:
        """The static arguments as JSON-able attrs (tensor inputs appear as ``{"$in": i}``)."""
        return {"fn": self.fn_name, "args": to_json(list(self.args)), "kwargs": to_json(dict(self.kwargs)), **self.info}

    def with_arg(self, position: int, value: Any) -> "Call":
        """The same call with positional argument ``position`` replaced (say, a reshape's target shape)."""
        args = list(self.args)
        args[position] = value
        return Call(self.key, self.fn, tuple(args), dict(self.kwargs), self.n_inputs)

    def build(self, tensors: Sequence[Any]) -> list:
        """Run the builder on ``tensors`` (placeholders, one per input slot); its output tensors, as a list."""
        if len(tensors) != self.n_inputs:
            raise ValueError(f"{self.key} takes {self.n_inputs} tensor inputs, got {len(tensors)}")
        args = fill(self.args, tensors)
        kwargs = fill(self.kwargs, tensors)
        with suppress_recording():
            out = self.fn(*args, **kwargs)
        outs = flatten_tensors(out)
        if not outs:
            raise TypeError(f"builder {self.fn_name} of {self.key} returned no te.Tensor (got {type(out).__name__})")
        return outs


# -- argument templates ---------------------------------------------------------


def template(value: Any, is_tensor: Callable[[Any], bool], found: list) -> Any:
    """``value`` with every tensor replaced by a Slot (appending it to ``found``), lists and dicts walked."""
    if is_tensor(value):
        found.append(value)
        return Slot(len(found) - 1)
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        items = [template(v, is_tensor, found) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: template(v, is_tensor, found) for k, v in value.items()}
    return value


def fill(value: Any, tensors: Sequence[Any]) -> Any:
    """Inverse of :func:`template`: put ``tensors[i]`` where ``Slot(i)`` is."""
    if isinstance(value, Slot):
        return tensors[value.index]
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        items = [fill(v, tensors) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: fill(v, tensors) for k, v in value.items()}
    return value


def to_json(value: Any) -> Any:
    """A JSON-able form of a static argument (TVM immediates as numbers, anything else by repr)."""
    if isinstance(value, Slot):
        return {"$in": value.index}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, tvm.tirx.IntImm):
        return int(value.value)
    if isinstance(value, tvm.tirx.FloatImm):
        return float(value.value)
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):  # a TVM Array
        try:
            return [to_json(v) for v in value]
        except Exception:
            pass
    return {"$repr": str(value)}


def flatten_tensors(out: Any) -> list:
    if isinstance(out, te.Tensor):
        return [out]
    if isinstance(out, (list, tuple)) or (hasattr(out, "__len__") and not isinstance(out, str)):
        try:
            items = list(out)
        except TypeError:
            return []
        if items and all(isinstance(x, te.Tensor) for x in items):
            return items
    return []


# -- the registry of recorded calls ---------------------------------------------

_state = threading.local()
_RECORDS: dict = {}  # te.Tensor -> (Call, output index)


def _depth() -> int:
    return getattr(_state, "depth", 0)


class suppress_recording:
    """Inside it, builder calls made through :data:`topi` or :func:`op` are not recorded."""

    def __enter__(self):
        _state.depth = _depth() + 1

    def __exit__(self, *exc):
        _state.depth = _depth() - 1
        return False


def lookup(tensor: Any) -> tuple[Call, int] | None:
    """The recorded call that made ``tensor`` and which of its outputs it is, or None."""
    return _RECORDS.get(tensor)


def remember(call: Call) -> None:
    """Record ``call`` as the maker of its output tensors (as a recorded builder call would be)."""
    for i, o in enumerate(call.outputs):
        _RECORDS[o] = (call, i)


def clear_records() -> None:
    """Forget every recorded call (tensors made before can no longer be traced)."""
    _RECORDS.clear()


def call_and_record(key: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``fn(*args, **kwargs)``; when it returns new te tensors, record the call that made them."""
    if _depth() > 0:
        return fn(*args, **kwargs)
    found: list = []
    targs = template(tuple(args), lambda x: isinstance(x, te.Tensor), found)
    tkwargs = template(dict(kwargs), lambda x: isinstance(x, te.Tensor), found)
    with suppress_recording():
        out = fn(*args, **kwargs)
    outs = flatten_tensors(out)
    if not outs or any(o.same_as(t) for o in outs for t in found):
        return out  # not a tensor op, or it handed an input back (an identity): nothing to record
    if any(isinstance(o.op, te.PlaceholderOp) for o in outs):
        return out
    call = Call(key, fn, targs, tkwargs, len(found), list(found), list(outs))
    for i, o in enumerate(outs):
        _RECORDS[o] = (call, i)
    return out


def recorder(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    """``fn`` wrapped so that each call is recorded under op key ``key``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return call_and_record(key, fn, args, kwargs)

    wrapper.__metadist_key__ = key
    wrapper.__wrapped__ = fn
    return wrapper


def op(fn: Callable[..., Any] | None = None, *, name: str | None = None):
    """Decorate a TE builder (tensors and static arguments in, te tensors out) so that MetaDist can split it.

    The op key is ``te.<name>`` (default: the function's name). The builder is
    called again on placeholders of each device's shard shapes, so it must
    build its computes from the tensors it is given (``x.shape``), not from
    tensors it closes over.

    >>> @op
    ... def scale(x, factor):
    ...     return te.compute(x.shape, lambda *i: x(*i) * factor, name="scale")
    """

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        return recorder(f, f"te.{name or f.__name__}")

    return wrap(fn) if fn is not None else wrap


class _Namespace:
    """A mirror of a module (``tvm.topi`` and its submodules) whose functions record their calls."""

    def __init__(self, module: types.ModuleType, path: str) -> None:
        self._module = module
        self._path = path
        self._cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._cache:
            return self._cache[name]
        value = getattr(self._module, name)
        if isinstance(value, types.ModuleType) and value.__name__.startswith("tvm.topi"):
            wrapped: Any = _Namespace(value, f"{self._path}.{name}")
        elif callable(value) and not isinstance(value, type):
            wrapped = recorder(value, f"te.{self._path}.{name}")
        else:
            wrapped = value
        self._cache[name] = wrapped
        return wrapped

    def __dir__(self):
        return dir(self._module)

    def __repr__(self) -> str:
        return f"<metadist_tvm mirror of {self._module.__name__}: calls are recorded>"


#: ``tvm.topi`` with every operator recording its calls: ``from metadist_tvm import topi``.
topi = _Namespace(tvm.topi, "topi")
