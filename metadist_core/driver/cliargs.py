"""The ``metadist`` command's arguments: the parser, one subparser per subcommand, its help and examples
(docs/cli.md is generated from :func:`build_parser` by ``python scripts/gen_docs.py``)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any, NoReturn

from metadist_core.driver.clicommands import (
    CliError,
    cmd_calibrate,
    cmd_demo,
    cmd_explain,
    cmd_plan,
    cmd_plugins,
    cmd_rules,
)
from metadist_core.version import __version__


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
                out.append(
                    textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(out)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        raise CliError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The ``metadist`` parser: one subparser per command (docs/cli.md is generated from it)."""
    p = _Parser(
        prog="metadist",
        formatter_class=_Formatter,
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
                """,
    )
    p.add_argument("--version", action="version", version=f"metadist {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_plugins(sub)
    _add_rules(sub)
    _add_plan(sub)
    _add_explain(sub)
    _add_demo(sub)
    _add_calibrate(sub)
    return p


def _add_plugins(sub: Any) -> None:
    """The ``plugins`` subcommand."""
    s = sub.add_parser(
        "plugins",
        help="the frontends and solvers found, and where from",
        formatter_class=_Formatter,
        description="The frontends and solvers found (entry points metadist.frontends and "
        "metadist.solvers), the module and distribution of each, and whether it "
        "loaded.",
        epilog="""
                       example:
                         metadist plugins
                       """,
    )
    s.set_defaults(func=cmd_plugins)


def _add_rules(sub: Any) -> None:
    """The ``rules`` subcommand."""
    s = sub.add_parser(
        "rules",
        help="the rules ShardCombine finds, as a table",
        formatter_class=_Formatter,
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
                       """,
    )
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


def _add_plan(sub: Any) -> None:
    """The ``plan`` subcommand."""
    s = sub.add_parser(
        "plan",
        help="trace, discover, solve; print and save the plan",
        formatter_class=_Formatter,
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
                       """,
    )
    s.add_argument(
        "target",
        metavar="SCRIPT_OR_GRAPH",
        help="a Python script whose decorated step is planned (it runs until its first step), "
        "or a graph file (.json: a MetaIR dump or a recorded graph)",
    )
    s.add_argument("--mesh", default="2", help="mesh shape, like 8 or 2x4 (default 2)")
    s.add_argument(
        "--solver", default=None, help="ilp, beam, greedy or a solver plugin (default: the solver setting, ilp)"
    )
    s.add_argument("--memory-budget", type=int, default=None, help="bytes per device")
    s.add_argument("--profile", default=None, help="mesh profile file (default: $METADIST_MESH_PROFILE)")
    s.add_argument("--cache-dir", default=None, help="the rule cache (default: the cache_dir setting)")
    s.add_argument("--out", default=None, help="where to save the plan JSON (default: NAME.plan.json here)")
    s.add_argument(
        "--strategy",
        default=None,
        help="auto (default) or a preset: ddp, zero1, zero2, zero3, fsdp, tp, tp+dp, ep, cp, zero3+cp, fsdp+cp",
    )
    s.add_argument("--compare", action="store_true", help="price every strategy preset beside the plan")
    s.set_defaults(func=cmd_plan)


def _add_explain(sub: Any) -> None:
    """The ``explain`` subcommand."""
    s = sub.add_parser(
        "explain",
        help="the plan explained; --png FILE draws it",
        formatter_class=_Formatter,
        description="Per parameter its placement, bytes per device and why; per collective its "
        "kind, axis, bytes and time; the totals; the strategy presets' prices. The "
        "problem is read from beside the plan (NAME.problem.json, written by "
        "`metadist plan`).",
        epilog="""
                       examples:
                         metadist explain plan.json
                         metadist explain plan.json --png plan.png
                         metadist explain gpt.plan.json --problem gpt.problem.json --no-presets
                       """,
    )
    s.add_argument("plan", metavar="PLAN.json", help="a plan saved by `metadist plan`")
    s.add_argument("--png", default=None, metavar="FILE", help="draw the plan into this PNG")
    s.add_argument("--problem", default=None, metavar="FILE", help="the plan's problem JSON (default: beside it)")
    s.add_argument("--no-presets", action="store_true", help="leave out the presets' prices (no solving)")
    s.set_defaults(func=cmd_explain)


def _add_demo(sub: Any) -> None:
    """The ``demo`` subcommand."""
    s = sub.add_parser(
        "demo",
        help="the main job on an embedded default, end to end",
        formatter_class=_Formatter,
        description="With PyTorch installed: the GPT example on NPROC local CPU ranks under torchrun "
        "(gloo), its plan, its loss next to the single-device loss and its step time. "
        "Without it, or with --reference: a transformer block of numpy reference ops "
        "planned and run on simulated devices.",
        epilog="""
                       examples:
                         metadist demo
                         metadist demo --nproc 4 --mesh 2x2
                         metadist demo --backend inductor
                         metadist demo --reference --mesh 2x2 --solver greedy
                       """,
    )
    s.add_argument("--mesh", default=None, help="mesh shape, like 4 or 2x2 (default: the world as one axis)")
    s.add_argument("--nproc", type=int, default=4, help="local ranks for the PyTorch demo (default 4)")
    s.add_argument("--reference", action="store_true", help="run the framework-free reference demo")
    s.add_argument(
        "--solver", default=None, help="ilp, beam, greedy or a solver plugin (default: the solver setting, ilp)"
    )
    s.add_argument("--cache-dir", default=None, help="the rule cache (default: the cache_dir setting)")
    s.add_argument(
        "--backend", default=None, help="how each rank runs its program: eager (default) or inductor (compiled)"
    )
    s.set_defaults(func=cmd_demo)


def _add_calibrate(sub: Any) -> None:
    """The ``calibrate`` subcommand."""
    s = sub.add_parser(
        "calibrate",
        help="time real collectives and write a mesh profile",
        formatter_class=_Formatter,
        description="Time real collectives on the local devices and write a mesh profile (the "
        "latency and bandwidth of each link level), which prices plans in place of "
        "the built-in defaults.",
        epilog="""
                       examples:
                         metadist calibrate
                         metadist calibrate --out profile.json --nprocs 4
                         metadist plan script.py --mesh 2x4 --profile profile.json
                       """,
    )
    s.add_argument(
        "--out", default="metadist-mesh-profile.json", help="the profile to write (default metadist-mesh-profile.json)"
    )
    s.add_argument("--frontend", default="torch", help="the engine to time (default torch: gloo on CPU, NCCL on GPU)")
    s.add_argument("--nprocs", type=int, default=None, help="local processes to spawn outside torchrun (default 2)")
    s.set_defaults(func=cmd_calibrate)


__all__ = ["build_parser"]
