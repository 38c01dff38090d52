"""The ``metadist`` command: plugins, rules, plan, explain, demo, calibrate.

``metadist --help`` and ``metadist COMMAND --help`` show each with examples; docs/cli.md is generated
from :func:`build_parser` by ``python scripts/gen_docs.py``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Sequence

from metadist_core.version import __version__

log = logging.getLogger("metadist")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Formatter(argparse.HelpFormatter):
    """Help whose prose paragraphs (split by blank lines) are filled to the width, as argparse does, and
    whose paragraphs with indented lines (examples) are kept line for line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in textwrap.dedent(text).strip("\n").split("\n\n"):
            lines = para.splitlines()
            if any(line[:1].isspace() for line in lines):
                out.append("\n".join((indent + line).rstrip() for line in lines))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise CliError(f"{message} (see `{self.prog} --help`)")


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
    from metadist_core.ir.ir import MetaIR

    p = Path(path)
    if not p.is_file():
        raise CliError(f"no such file: {path}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CliError(f"{path} is not JSON: {e}") from None
    if "nodes" in data:
        from metadist_core.ir.recorded import load_recorded_graph
        return load_recorded_graph(p)
    if "ops" in data:
        return MetaIR.from_json(data)
    raise CliError(f"{path} is neither a MetaIR dump (with 'ops') nor a recorded graph (with 'nodes')")


# -- commands -----------------------------------------------------------------


def cmd_plugins(args) -> int:
    from metadist_core.plugins import PluginManager

    pm = PluginManager()
    rows = [("kind", "name", "module", "distribution", "status")]
    for r in sorted(pm.records, key=lambda r: (r.kind, r.name)):
        rows.append((r.kind, r.name, r.module, r.distribution or "-", "FAILED: " + r.error if r.error else "ok"))
    _print_table(rows)
    return 0


def cmd_rules(args) -> int:
    from metadist_core.discovery.discover import discover_op
    from metadist_core.ir.ir import MetaIR
    from metadist_core.plugins import PluginManager
    from metadist_core.discovery.rules import RuleBook

    pm = PluginManager()
    if args.target.endswith(".json"):
        graph = load_graph(args.target)
        book = RuleBook.load(args.cache_dir) if not args.no_cache else RuleBook()
        from metadist_core.discovery.discover import discover
        discover(graph, pm, book, axis_sizes=(args.axis_size,), save=not args.no_cache)
        rows = [("op signature", "status", "#rules", "rules")]
        for sig, op in graph.unique_signatures().items():
            e = book.lookup(op, graph, args.axis_size)
            rows.append((_short_sig(sig), e.status, str(len(e.rules)), "; ".join(map(str, e.rules[: args.max_rules]))
                         + (" ..." if len(e.rules) > args.max_rules else "")))
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
    print(f"{args.target} on ({', '.join(args.shapes)}), axis of {args.axis_size}: {entry.status}"
          + (f" ({entry.note})" if entry.note else ""))
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
    import numpy as np

    try:
        out = spec.fn(*spec.example_inputs)
    except Exception as e:
        raise CliError(f"{op.key} raised on inputs of shapes {[g.vars[v].shape for v in op.inputs]}: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    g.vars.pop(op.outputs[0])
    op.outputs = []
    for i, o in enumerate(outs):
        v = g.add_var(f"out{i}", np.shape(o), g.vars[op.inputs[0]].dtype if op.inputs else "float32")
        v.producer = op.id
        op.outputs.append(v.id)


def _settings(args):
    """The settings of this command: its options over the environment and pyproject; the solver checked."""
    from metadist_core.config import load_settings
    from metadist_core.plugins import PluginManager

    s = load_settings(solver=getattr(args, "solver", None), memory_budget=getattr(args, "memory_budget", None),
                      cache_dir=getattr(args, "cache_dir", None), mesh_profile=getattr(args, "profile", None))
    pm = PluginManager()
    pm.solver(s.solver)  # an unknown solver: one line listing the known ones, before anything runs
    return s, pm


def cmd_plan(args) -> int:
    from metadist_core.driver import planonly
    from metadist_core.driver.planner import plan_graph

    settings, pm = _settings(args)
    if args.strategy:
        from metadist_core.config import check_strategy
        settings.strategy = check_strategy(args.strategy)
    request = planonly.PlanOnly(mesh=_mesh_shape(args.mesh), out=args.out, solver=args.solver,
                                memory_budget=args.memory_budget, cache_dir=args.cache_dir, profile=args.profile,
                                strategy=args.strategy, compare=args.compare)
    if args.target.endswith(".py"):
        return _plan_script(args, request)
    from metadist_core.cost.profile import load_profile
    graph = load_graph(args.target)
    result = plan_graph(graph, load_profile(settings.mesh_profile).mesh(request.mesh), plugins=pm, settings=settings)
    out = planonly.show_and_save(result, args.out or f"{Path(args.target).stem}.plan.json")
    planonly.report(result, request, out, settings, pm)
    return 0


def cmd_explain(args) -> int:
    """The plan explained (its problem read from beside it, or --problem); --png draws it."""
    from metadist_core.plan.explain import draw_plan, explain_plan, problem_path
    from metadist_core.plan.plan import ShardingPlan
    from metadist_core.problem.problem import ShardingProblem

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
            raise CliError(f"{prob_file} is not the problem of {args.plan}: {len(problem.nodes)} decisions "
                           f"against the plan's {len(plan.choices)}")
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
    import runpy

    from metadist_core.driver.planonly import PlanOnlyDone, plan_only

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
    from metadist_core.ir.placement import Mesh

    try:
        return Mesh.parse(text).shape
    except ValueError as e:
        raise CliError(str(e)) from None


def _frontend(pm, name: str, job: str):
    from metadist_core.plugins import UnknownFrontendError

    try:
        return pm.frontend(name)
    except UnknownFrontendError:
        failed = [r for r in pm.records if r.kind == "frontend" and r.name == name and r.error]
        why = f" (it failed to load: {failed[0].error})" if failed else ""
        raise CliError(f"{job} needs the {name} frontend, which is not loaded{why}; "
                       f"install it with pip install 'metadist[{name}]'") from None


def cmd_demo(args) -> int:
    if args.mesh:
        _mesh_shape(args.mesh)
    _, pm = _settings(args)
    extra = (["--mesh", args.mesh] if args.mesh else []) + (["--solver", args.solver] if args.solver else [])
    if args.reference or "torch" not in pm.frontends():
        return _frontend(pm, "reference", "the reference demo").demo(extra)
    return _frontend(pm, "torch", "the demo").demo(["--nproc", str(args.nproc), *extra])


def cmd_calibrate(args) -> int:
    from metadist_core.plugins import PluginManager

    profile = _frontend(PluginManager(), args.frontend, "calibrate").calibrate(args.out, args.nprocs)
    print(f"{profile.backend}: {profile.nodes} node(s) x {profile.devices_per_node} devices, "
          f"{len(profile.samples)} timed collectives")
    for level, lv in profile.levels.items():
        print(f"  {level:<6} alpha {lv['alpha'] * 1e6:8.1f} us   beta {lv['beta'] * 1e9:7.3f} ns/byte "
              f"({1 / lv['beta'] / 1e9:.2f} GB/s)")
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="metadist", formatter_class=_Formatter,
                description="Trace a step, discover how every op splits (ShardCombine), "
                            "solve for the cheapest plan, run it distributed.",
                epilog="""
                examples:
                  metadist demo                                    the main job, end to end
                  metadist plan examples/torch/gpt.py --mesh 2x4   plan a script's step on a 2x4 mesh
                  metadist explain gpt.plan.json                   why the plan is what it is
                  metadist COMMAND --help                          a command's options and examples

                Settings (solver, memory budget, cache dir, ...) come from an option, else
                METADIST_<NAME>, else [tool.metadist] in pyproject.toml: see docs/configuration.md.
                """)
    p.add_argument("--version", action="version", version=f"metadist {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("plugins", help="the frontends and solvers found, and where from",
                       formatter_class=_Formatter,
                       description="The frontends and solvers found (entry points metadist.frontends and "
                                   "metadist.solvers), the module and distribution of each, and whether it "
                                   "loaded.",
                       epilog="""
                       example:
                         metadist plugins
                       """)
    s.set_defaults(func=cmd_plugins)

    s = sub.add_parser("rules", help="the rules ShardCombine finds, as a table", formatter_class=_Formatter,
                       description="Either OP SHAPE [SHAPE ...]: the rules of one op on inputs of those shapes, "
                                   "or a graph file (.json: a MetaIR dump or a recorded graph): the rules of "
                                   "each of its op signatures.",
                       epilog="""
                       examples:
                         metadist rules np.matmul 8x16 16x4
                         metadist rules aten.mm.default 8x16 16x4 --axis-size 4
                         metadist rules np.sum 8x16 --attr dim=1
                         metadist rules np.reshape 8x16 --out-shape 128 --attr shape=[128]
                         metadist rules tests/data/graphs/gpt2-tiny-2l-adamw.json
                       """)
    s.add_argument("target", metavar="OP_OR_MODEL", help="an op key (np.matmul, aten.mm.default) or a graph file")
    s.add_argument("shapes", nargs="*", metavar="SHAPE", help="input shapes of a single op, like 8x16")
    s.add_argument("--attr", action="append", default=[], metavar="KEY=VALUE", help="a static attribute (JSON value)")
    s.add_argument("--dtype", default="float32", help="the inputs' dtype (default float32)")
    s.add_argument("--out-shape", default=None, help="output shape, for reshape-like ops")
    s.add_argument("--axis-size", type=int, default=2, help="the mesh axis size to discover on (default 2)")
    s.add_argument("--max-rules", type=int, default=8, help="rules shown per op of a graph file (default 8)")
    s.add_argument("--cache-dir", default=None, help="the rule cache (default: the cache_dir setting)")
    s.add_argument("--no-cache", action="store_true", help="neither read nor write the rule cache")
    s.set_defaults(func=cmd_rules)

    s = sub.add_parser("plan", help="trace, discover, solve; print and save the plan", formatter_class=_Formatter,
                       description="Plan a script's step (it runs until its first metadist_compile'd step, "
                                   "which is planned, not run) or a graph file; print the plan and save it "
                                   "as JSON, its problem beside it (for `metadist explain`).",
                       epilog="""
                       examples:
                         metadist plan examples/torch/gpt.py --mesh 2x4
                         metadist plan script.py --mesh 2x2 --compare
                         metadist plan script.py --mesh 8 --strategy fsdp --memory-budget 8000000000
                         metadist plan graph.json --mesh 2x2 --solver beam --out graph.plan.json

                       Arguments after -- go to the script: metadist plan train.py --mesh 2x2 -- --batch 32
                       """)
    s.add_argument("target", metavar="SCRIPT_OR_GRAPH",
                   help="a Python script whose decorated step is planned (it runs until its first step), "
                        "or a graph file (.json: a MetaIR dump or a recorded graph)")
    s.add_argument("--mesh", default="2", help="mesh shape, like 8 or 2x4 (default 2)")
    s.add_argument("--solver", default=None, help="ilp, beam, greedy or a solver plugin (default: the solver "
                                                  "setting, ilp)")
    s.add_argument("--memory-budget", type=int, default=None, help="bytes per device")
    s.add_argument("--profile", default=None, help="mesh profile file (default: $METADIST_MESH_PROFILE)")
    s.add_argument("--cache-dir", default=None, help="the rule cache (default: the cache_dir setting)")
    s.add_argument("--out", default=None, help="where to save the plan JSON (default: NAME.plan.json here)")
    s.add_argument("--strategy", default=None, help="auto (default) or a preset: ddp, zero1, zero2, zero3, fsdp, "
                                                    "tp, tp+dp")
    s.add_argument("--compare", action="store_true", help="price every strategy preset beside the plan")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("explain", help="the plan explained; --png FILE draws it", formatter_class=_Formatter,
                       description="Per parameter its placement, bytes per device and why; per collective its "
                                   "kind, axis, bytes and time; the totals; the strategy presets' prices. The "
                                   "problem is read from beside the plan (NAME.problem.json, written by "
                                   "`metadist plan`).",
                       epilog="""
                       examples:
                         metadist explain plan.json
                         metadist explain plan.json --png plan.png
                         metadist explain gpt.plan.json --problem gpt.problem.json --no-presets
                       """)
    s.add_argument("plan", metavar="PLAN.json", help="a plan saved by `metadist plan`")
    s.add_argument("--png", default=None, metavar="FILE", help="draw the plan into this PNG")
    s.add_argument("--problem", default=None, metavar="FILE", help="the plan's problem JSON (default: beside it)")
    s.add_argument("--no-presets", action="store_true", help="leave out the presets' prices (no solving)")
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("demo", help="the main job on an embedded default, end to end", formatter_class=_Formatter,
                       description="With PyTorch installed: the GPT example on NPROC local CPU ranks under torchrun "
                                   "(gloo), its plan, its loss next to the single-device loss and its step time. "
                                   "Without it, or with --reference: a transformer block of numpy reference ops "
                                   "planned and run on simulated devices.",
                       epilog="""
                       examples:
                         metadist demo
                         metadist demo --nproc 4 --mesh 2x2
                         metadist demo --reference --mesh 2x2 --solver greedy
                       """)
    s.add_argument("--mesh", default=None, help="mesh shape, like 4 or 2x2 (default: the world as one axis)")
    s.add_argument("--nproc", type=int, default=4, help="local ranks for the PyTorch demo (default 4)")
    s.add_argument("--reference", action="store_true", help="run the framework-free reference demo")
    s.add_argument("--solver", default=None, help="ilp, beam, greedy or a solver plugin (default: the solver "
                                                  "setting, ilp)")
    s.add_argument("--cache-dir", default=None, help="the rule cache (default: the cache_dir setting)")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("calibrate", help="time real collectives and write a mesh profile", formatter_class=_Formatter,
                       description="Time real collectives on the local devices and write a mesh profile (the "
                                   "latency and bandwidth of each link level), which prices plans in place of "
                                   "the built-in defaults.",
                       epilog="""
                       examples:
                         metadist calibrate
                         metadist calibrate --out profile.json --nprocs 4
                         metadist plan script.py --mesh 2x4 --profile profile.json
                       """)
    s.add_argument("--out", default="metadist-mesh-profile.json",
                   help="the profile to write (default metadist-mesh-profile.json)")
    s.add_argument("--frontend", default="torch", help="the engine to time (default torch: gloo on CPU, NCCL on GPU)")
    s.add_argument("--nprocs", type=int, default=None, help="local processes to spawn outside torchrun (default 2)")
    s.set_defaults(func=cmd_calibrate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # what follows goes to the script of `metadist plan SCRIPT`
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    try:
        args = parser.parse_args(argv)
        args.script_args = script_args
        logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                            format="%(levelname)s %(name)s: %(message)s")
        if not getattr(args, "command", None):
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"metadist: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        if os.environ.get("METADIST_DEBUG"):
            raise
        msg = str(e).strip("'\"") or type(e).__name__
        print(f"metadist: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metadist: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
