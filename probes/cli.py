"""The `trainprobes` command: a thin face over the probes.

Each subcommand lives in probes/commands/<name>.py with HELP, add_arguments(parser) and
run(args) -> int (the exit code). Options are parsed by argparse `type=` callables
(trainprobes.validation, trainprobes.commands.options), so a bad one stops before any work.
A run that raises one of trainprobes' own errors (or a probe's ValueError/TypeError about
its arguments) exits 2 with the message; exit codes: 0 fine, 1 a finding, 2 could not run.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("audit", "gate", "stall", "bias", "collectives", "causality", "drift", "isolation", "transforms")


class _Parser(argparse.ArgumentParser):
    """Suggests the closest command for a typo ('trainprobes colectives')."""

    def error(self, message):
        import difflib
        if "invalid choice" in message and "COMMAND" in message:
            word = message.split("'")[1] if "'" in message else ""
            close = difflib.get_close_matches(word, COMMANDS, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    from trainprobes import __version__

    parser = _Parser(
        prog="trainprobes",
        description="Find low-precision bias, broken causality and train/inference drift.")
    parser.add_argument("--version", action="version", version=f"trainprobes {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=argparse.ArgumentParser)
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
    """Run the command line; returns the exit code (never raises SystemExit)."""
    from trainprobes.errors import TrainprobesError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage error (2), --help or --version (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return int(args._run(args) or 0)
    except (TrainprobesError, ValueError, TypeError) as e:
        # refused on purpose (a bad target, a data file, a combination of options), or a
        # probe's own argument check: the message says what was passed and what works
        print(f"trainprobes {args.command}: error: {e}", file=sys.stderr)
        return 2
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
