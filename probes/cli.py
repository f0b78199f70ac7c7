"""The `trainprobes` command: a thin face over the probes.

Each subcommand lives in probes/commands/<name>.py with HELP, add_arguments(parser) and
run(args) -> int (the exit code).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("audit", "gate", "stall", "bias", "collectives", "causality", "drift", "transforms")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainprobes",
        description="Find low-precision bias, broken causality and train/inference drift.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"trainprobes.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"trainprobes.commands.{name}":
                raise
            continue  # not built yet
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `trainprobes ... | head`: the reader left; no traceback, and no second error
        # when Python flushes stdout at exit.
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
