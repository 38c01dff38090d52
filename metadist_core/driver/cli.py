"""The ``metadist`` command: plugins, rules, plan, explain, demo, calibrate.

``metadist --help`` and ``metadist COMMAND --help`` show each with examples; docs/cli.md is generated
from :func:`build_parser` (:mod:`metadist_core.driver.cliargs`) by ``python scripts/gen_docs.py``; the
subcommands are in :mod:`metadist_core.driver.clicommands`."""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from metadist_core.driver.clicommands import CliError, load_graph
from metadist_core.driver.cliargs import build_parser

__all__ = ["main", "build_parser", "CliError", "load_graph"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # what follows goes to the script of `metadist plan SCRIPT`
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1 :]
    try:
        args = parser.parse_args(argv)
        args.script_args = script_args
        logging.basicConfig(
            level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
            format="%(levelname)s %(name)s: %(message)s",
        )
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
