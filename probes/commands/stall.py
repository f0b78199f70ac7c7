"""`trainprobes stall`: where a running sum in each format stops moving, and why."""
from __future__ import annotations

import json
import sys

HELP = "sum n copies of an increment in each format; show where and why the sum stalls"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser) -> None:
    from trainprobes.numerics.stall import DEFAULT_FORMATS

    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help="comma-separated formats (default: %(default)s)")
    parser.add_argument("--increments", default="1",
                        help="comma-separated increments, e.g. 1,1e-3 (default: %(default)s)")
    parser.add_argument("-n", type=int, default=10_000, help="number of additions (default: %(default)s)")
    parser.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic", "toward_zero"))
    parser.add_argument("--saturate", action="store_true",
                        help="clamp overflow to the finite max, as FP8 recipes do")
    parser.add_argument("--seed", type=int, default=0, help="seed for --rounding stochastic")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _fmt(x: float) -> str:
    from trainprobes.display import format_number
    return format_number(x, digits=6)


def run(args) -> int:
    from trainprobes.numerics.stall import stall
    from trainprobes.result import to_jsonable

    try:
        incs = [float(x) for x in _csv(args.increments)]
    except ValueError:
        print(f"error: --increments={args.increments!r} must be comma-separated numbers, e.g. 1,1e-3",
              file=sys.stderr)
        return 2
    try:
        res = stall(_csv(args.formats), incs, args.n, rounding=args.rounding, saturate=args.saturate,
                    seed=args.seed if args.rounding == "stochastic" else None)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = res.evidence["rows"]
    if args.json:
        print(json.dumps(to_jsonable(rows), indent=2))
        return 0
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
