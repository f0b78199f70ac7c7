"""Option types shared by the commands and the audit config: argparse `type=` callables
built on trainprobes.validation, so a bad option is refused before any work (exit 2, with
argparse's usage line), and the one dtype resolver every face uses.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from trainprobes.errors import InvalidArgument
from trainprobes.validation import parse_with

# Spellings get_format may not know (yet): torch's and numpy's module prefixes, and
# ml_dtypes' "floatN_..." names of the fp4/fp6 formats ("float6_e2m3fn" -> "fp6_e2m3fn").
# ml_dtypes' float8_e4m3 (IEEE-like, with inf) is NOT fp8_e4m3fn: it stays unknown.
_PREFIXES = ("torch.", "numpy.", "np.", "ml_dtypes.", "jnp.", "jax.numpy.")


def _spellings(text: str):
    yield text
    bare = text
    for p in _PREFIXES:
        if bare.lower().startswith(p):
            bare = bare[len(p):]
            yield bare
            break
    if bare.lower().startswith(("float4_", "float6_")):
        yield "fp" + bare[len("float"):]


def _known_names() -> list[str]:
    from trainprobes.reference.formats import ALIASES, FORMATS
    return sorted(set(FORMATS) | set(ALIASES))


def check_dtype(value, name: str = "dtype", *, allowed=None, hint: str | None = None) -> str:
    """The canonical format name (trainprobes.reference.formats) of any spelling: fp16,
    float16, half, torch.float16, bf16, bfloat16, torch.bfloat16, fp8_e4m3fn,
    torch.float8_e4m3fn, e4m3, float6_e2m3fn, ... allowed: canonical names that may be
    used here (e.g. what a backend can reduce); hint says why."""
    from trainprobes.reference.formats import get_format

    fmt = None
    if isinstance(value, str):
        for text in _spellings(value.strip()):
            try:
                fmt = get_format(text)
                break
            except (ValueError, TypeError, KeyError):
                continue
    if fmt is None:
        from trainprobes.reference.formats import FORMATS
        typed = str(value).strip().lower()
        # a family typed without its variant (fp8, fp6) means one of its members, not the
        # nearest spelling ('fp8' is closest to 'fp4')
        family = [n for n in FORMATS if typed and n.startswith(typed + "_")]
        close = family or difflib.get_close_matches(typed, _known_names(), n=1)
        maybe = (f"; did you mean {' or '.join(repr(n) for n in family)}?" if family
                 else f"; did you mean {close[0]!r}?" if close else "")
        raise InvalidArgument(f"{name}={value!r} is not a known number format{maybe} (known: "
                              f"{', '.join(FORMATS)}; torch and ml_dtypes spellings such as "
                              "torch.bfloat16 or float8_e4m3fn work too)")
    if allowed is not None and fmt.name not in allowed:
        spelled = "" if value == fmt.name else f" ({fmt.name})"
        raise InvalidArgument(f"{name}={value!r}{spelled} cannot be used here"
                              + (f": {hint}" if hint else "") + f"; usable: {', '.join(allowed)}")
    return fmt.name


def parse_dtype(metavar: str = "dtype", **kwargs):
    """`type=parse_dtype("dtype")`: any spelling of a format, normalised to its name."""
    return parse_with(str, check_dtype, metavar, **kwargs)


def parse_list(item, metavar: str):
    """`type=parse_list(parse_dtype("formats"), "formats")`: comma-separated items, each
    parsed by the `type=` callable `item`; at least one, each once."""
    def parse(text: str):
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{metavar}={text!r} is empty; give one or more, "
                                             "separated by commas")
        return list(dict.fromkeys(item(t) for t in parts))  # a repeated item is one setting, judged once
    parse.__name__ = metavar
    return parse


# --- output: one report shape for every command ----------------------------------------

def add_report_options(parser) -> None:
    """--json and --output: the report document (trainprobes.result.report_document)."""
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON instead of text: {schema_version, "
                             "command, options, results: [...]}, the document --output writes "
                             "and `trainprobes gate` reads (docs/gate.md)")
    parser.add_argument("--output", metavar="FILE",
                        help="also save that report to FILE (e.g. a gate baseline); an "
                             "existing FILE is refused unless --force")
    add_force_option(parser)


def add_force_option(parser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="replace files this command writes (--output, --plot, "
                             "--markdown) when they exist (default: refuse, exit 2)")


# The options that name a file a command writes, checked before any work (check_outputs).
WRITES = {"output": "--output", "plot": "--plot", "markdown": "--markdown"}


def check_writable(path, flag: str, *, force: bool = False) -> None:
    """Refuse, before any work, a file `flag` cannot write: a folder, a path under a file,
    a folder that cannot be created or written, or an existing file without --force."""
    import os
    from pathlib import Path

    from trainprobes.errors import OutputExists
    p = Path(path)
    if p.is_dir():
        raise InvalidArgument(f"{flag} {str(p)!r} is a folder; name a file in it, e.g. "
                              f"{str(p / ('report.json' if flag == '--output' else 'out.png'))!r}")
    if p.exists() and not force:
        raise OutputExists(f"{flag} {str(p)!r} exists (a baseline or report someone wrote?); "
                           f"pass --force to replace it, or name a new file")
    folder = p.parent
    while not folder.exists():  # the first folder that exists: the rest will be created
        folder = folder.parent
    if not folder.is_dir():
        raise InvalidArgument(f"{flag} {str(p)!r}: {str(folder)!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{flag} {str(p)!r}: the folder {str(folder)!r} is not writable")


def write_announced(path, write, what: str) -> None:
    """write(path), then one line on stderr saying where the file went and which folder was
    made for it: a user who typed a folder name wrong still finds the file."""
    import sys
    from pathlib import Path
    path = Path(path).absolute()
    made = "" if path.parent.exists() else f" (created the folder {str(path.parent)!r})"  # before the write
    write(path)
    print(f"trainprobes: {what} written to {str(path)!r}{made}", file=sys.stderr)


def check_outputs(args) -> None:
    """check_writable for every file option the parsed `args` names."""
    for attr, flag in WRITES.items():
        value = getattr(args, attr, None)
        if isinstance(value, str) and value:
            check_writable(value, flag, force=bool(getattr(args, "force", False)))


def options_of(args) -> dict:
    """The parsed options, for the report (what ran, to rerun it)."""
    return {k: v for k, v in vars(args).items()
            if not k.startswith("_") and k not in ("json", "output", "force", "command")}


def emit_report(args, results, **extra) -> None:
    """Save (--output) and print (--json) the report of `results`, one shape for all."""
    from trainprobes.result import dumps_report, save_results

    meta = {"command": args.command, "options": options_of(args), **extra}
    if getattr(args, "output", None):
        write_announced(args.output, lambda p: save_results(p, results, replace=bool(getattr(args, "force", False)),
                                                            **meta), "report")
    if args.json:
        print(dumps_report(results, **meta))


# --- devices: a requested one runs here or the command stops (exit 2), never a fallback ---

def parse_device(text: str) -> str:
    """argparse type for --device: 'cpu' (no torch import), or a torch device this machine
    has ('cuda', 'cuda:1', 'mps'); otherwise InvalidArgument saying what is here."""
    text = str(text).strip()
    if text == "cpu":
        return text
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"device={text!r} is not a torch device; e.g. cpu, "
                                         f"cuda, cuda:0") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (dev.index or 0) >= n:
            raise argparse.ArgumentTypeError(
                f"device={text!r}: this machine has {n} CUDA device(s) visible to torch "
                f"{torch.__version__}" + ("" if n else "; use --device cpu"))
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise argparse.ArgumentTypeError(f"device={text!r}: MPS is not available here; "
                                             f"use --device cpu")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"device={text!r}: only cpu, cuda and mps are "
                                         f"supported")
    return text


def parse_backend(choices) -> "callable":
    """argparse type for --backend: one of `choices`; 'nccl' only where torch sees a GPU
    and was built with NCCL (checked at parse time, before any process starts)."""
    from trainprobes.validation import parse_choice
    choose = parse_choice("backend", choices)

    def parse(text: str) -> str:
        name = choose(text)
        if name == "nccl":
            import torch
            import torch.distributed as dist
            if not torch.cuda.is_available():
                raise argparse.ArgumentTypeError("backend 'nccl' needs CUDA, and torch.cuda."
                                                 "is_available() is False here; use gloo (CPU)")
            if not (dist.is_available() and dist.is_nccl_available()):
                raise argparse.ArgumentTypeError(f"backend 'nccl': torch {torch.__version__} "
                                                 f"was built without NCCL; use gloo")
        return name
    return parse


def add_progress_options(parser) -> None:
    """--progress / --no-progress: progress lines on stderr, on by default on a terminal
    only (a CI log gets them with --progress)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", action="store_true", default=None,
                   help="progress lines on stderr even when it is not a terminal (a CI log)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress output on stderr")


def progress_wanted(args, stream=None) -> bool:
    """Progress asked for, or stderr a terminal and not silenced."""
    if getattr(args, "no_progress", False):
        return False
    if getattr(args, "progress", None):
        return True
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


# --- counts, a test level and a seed: the integer options several commands share ---------

def add_int_options(group, *specs) -> None:
    """One option per (flag, default, minimum, help): an integer refused below `minimum` before
    any work, its default said in its help."""
    from trainprobes.validation import parse_int
    for flag, default, minimum, text in specs:
        group.add_argument(flag, type=parse_int(flag.lstrip("-").replace("-", "_"), min=minimum),
                           default=default, help=f"{text} (default {default})")


def add_alpha_option(group, test: str, default: float = 0.01) -> None:
    """--alpha: the level of `test`, in (0, 1)."""
    from trainprobes.validation import parse_number
    group.add_argument("--alpha", default=default, help=f"level of {test} (default {default:g})",
                       type=parse_number("alpha", min=0.0, max=1.0, min_open=True, max_open=True))


def progress_for(args, what: str, total: int | None = None, *, unit: str = "", stream=None,
                 limit: float | None = None):
    """The command's trainprobes.progress.Progress: lines on stderr at least every 5 s while
    it works, quiet unless progress_wanted(args). Use it as a context manager around the work
    (it starts the heartbeat and clears a terminal's bar before the results are printed)."""
    from trainprobes.progress import Progress
    stream = sys.stderr if stream is None else stream
    return Progress(what, total, unit=unit, stream=stream, limit=limit,
                    quiet=not progress_wanted(args, stream))


# --- the exit code a command's Results give -----------------------------------------------

def exit_for(results) -> int:
    """0 pass, 1 a finding, 2 cannot judge (trainprobes.exits): a Result that errored, or failed
    with its verdict boolean None (nothing could decide it: an unverified leak, a
    nondeterministic target), is a cannot-judge, not a finding. A definite finding anywhere
    wins, so a run with one leak and one unknown exits 1."""
    from trainprobes.result import PROBES
    findings = unjudged = False
    for r in results:
        spec = PROBES.get(r.probe)
        flag = r.metrics.get(spec.flag) if spec is not None and spec.flag else False
        if r.verdict == "error" or (r.verdict == "fail" and flag is None):
            unjudged = True
        elif r.verdict == "fail":
            findings = True
    return 1 if findings else 2 if unjudged else 0
