"""The ``metadist`` command's subcommands: what ``plugins``, ``rules``, ``plan``, ``explain``, ``demo`` and
``calibrate`` do once their arguments are read (:mod:`metadist_core.driver.cliargs` reads them)."""

from __future__ import annotations

import numpy as np

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Sequence
from metadist_core.ir.ir import MetaIR
from metadist_core.ir.recorded import load_recorded_graph
from metadist_core.plugins import PluginManager
from metadist_core.discovery.discover import discover_op
from metadist_core.discovery.rules import RuleBook
from metadist_core.discovery.discover import discover
from metadist_core.config import load_settings
from metadist_core.driver import planonly
from metadist_core.driver.planner import plan_graph
from metadist_core.cost.profile import load_profile
from metadist_core.config import check_strategy
from metadist_core.plan.explain import explain_plan, problem_path
from metadist_core.plan.picture import draw_plan
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.problem import ShardingProblem
import runpy
from metadist_core.driver.planonly import PlanOnlyDone, plan_only
from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import UnknownFrontendError

log = logging.getLogger("metadist")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _parse_shape(text: str) -> tuple[int, ...]:
    if text in ("", "scalar", "()"):
        return ()
    try:
        return tuple(int(p) for p in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise CliError(f"cannot read a shape from {text!r}; write it like 8x16") from None


def _parse_attr(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise CliError(f"--attr takes KEY=VALUE (VALUE as JSON), got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def load_graph(path: str):
    """A MetaIR from a JSON file: a MetaIR dump (``ops``) or a recorded fx graph (``nodes``)."""

    p = Path(path)
    if not p.is_file():
        raise CliError(f"no such file: {path}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CliError(f"{path} is not JSON: {e}") from None
    if "nodes" in data:
        return load_recorded_graph(p)
    if "ops" in data:
        return MetaIR.from_json(data)
    raise CliError(f"{path} is neither a MetaIR dump (with 'ops') nor a recorded graph (with 'nodes')")


# -- commands -----------------------------------------------------------------


def cmd_plugins(args) -> int:

    pm = PluginManager()
    rows = [("kind", "name", "module", "distribution", "status")]
    for r in sorted(pm.records, key=lambda r: (r.kind, r.name)):
        rows.append((r.kind, r.name, r.module, r.distribution or "-", "FAILED: " + r.error if r.error else "ok"))
    _print_table(rows)
    return 0


def cmd_rules(args) -> int:

    pm = PluginManager()
    if args.target.endswith(".json"):
        graph = load_graph(args.target)
        book = RuleBook.load(args.cache_dir) if not args.no_cache else RuleBook()
        discover(graph, pm, book, axis_sizes=(args.axis_size,), save=not args.no_cache)
        rows: list[tuple[str, ...]] = [("op signature", "status", "#rules", "rules")]
        for sig, op in graph.unique_signatures().items():
            e = book.lookup(op, graph, args.axis_size)
            if e is None:
                raise RuntimeError(
                    f"discover() left {sig} without rules on an axis of {args.axis_size}; "
                    "try again with --no-cache, and report it if it persists"
                )
            rows.append(
                (
                    _short_sig(sig),
                    e.status,
                    str(len(e.rules)),
                    "; ".join(map(str, e.rules[: args.max_rules])) + (" ..." if len(e.rules) > args.max_rules else ""),
                )
            )
        _print_table(rows)
        return 0
    # a single op: KEY SHAPE [SHAPE ...]
    g = MetaIR("rules")
    names = []
    for i, s in enumerate(args.shapes):
        names.append(f"in{i}")
        g.add_input(f"in{i}", _parse_shape(s), args.dtype)
    attrs = dict(_parse_attr(a) for a in args.attr)
    out_shape = _parse_shape(args.out_shape) if args.out_shape else None
    op = g.add_op(args.target, names, [("out0", out_shape if out_shape is not None else (), args.dtype)], attrs)
    if out_shape is None:
        _infer_out_shape(pm, g, op)
    entry = discover_op(op, g, pm, args.axis_size)
    print(
        f"{args.target} on ({', '.join(args.shapes)}), axis of {args.axis_size}: {entry.status}"
        + (f" ({entry.note})" if entry.note else "")
    )
    rows = [tuple(f"in{i}" for i in range(len(names))) + ("->", "out")]
    for r in entry.rules:
        rows.append(tuple(map(str, r.inputs)) + ("->", ", ".join(map(str, r.outputs))))
    _print_table(rows)
    return 0


def _infer_out_shape(pm, g, op) -> None:
    try:
        spec = pm.op_spec(op, g)
    except Exception as e:
        raise CliError(f"cannot run {op.key} on inputs {[g.vars[v].shape for v in op.inputs]}: {e}") from None
    if spec is None:
        known = ", ".join(pm.names("frontend"))
        raise CliError(f"no loaded frontend runs op {op.key!r} (frontends: {known})")

    try:
        out = spec.fn(*spec.example_inputs)
    except Exception as e:
        raise CliError(
            f"{op.key} raised on inputs of shapes {[g.vars[v].shape for v in op.inputs]}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    g.vars.pop(op.outputs[0])
    op.outputs = []
    for i, o in enumerate(outs):
        v = g.add_var(f"out{i}", np.shape(o), g.vars[op.inputs[0]].dtype if op.inputs else "float32")
        v.producer = op.id
        op.outputs.append(v.id)


def _settings(args):
    """The settings of this command: its options over the environment and pyproject; the solver checked."""

    s = load_settings(
        solver=getattr(args, "solver", None),
        memory_budget=getattr(args, "memory_budget", None),
        cache_dir=getattr(args, "cache_dir", None),
        mesh_profile=getattr(args, "profile", None),
    )
    pm = PluginManager()
    pm.solver(s.solver)  # an unknown solver: one line listing the known ones, before anything runs
    return s, pm


def cmd_plan(args) -> int:

    settings, pm = _settings(args)
    if args.strategy:
        settings.strategy = check_strategy(args.strategy)
    request = planonly.PlanOnly(
        mesh=_mesh_shape(args.mesh),
        out=args.out,
        solver=args.solver,
        memory_budget=args.memory_budget,
        cache_dir=args.cache_dir,
        profile=args.profile,
        strategy=args.strategy,
        compare=args.compare,
    )
    if args.target.endswith(".py"):
        return _plan_script(args, request)
    graph = load_graph(args.target)
    result = plan_graph(graph, load_profile(settings.mesh_profile).mesh(request.mesh), plugins=pm, settings=settings)
    out = planonly.show_and_save(result, args.out or f"{Path(args.target).stem}.plan.json")
    planonly.report(result, request, out, settings, pm)
    return 0


def cmd_explain(args) -> int:
    """The plan explained (its problem read from beside it, or --problem); --png draws it."""

    path = Path(args.plan)
    if not path.is_file():
        raise CliError(f"no such file: {args.plan}")
    try:
        plan = ShardingPlan.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise CliError(f"{args.plan} is not a plan saved by `metadist plan`: {e}") from None
    prob_file = Path(args.problem or problem_path(str(path)))
    problem = None
    if prob_file.is_file():
        problem = ShardingProblem.loads(prob_file.read_text())
        if len(problem.nodes) != len(plan.choices):
            raise CliError(
                f"{prob_file} is not the problem of {args.plan}: {len(problem.nodes)} decisions "
                f"against the plan's {len(plan.choices)}"
            )
    elif args.problem:
        raise CliError(f"no such file: {args.problem}")
    print(explain_plan(plan, problem=problem, presets=not args.no_presets))
    if args.png:
        draw_plan(plan, args.png, problem=problem)
        print(f"picture written to {args.png}")
    return 0


def _plan_script(args, request) -> int:
    """Run SCRIPT until its first metadist_compile'd step, which the driver plans for ``request``
    (:mod:`metadist_core.driver.planonly`), ending the script."""

    script = Path(args.target)
    if not script.is_file():
        raise CliError(f"no such file: {args.target}")
    request = dataclasses.replace(request, out=args.out or f"{script.stem}.plan.json")
    old_argv = sys.argv
    sys.argv = [str(script)] + list(args.script_args)
    sys.path.insert(0, str(script.resolve().parent))
    try:
        with plan_only(request):
            runpy.run_path(str(script), run_name="__main__")
    except PlanOnlyDone:
        return 0
    finally:
        sys.argv = old_argv
        sys.path.remove(str(script.resolve().parent))
    raise CliError(f"{args.target} finished without calling a metadist_compile'd step, so there was nothing to plan")


def _mesh_shape(text: str) -> tuple[int, ...]:
    """The mesh shape of a ``--mesh`` option (``8``, ``2x4``); a malformed one is a CliError."""

    try:
        return Mesh.parse(text).shape
    except ValueError as e:
        raise CliError(str(e)) from None


def _frontend(pm, name: str, job: str):

    try:
        return pm.frontend(name)
    except UnknownFrontendError:
        failed = [r for r in pm.records if r.kind == "frontend" and r.name == name and r.error]
        why = f" (it failed to load: {failed[0].error})" if failed else ""
        raise CliError(
            f"{job} needs the {name} frontend, which is not loaded{why}; install it with pip install 'metadist[{name}]'"
        ) from None


def cmd_demo(args) -> int:
    if args.mesh:
        _mesh_shape(args.mesh)
    _, pm = _settings(args)
    extra = (["--mesh", args.mesh] if args.mesh else []) + (["--solver", args.solver] if args.solver else [])
    if args.reference or "torch" not in pm.frontends():
        return _frontend(pm, "reference", "the reference demo").demo(extra)
    backend = ["--backend", args.backend] if args.backend else []
    return _frontend(pm, "torch", "the demo").demo(["--nproc", str(args.nproc), *extra, *backend])


def cmd_calibrate(args) -> int:

    profile = _frontend(PluginManager(), args.frontend, "calibrate").calibrate(args.out, args.nprocs)
    print(
        f"{profile.backend}: {profile.nodes} node(s) x {profile.devices_per_node} devices, "
        f"{len(profile.samples)} timed collectives"
    )
    for level, lv in profile.levels.items():
        print(
            f"  {level:<6} alpha {lv['alpha'] * 1e6:8.1f} us   beta {lv['beta'] * 1e9:7.3f} ns/byte "
            f"({1 / lv['beta'] / 1e9:.2f} GB/s)"
        )
    print(f"mesh profile written to {args.out}; use it with --profile {args.out} or METADIST_MESH_PROFILE={args.out}")
    return 0


def _short_sig(sig: str) -> str:
    key, shapes, dtypes, _ = sig.split("|")
    return f"{key} {shapes}"


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
