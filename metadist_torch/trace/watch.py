"""What a compiled torch step watches between calls: every piece of Python state its trace read.

Inputs, fed at every call (a change never re-plans):

- every number of every optimizer param group the step reads: lr, weight_decay,
  betas, eps, momentum, dampening, ... (:mod:`metadist_torch.trace.hyper`), so LR
  schedulers, OneCycle's momentum cycle and hand-set values take effect;
- the step's tensor arguments and the state tensors' values (parameters,
  buffers, optimizer state, a GradScaler's scale), as always.

Guards, checked at every call by :class:`StepWatch` (a change re-plans, see
:class:`metadist_core.driver.step.CompiledStep`):

- the signature of the call (:func:`metadist_torch.trace.state.signature`): tensor
  shapes, dtypes, devices and requires_grad; other arguments by value (a
  Python flag the step branches on); modules and optimizers by identity;
- each parameter's ``requires_grad``, whether it holds a ``.grad`` (read and
  accumulated into by the step), and each parameter's and buffer's dtype and
  device;
- each module's ``training`` flag;
- each optimizer's param groups: how many, which parameters each holds and in
  what order (``add_param_group``), and their non-numeric entries (``maximize``,
  ``nesterov``, ``amsgrad``, ``foreach``, ...);
- the branches the optimizer took on a number (``if weight_decay != 0``), and a
  number whose type changed (int to float);
- the optimizer's per-parameter state: the same state dicts (a
  ``load_state_dict`` replaces them) with the same keys, and the per-parameter
  step counters that the program reads as one still equal (a layer frozen for
  a while leaves its counters behind);
- grad mode and autocast (enabled, dtype) on the CPU and CUDA;
- hooks on every module (forward, forward-pre, backward, backward-pre) and on
  every parameter, and torch's global module hooks;
- a GradScaler's settings (enabled, growth and backoff factors, interval).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from metadist_core.driver.frontend import Watch

from ..runtime.eager import HOOK_IDS as EAGER_HOOKS
from ..runtime.engine import agree_on
from .hyper import is_fed
from .trace import TracedStep

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _hook_keys(d: Any) -> tuple:
    return tuple(d) if d else ()


class StepWatch(Watch):
    """The guards of one compiled torch step, read from the live objects right after its compile.

    :meth:`failed` says what changed since (None: nothing); :meth:`agree` makes every rank take the same
    decision.
    """

    def __init__(self, traced: TracedStep, engine: Any = None) -> None:
        self.traced = traced
        st = traced.state
        self.engine = engine
        self.modules = [m for top in st.modules for m in top.modules()]
        self.checks: list[tuple[str, Callable[[], Any]]] = [
            ("requires_grad of the parameters", lambda: tuple(s.get().requires_grad for s in st.params)),
            ("which parameters hold a .grad", lambda: tuple(s.get().grad is not None for s in st.params)),
            (
                "dtype or device of a parameter or buffer",
                lambda: tuple((t.dtype, t.device.type) for t in (s.get() for s in st.params + st.buffers)),
            ),
            ("a module's training flag (train()/eval())", lambda: tuple(m.training for m in self.modules)),
            ("the optimizer's param groups (add_param_group, or other parameters in a group)", self._groups),
            ("a non-numeric entry of the optimizer's param groups", self._group_flags),
            ("the optimizer's state (load_state_dict, or state of another kind)", self._opt_state),
            ("grad mode or autocast", _modes),
            ("hooks on the model or its parameters", self._hooks),
            (
                "a GradScaler's settings",
                lambda: tuple(
                    (
                        sc.is_enabled(),
                        *(getattr(sc, k, None) for k in ("_growth_factor", "_backoff_factor", "_growth_interval")),
                    )
                    for sc in st.scalers
                ),
            ),
        ]
        self.snapshot = [fn() for _, fn in self.checks]

    def _params_now(self) -> dict[int, int]:
        return {id(s.get()): i for i, s in enumerate(self.traced.state.params)}

    def _groups(self) -> tuple:
        index = self._params_now()
        return tuple(
            tuple(tuple(index.get(id(p), -1) for p in g["params"]) for g in opt.param_groups)
            for opt in self.traced.state.optimizers
        )

    def _group_flags(self) -> tuple:
        out = []
        for opt in self.traced.state.optimizers:
            for g in opt.param_groups:
                for k in sorted(g):
                    v = g[k]
                    if k == "params" or is_fed(v):  # the numbers are inputs (metadist_torch.trace.hyper)
                        continue
                    out.append((k, id(v) if isinstance(v, torch.Tensor) else v))
        return tuple(out)

    def _opt_state(self) -> tuple:
        out = []
        for opt in self.traced.state.optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    st = opt.state.get(p)
                    out.append((id(st), tuple(st) if st else ()))
        return tuple(out)

    def _counters_equal(self, returning: bool) -> bool:
        """Do the step counters the trace found equal (and reads as one) still hold equal values? Read at every
        call where they live on the host; on a device (a read waits for it), when another program ran since
        this one (a program that steps some of them only: a layer frozen for a while)."""
        opt = self.traced.state.opt_states
        pairs = [(_local(opt[i].get()), _local(opt[j].get())) for i, j in self.traced.merged_counters.items()]
        if not returning and any(a.device.type != "cpu" for a, _ in pairs):
            return True
        return all(a.item() == b.item() for a, b in pairs)

    def _hooks(self) -> tuple:
        """The handles of every hook (each handle's id is new: a hook removed and another added differ)."""
        import torch.nn.modules.module as mm

        mods = [
            k
            for m in self.modules
            for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
            if d
            for k in d
            if k not in EAGER_HOOKS  # metadist_torch.runtime.eager's own, installed when the state is placed
        ]
        params = [
            k
            for s in self.traced.state.params
            for d in (getattr(s.get(), "_backward_hooks", None), getattr(s.get(), "_post_accumulate_grad_hooks", None))
            if d
            for k in d
        ]
        return tuple(mods), tuple(params), tuple(_hook_keys(getattr(mm, k, None)) for k in _GLOBAL_HOOKS)

    def failed(self, args: tuple, kwargs: dict, returning: bool = True) -> str | None:
        """What changed since the compile that the program depends on, in words; None when nothing did."""
        for (what, fn), old in zip(self.checks, self.snapshot):
            if fn() != old:
                return f"{what} changed"
        if not self._counters_equal(returning):
            return "the optimizer's step counters that the program reads as one differ now"
        return self.traced.hyper.changed(self.traced.state.optimizers)

    def token(self) -> int:
        """A number every rank computes alike from what the step reads now (the param groups' numbers)."""
        return hash(tuple(self.traced.hyper.values(self.traced.state.optimizers))) % (2**62)

    def agree(self, decision: Sequence[int]) -> None:
        """Every rank holds the same ``decision`` (which compiled program runs) and the same numbers, or every
        rank raises the same error: a rank that re-planned alone would wait forever for the others."""
        eng = self.engine
        if eng is None or not eng.distributed:
            return
        agree_on(
            eng,
            [*decision, self.token()],
            "the ranks disagree on {what}: their Python state differs (rank-dependent code in the training "
            "loop: a learning rate, a frozen layer or a train/eval switch set on some ranks only). Every "
            "rank must change the same things between calls.",
            ["which compiled program to run", "how many were compiled", "the optimizer's numbers"],
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


def _modes() -> tuple:
    out: list[Any] = [torch.is_grad_enabled()]
    for dev in ("cpu", "cuda"):
        try:
            out += [torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)]
        except (RuntimeError, AttributeError):  # pragma: no cover - a build without that device type
            out.append(None)
    return tuple(out)


__all__ = ["StepWatch"]
