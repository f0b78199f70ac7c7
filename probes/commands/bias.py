"""`trainprobes bias`: is a low-precision all-reduce wrong in one direction (bias) or only noisy?"""
from __future__ import annotations

from trainprobes.commands.choices import ALGORITHMS, OPS, ROUNDING_MODES
from trainprobes.commands.options import (
    add_progress_options,
    add_report_options,
    emit_report,
    exit_for,
    parse_dtype,
    progress_for,
)
from trainprobes.validation import parse_choice, parse_int, parse_number

HELP = ("bias vs variance of an emulated low-precision all-reduce against fp64, "
        "on seeded gradient-like data (exit status 1 when biased)")


def add_arguments(parser) -> None:
    parser.add_argument("--dtype", type=parse_dtype("dtype"), default="bf16",
                        help="wire format of the gradients: fp16, bf16, torch.bfloat16, "
                             "fp8_e4m3fn, ... (default: %(default)s)")
    parser.add_argument("--world", type=parse_int("world", min=2, hint="a reduction over one "
                                                  "rank adds nothing"), default=1024,
                        help="number of ranks (default: %(default)s)")
    parser.add_argument("--numel", type=parse_int("numel", min=1), default=256,
                        help="elements per rank (default: %(default)s)")
    # "order" needs an explicit order= this command cannot pass
    algorithms = [a for a in ALGORITHMS if a != "order"]
    parser.add_argument("--algorithm", type=parse_choice("algorithm", algorithms), default="ring",
                        help=f"{', '.join(algorithms)} (default: %(default)s)")
    parser.add_argument("--op", type=parse_choice("op", OPS), default="sum")
    parser.add_argument("--avg", default=None, type=parse_choice("avg", ("premul", "divide")),
                        help="for --op avg: premul (NCCL: inputs times the rounded 1/n) or divide "
                             "(gloo: sum, then / n); default: the algorithm's own")
    parser.add_argument("--rounding", type=parse_choice("rounding", ROUNDING_MODES),
                        default="nearest", help="nearest, stochastic or toward_zero")
    parser.add_argument("--accum-dtype", type=parse_dtype("accum_dtype"), default=None,
                        help="precision of each add before the per-hop rounding")
    parser.add_argument("--reduce-dtype", type=parse_dtype("reduce_dtype"), default=None,
                        help="reduce in this format and round once to --dtype at the end (e.g. fp32)")
    parser.add_argument("--ranks-per-node", type=parse_int("ranks_per_node", min=1), default=None,
                        help="for --algorithm hierarchical")
    parser.add_argument("--trials", type=parse_int("trials", min=3), default=32,
                        help="seeded trials (default: %(default)s)")
    parser.add_argument("--seed", type=parse_int("seed", min=0), default=0)
    parser.add_argument("--alpha", default=0.01, help="significance level (default: %(default)s)",
                        type=parse_number("alpha", min=0.0, max=1.0, min_open=True, max_open=True))
    parser.add_argument("--min-effect", default=None, type=parse_number("min_effect", min=0.0),
                        help="smallest |bias| called biased (default: u/16 of --dtype, "
                             "u its unit roundoff: bf16 2.4e-4, fp16 3.1e-5, fp32 3.7e-9)")
    parser.add_argument("--no-confirm", dest="confirm", action="store_false",
                        help="judge the first trials alone (default: a borderline p, "
                             "alpha/10 <= p < alpha, runs as many trials again before failing)")
    parser.add_argument("--scale", default=1e-3, type=parse_number("scale", min=0.0, min_open=True),
                        help="gradient scale: shared signal ~ N(0, scale^2) (default: %(default)s)")
    parser.add_argument("--noise", type=parse_number("noise", min=0.0), default=1.0,
                        help="per-rank noise std as a multiple of scale (default: %(default)s)")
    parser.add_argument("--compare", action="store_true",
                        help="round to nearest, stochastic rounding and fp32 accumulation side by "
                             "side (three tests, Holm-Bonferroni corrected)")
    add_report_options(parser)
    add_progress_options(parser)


def _row(r) -> dict:
    m = r.metrics
    said = {True: "biased", False: "unbiased"}.get(m.get("biased"), "unmeasured")
    return {"target": r.target, "label": r.evidence.get("label"), "verdict": said,
            "result": r.verdict, "codes": r.codes, "bias": m.get("bias"), "ci_low": m.get("ci_low"),
            "ci_high": m.get("ci_high"), "std": m.get("std"), "p_value": m.get("p_value"),
            "p_sign": m.get("p_sign"), "p_wilcoxon": m.get("p_wilcoxon"), "trials": m.get("trials"),
            "nonfinite_trials": m.get("nonfinite_trials"), "alpha": m.get("alpha"), "seed": r.seed,
            **{k: r.evidence.get(k) for k in ("dtype", "reduce_dtype", "accum_dtype", "world", "numel",
                                              "algorithm", "op", "rounding")},
            "message": r.message}


def _trials_progress(p, labels: int, trials: int):
    """The probes' progress([label,] done, total) as one count of trials over every row of
    the table; a borderline row that confirms (twice the trials) grows the total."""
    rows: dict = {}

    def show(*a):
        label, done, total = a if len(a) == 3 else ("trials", *a)
        rows[label] = (done, total)
        p.step(sum(d for d, _ in rows.values()),
               sum(t for _, t in rows.values()) + (labels - len(rows)) * trials,
               label if labels > 1 else None)
    return show


def run(args) -> int:
    from trainprobes.budget import NEEDS, check_fits
    from trainprobes.numerics.bias import SIDE_BY_SIDE, collective_bias, rounding_side_by_side

    check_fits(NEEDS["bias"] * args.world * args.numel, f"--world {args.world} --numel "
               f"{args.numel}", fix="lower --numel or --world (the trials run one at a time)")

    labels = len(SIDE_BY_SIDE) if args.compare else 1
    kwargs = dict(dtype=args.dtype, world=args.world, numel=args.numel, algorithm=args.algorithm, op=args.op,
                  accum_dtype=args.accum_dtype, trials=args.trials, seed=args.seed, alpha=args.alpha,
                  min_effect=args.min_effect, confirm=args.confirm, scale=args.scale,
                  noise=args.noise)
    if args.ranks_per_node is not None:
        kwargs["ranks_per_node"] = args.ranks_per_node
    if args.avg is not None:
        kwargs["avg"] = args.avg
    with progress_for(args, "bias", labels * args.trials, unit="trials") as p:
        kwargs["progress"] = _trials_progress(p, labels, args.trials)
        if args.compare:
            results = rounding_side_by_side(**kwargs)
        else:
            results = [collective_bias(rounding=args.rounding, reduce_dtype=args.reduce_dtype,
                                       **kwargs)]
    emit_report(args, results)
    if args.json:
        return _exit_status(results)
    rows = [_row(r) for r in results]
    conf = f"{1 - args.alpha:.0%} CI"
    head = ("how", "bias", conf, "spread", "p (t)", "p (sign)", "verdict")
    table = [head] + [(r["label"] or r["rounding"], f"{r['bias']:+.3e}" if r["bias"] is not None else "-",
                       f"[{r['ci_low']:+.2e}, {r['ci_high']:+.2e}]" if r["ci_low"] is not None else "-",
                       f"{r['std']:.2e}" if r["std"] is not None else "-",
                       f"{r['p_value']:.2g}" if r["p_value"] is not None else "-",
                       f"{r['p_sign']:.2g}" if r["p_sign"] is not None else "-", r["verdict"]) for r in rows]
    w = [max(len(t[i]) for t in table) for i in range(len(head))]
    r0 = rows[0]
    print(f"all_reduce {r0['op']} of {r0['world']} ranks x {r0['numel']} {r0['dtype']} gradient-like "
          f"values ({r0['algorithm']}), vs the same algorithm in fp64; {r0['trials']} seeded trials "
          f"(seed {args.seed})")
    print("bias = mean signed relative error in the direction of the true value (< 0: too small)\n")
    for k, t in enumerate(table):
        print("  ".join(c.ljust(x) if i in (0, 6) else c.rjust(x) for i, (c, x) in enumerate(zip(t, w))))
        if k == 0:
            print("  ".join("-" * x for x in w))
    print()
    for r in results:
        print(r.summary_line())
    if not args.compare:
        print("\n(--compare shows round to nearest, stochastic rounding and fp32 accumulation side by side)")
    return _exit_status(results)


def _exit_status(results) -> int:
    # an errored probe (TP-E1) measured nothing: exit 2 like `trainprobes audit`, never 0
    return exit_for(results)
