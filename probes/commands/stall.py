"""`trainprobes stall`: where a running sum in each format stops moving, and why."""
from __future__ import annotations

from trainprobes.commands.choices import ROUNDING_MODES, STALL_FORMATS
from trainprobes.commands.options import add_report_options, emit_report, parse_dtype, parse_list
from trainprobes.validation import parse_choice, parse_int, parse_number

HELP = "sum n copies of an increment in each format; show where and why the sum stalls"


def add_arguments(parser) -> None:
    parser.add_argument("--formats", type=parse_list(parse_dtype("formats"), "--formats"),
                        default=list(STALL_FORMATS), metavar="A,B",
                        help=f"comma-separated formats (default: {','.join(STALL_FORMATS)})")
    parser.add_argument("--increments", default=[1.0], metavar="X,Y",
                        type=parse_list(parse_number("increment"), "--increments"),
                        help="comma-separated increments, e.g. 1,1e-3 (default: 1)")
    parser.add_argument("-n", type=parse_int("n", min=1), default=10_000,
                        help="number of additions (default: %(default)s)")
    parser.add_argument("--rounding", type=parse_choice("rounding", ROUNDING_MODES),
                        default="nearest", help="nearest, stochastic or toward_zero")
    parser.add_argument("--saturate", action="store_true",
                        help="clamp overflow to the finite max, as FP8 recipes do")
    parser.add_argument("--seed", type=parse_int("seed", min=0), default=0,
                        help="seed for --rounding stochastic")
    add_report_options(parser)


def _fmt(x: float) -> str:
    from trainprobes.display import format_number
    return format_number(x, digits=6)


def check_no_overflow(formats, increments, saturate: bool) -> None:
    """An increment past a format's largest finite value rounds to inf (NaN in e4m3fn):
    say that, naming the format and the limit, before the sum would fail on it."""
    import torch
    from trainprobes.errors import InvalidArgument
    from trainprobes.reference.formats import get_format

    for name in formats:
        f = get_format(name)
        if saturate or f.overflow == "saturate":
            continue
        stored = f.round(torch.tensor(increments, dtype=torch.float64))
        for inc, d in zip(increments, stored.tolist()):
            if d != d or abs(d) == float("inf"):
                raise InvalidArgument(
                    f"--increments {inc:g} overflows {f.name}: its largest finite value is "
                    f"{f.max_finite:g}, so the increment itself rounds to {d} ({f.name} "
                    f"{'has no infinity' if f.overflow == 'nan' else 'overflows to inf'}); "
                    f"use increments up to {f.max_finite:g}, or --saturate to clamp at "
                    f"{f.max_finite:g} as FP8 recipes do")


def run(args) -> int:
    from trainprobes.numerics.stall import stall

    check_no_overflow(args.formats, args.increments, args.saturate)
    res = stall(args.formats, args.increments, args.n, rounding=args.rounding,
                saturate=args.saturate, seed=args.seed if args.rounding == "stochastic" else None)
    emit_report(args, [res])
    if args.json:
        return 0
    rows = res.evidence["rows"]
    head = ("format", "increment", "n", "true sum", "sequential sum", "stall at", "lost")
    table = [head] + [(r["format"], _fmt(r["increment"]), str(r["n"]), _fmt(r["true_sum"]),
                       _fmt(r["sequential_sum"]),
                       "past max" if abs(r["stall_at"]) == float("inf") else _fmt(r["stall_at"]),
                       f"{0.0 - r['relative_error'] + 0.0:.1%}" if r["relative_error"] == r["relative_error"]
                       else "nan") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for k, row in enumerate(table):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print("\nwhy:")
    for r in rows:
        print(f"  {r['format']} + {_fmt(r['increment'])}: {r['reason']}")
    print(f"\n{res.summary_line()}")
    return 0
