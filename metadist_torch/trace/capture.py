"""One capture of the flat step: make_fx on fake tensors, functionalized, its numbers lifted to inputs.

:func:`trace_step` (``trace.py``) builds the flat function; this module runs it under fake tensors on the
optimizers' own path (or their capturable one where a branch on a step counter's value needs it) and
turns the captured graph into a functional one (:func:`functionalize_graph`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .amp import amp_decompositions
from .functional import functionalize_in_place
from .fxclean import _drop_detach, _drop_input_copies, _drop_profiler_nodes, _seed_by_shape
from .gradients import strip_gradients
from .hyper import UnliftableNumber, branch_guards, lift, symbolic_values
from .sideeffects import SideEffectError
from .state import StepState, capturable_optimizers
from .to_ir import TraceError


def _fake_mode() -> Any:
    """The fake mode a step is traced in: static shapes; its ShapeEnv holds the param groups' numbers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)


def _as_fake(examples: list[Any], mode: Any) -> list[Any]:
    """The step's tensors as fake tensors of ``mode``; those on the meta device (a model planned, never run)
    as if on the CPU.

    Tracing on meta itself makes device-dependent choices for a device nothing runs on: scaled dot-product
    attention falls back to its math decomposition (a softmax between two bmm over batch x heads merged
    into one dim, which no head split can pass), where a CPU step calls the fused attention kernel with
    heads as their own dim. Fake CPU tensors over the meta storage allocate nothing.
    """
    cpu = torch.device("cpu")
    return [
        mode.fake_tensor_converter.from_meta_and_device(mode, t, cpu)
        if t.device.type == "meta"
        else mode.from_tensor(t)
        for t in examples
    ]


class _BranchOnTensorNumber(Exception):
    """The optimizers' own path branched on, or folded, a number read from a tensor (a step counter)."""


def _data_dependent(e: BaseException | None) -> bool:
    """Did tracing stop at a Python decision on a number read from a tensor?"""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, (GuardOnDataDependentSymNode, DataDependentOutputException, UnliftableNumber)):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _capture(
    flat: Callable, values: list[torch.Tensor], hyper: list, state: StepState, out_box: dict, fn: Any, capturable: bool
) -> tuple[fx.GraphModule, Any, list, dict, set[str], float]:
    """``flat`` traced with make_fx on fake ``values`` and the param groups' numbers as symbols, functionalized,
    its gradient outputs stripped and the numbers lifted (:func:`metadist_torch.trace.hyper.lift`).

    With ``capturable=False`` the optimizers run the path eager torch runs (step counters read with
    ``.item()``, bias corrections as doubles): the program does eager's float operations with eager's numbers.
    Where that path decides something on a counter's value it raises :class:`_BranchOnTensorNumber`, and the
    caller traces again with ``capturable=True`` (counters stay tensors; the same formula in tensor ops, not
    bit for bit eager's). Returns the graph, the lifted numbers, the branch guards, the pinned numbers, the
    names of the gradient values and the time make_fx finished.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = _fake_mode()
    examples = _as_fake(values, mode)
    symbols = symbolic_values(hyper, state.optimizers, mode.shape_env)
    patch = capturable_optimizers(state.optimizers) if capturable else contextlib.nullcontext()
    with patch, _quiet():
        try:
            gm = make_fx(flat, tracing_mode="fake", decomposition_table=_decompositions())(*examples, *symbols)
        except SideEffectError:
            raise
        except Exception as e:
            if not capturable and _data_dependent(e):
                raise _BranchOnTensorNumber(f"{type(e).__name__}: {e}") from e
            raise TraceError(
                f"metadist could not trace the step {getattr(fn, '__name__', fn)!r}: {type(e).__name__}: {e}"
            ) from e
    t1 = time.perf_counter()
    gm = functionalize_graph(gm, examples + symbols, recompile=False)
    grad_names = set(strip_gradients(gm, out_box["n_grads"], recompile=False))
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        lifted = lift(gm, phs[len(phs) - len(hyper) :], [s.node.hint for s in symbols])
    except UnliftableNumber as e:
        if capturable:
            raise TraceError(f"metadist could not trace the step {getattr(fn, '__name__', fn)!r}: {e}") from e
        raise _BranchOnTensorNumber(str(e)) from e
    guards, pinned = branch_guards(mode.shape_env, hyper, symbols)
    return gm, lifted, guards, pinned, grad_names, t1


def _bn_with_stats(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` writes its running stats without saying so in its schema, so functionalization
    would miss the update; ``_native_batch_norm_legit`` is the same kernel with the writes declared."""
    aten = torch.ops.aten
    if running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    return aten._native_batch_norm_legit.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )


def _nll_loss_mean(self, target, weight, reduction, ignore_index):
    """A mean ``nll_loss_forward`` without class weights as its sum over the count of kept targets.

    Bit for bit the kernel's own mean (with and without ignored targets), but
    split so that a batch split needs no gathering: the count depends on the targets alone, so its one
    scalar all_reduce starts with the step and is long done when the loss needs it, and the sum is a
    partial sum. As one op the mean is not a partial mean when ignored targets fall unevenly on the
    pieces, and plans gathered the logits (two synchronous collectives in the forward). The backward
    stays ``nll_loss_backward`` with this count as its ``total_weight``. With class weights the kernel
    sums the weights in another order (not bit for bit): that op is kept whole."""
    aten = torch.ops.aten
    if reduction != 1 or weight is not None:
        return NotImplemented
    total, _ = aten.nll_loss_forward.default(self, target, None, 2, ignore_index)
    count = aten._to_copy.default(aten.sum.default(aten.ne.Scalar(target, ignore_index)), dtype=self.dtype)
    return aten.div.Tensor(total, count), count


def _decompositions() -> dict:
    # amp: the fused optimizers and GradScaler kernels take lists of tensors; traced per tensor (trace/amp.py)
    return {
        **amp_decompositions(),
        torch.ops.aten.native_batch_norm.default: _bn_with_stats,
        torch.ops.aten.nll_loss_forward.default: _nll_loss_mean,
    }


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable.*")
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.optim")
        yield


def functionalize_graph(gm: fx.GraphModule, examples: Sequence[torch.Tensor], recompile: bool = True) -> fx.GraphModule:
    """Functionalize a captured graph (in-place ops -> functional ops) and clean it for MetaIR (``recompile``:
    make its Python code; a caller that changes the graph further does it once at the end)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    _drop_profiler_nodes(gm)
    if functionalize_in_place(gm):  # the common case: one pass over the nodes (metadist_torch/trace/functional.py)
        fgm = gm
    else:  # aliasing the pass does not follow: trace it again, functionalized
        gm.recompile()
        fgm = make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="fake")(*examples)
        _drop_profiler_nodes(fgm)
        _drop_input_copies(fgm)
    _drop_detach(fgm)
    _seed_by_shape(fgm)
    fgm.graph.eliminate_dead_code()
    if recompile:
        fgm.recompile()
    return fgm


__all__ = ["functionalize_graph"]
