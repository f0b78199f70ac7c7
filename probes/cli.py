"""The `trainprobes` command: a thin face over the probes.

Each subcommand lives in probes/commands/<name>.py with HELP, add_arguments(parser) and
run(args) -> int (the exit code). Options are parsed by argparse `type=` callables
(trainprobes.validation, trainprobes.commands.options), so a bad one stops before any work.
What a run raises is mapped once, by trainprobes.exits: 2 with the message for bad usage or
a machine that cannot run the request, 3 with one line and a log file for anything else.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys

COMMANDS = ("audit", "gate", "stall", "bias", "collectives", "causality", "drift", "isolation", "transforms",
            "gemm", "zoo")


class _Parser(argparse.ArgumentParser):
    """Suggests the closest command for a typo ('trainprobes colectives'), and for an
    option the command does not take, the ones it does (argv: what was parsed)."""

    argv: list[str] = []

    def error(self, message):
        import difflib
        if "invalid choice" in message and "COMMAND" in message:
            word = message.split("'")[1] if "'" in message else ""
            close = difflib.get_close_matches(word, COMMANDS, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        elif message.startswith("unrecognized arguments:"):
            message = _unrecognized(self, message, self.argv)
        super().error(message)


def _subparser(parser: argparse.ArgumentParser, argv: list[str]):
    """The (sub)command parser the words of argv lead to: 'isolation table' -> its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if word in action.choices:
                    return _subparser(action.choices[word], argv[argv.index(word) + 1:])
    return parser


def _unrecognized(parser, message: str, argv: list[str]) -> str:
    """What the user meant: a value of an option that takes one file, split by the shell
    (reports/*/report.json matching two folders), or an option of another command."""
    import difflib
    import os
    extra = message.split(":", 1)[1].split()
    sub = _subparser(parser, argv)
    files = [w for w in extra if not w.startswith("-") and os.path.exists(w)]
    if files and len(files) == len(extra):
        return (f"{message}: more than one value where one file goes; did a shell pattern "
                f"(*) match several files? Name one, e.g. a report's latest/report.json")
    options = sorted({o for a in sub._actions for o in a.option_strings if o.startswith("--")}
                     - {"--help"})
    said = []
    for w in extra:
        if w.startswith("-"):
            close = difflib.get_close_matches(w.split("=")[0], options, n=1, cutoff=0.6)
            said.append(f"{w}: did you mean {close[0]}?" if close else f"{w}: not an option here")
    if not said:
        return message
    return (f"{message} ({'; '.join(said)}); {sub.prog} takes {', '.join(options)} "
            f"({sub.prog} --help says what each does)")


# Options that take one value: given twice with different values, which one did the user
# mean? argparse keeps the last silently; refuse instead (append/count options repeat by design).
_ONCE = (argparse._StoreAction, argparse._StoreConstAction)


def _refuse_repeats(parser: argparse.ArgumentParser) -> None:
    """Make every single-value option of parser refuse a second, different value (exit 2)."""
    for action in parser._actions:
        if isinstance(action, _ONCE) and action.option_strings and not isinstance(action, _Once):
            action.__class__ = type(f"Once{type(action).__name__}", (_Once, type(action)), {})
        elif isinstance(action, argparse._SubParsersAction):  # isolation table, ops, ...
            for sub in action.choices.values():
                _refuse_repeats(sub)


class _Once:
    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given", {})
        if self.dest in given and given[self.dest][1] != values:
            first, value = given[self.dest]
            parser.error(f"{option_string} given twice, as {first} {value!r} and "
                         f"{option_string} {values!r}: give it once")
        given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    from trainprobes._version import __version__

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
        _refuse_repeats(p)
        p.set_defaults(_run=mod.run)
    return parser


def _usage_document(argv: list[str], said: str) -> None:
    """Under --json, a command whose refusals are documents prints one for a usage error too
    (drift localize: trainprobes.commands.drift_localize.refusal_document)."""
    words = [w for w in argv if not w.startswith("-")][:2]
    if words == ["drift", "localize"]:
        from trainprobes.commands.drift_localize import usage_document
        line = next((x for x in reversed(said.splitlines()) if ": error: " in x), said.strip())
        print(usage_document(line))


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (trainprobes.exits: 0 pass, 1 a finding,
    2 bad usage or cannot judge, 3 an internal error); never raises SystemExit."""
    import time

    from trainprobes.exits import guarded

    started = time.perf_counter()
    parser = build_parser()
    parser.argv = list(sys.argv[1:] if argv is None else argv)
    said = io.StringIO()
    try:  # argparse's messages go to stderr as ever, and are kept for a --json refusal document
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (2), --help or --version (0)
        sys.stderr.write(said.getvalue())
        if e.code == 2 and "--json" in parser.argv:
            _usage_document(parser.argv, said.getvalue())
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    sys.stderr.write(said.getvalue())
    args._started = started  # the audit reports its wall time from here

    def run() -> int:
        from trainprobes.commands.options import check_outputs
        from trainprobes.quiet import third_party_noise_to_log
        check_outputs(args)  # before minutes of work, not after them
        with third_party_noise_to_log():
            return args._run(args)

    return guarded(f"trainprobes {args.command}", run)


if __name__ == "__main__":
    sys.exit(main())
