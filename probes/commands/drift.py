"""`trainprobes drift`: compare train and inference log-probs (files) or run the engine-pair demo."""
from __future__ import annotations

from pathlib import Path

from trainprobes.commands.options import (
    add_alpha_option,
    add_int_options,
    add_progress_options,
    add_report_options,
    emit_report,
    progress_for,
    write_announced,
)
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_number, parse_number, parse_with

HELP = "train/inference log-prob drift: biased, heavy-tailed, noisy or clean"

KEY_METRICS = ("n_tokens", "n_units", "mean_log_ratio", "ci_low", "ci_high", "p_value",
               "std_log_ratio", "k3_kl", "k3_kl_reverse", "chi2_token", "max_abs_prob_diff",
               "prob_pearson", "frac_ratio_outside", "ess_token", "ratio_p0.1", "ratio_p99.9",
               "ess_seq")


def add_arguments(p) -> None:
    src = p.add_argument_group("inputs (one of)")
    src.add_argument("--train", metavar="FILE", help="trainer log-probs: .npz/.safetensors with 'logprobs' [N] or [B, T] (optional 'mask')")
    src.add_argument("--infer", metavar="FILE", help="inference log-probs, same layout as --train")
    src.add_argument("--rollouts", metavar="FILE", help=".jsonl/.npz/.safetensors rollouts with infer_logprobs (+ train_logprobs, mask, token_ids, prompt_ids); see docs/drift.md")
    src.add_argument("--hf-model", metavar="DIR", help="recompute train log-probs for --rollouts with a local HF causal LM (save_pretrained dir)")
    src.add_argument("--demo", action="store_true", help="run the tiny-LM engine pair (fp32/bf16, temperature, top-p) and compare each combination")
    opt = p.add_argument_group("options")
    opt.add_argument("--intersect-masks", action="store_true",
                     help="when --train and --infer both carry a 'mask' and they differ, use the "
                          "tokens both call real (said in the report); without it, differing "
                          "masks stop the command")
    add_alpha_option(opt, "the bias test")
    opt.add_argument("--clip", type=parse_number("clip", min=1.0, min_open=True), default=2.0,
                     help="C of the ratio band [1/C, C] (default 2)")
    opt.add_argument("--noise-kl-max", type=parse_number("noise_kl_max", min=0.0), default=1e-3,
                     help="largest k2 KL (nats/token) that sampling noise may explain (default 1e-3)")
    opt.add_argument("--min-bias", type=parse_number("min_bias", min=0.0), default=1e-5,
                     help="smallest |mean log-ratio| (nats/token) that fails as biased; a significant "
                          "bias below it is reported only (default 1e-5; 0 fails any significant bias)")
    opt.add_argument("--clean-tol", type=parse_number("clean_tol", min=0.0), default=1e-3,
                     help="largest log-ratio std (nats) called clean (default 1e-3)")
    opt.add_argument("--threshold", action="append", default=[], metavar="METRIC=MAX",
                     type=parse_with(str, check_threshold, "threshold"),
                     help="fail (TP-D3) when |METRIC| > MAX, e.g. k3_kl=0.001; repeatable")
    add_int_options(opt, ("--seed", 0, 0, "demo seed (model, prompts, sampling)"),
                    ("--demo-prompts", 32, 2, "demo sequences per scenario"),
                    ("--demo-tokens", 32, 1, "demo tokens per sequence"))
    out = p.add_argument_group("output")
    add_report_options(out)
    add_progress_options(out)
    out.add_argument("--plot", metavar="PNG", help="histogram of log-ratios and bias by probability")
    # `trainprobes drift localize ...`: a mode with its own options (given after the word
    # `localize`); without it the command compares log-probs as it always has
    from trainprobes.commands import drift_localize
    modes = p.add_subparsers(dest="drift_mode", metavar="localize", required=False)
    lp = modes.add_parser("localize", help=drift_localize.HELP, description=drift_localize.HELP)
    drift_localize.add_arguments(lp)


def check_threshold(item, name: str = "threshold") -> tuple:
    """METRIC=MAX with METRIC one of trainprobes.drift.stats.METRICS: (metric, max)."""
    import difflib

    from trainprobes.drift.stats import METRICS
    metric, eq, value = str(item).partition("=")
    metric = metric.strip()
    if not eq or metric not in METRICS:
        close = difflib.get_close_matches(metric, list(METRICS), n=1)
        raise InvalidArgument(f"{name}={item!r} must be METRIC=MAX with METRIC one of "
                              f"{sorted(METRICS)}" + (f"; did you mean {close[0]!r}?" if close else ""))
    return metric, check_number(_float(value), f"{name} {metric}", min=0.0)


def _float(text):
    try:
        return float(text)
    except ValueError:
        return text


def load_pair(train_path, infer_path, *, intersect: bool = False):
    """Both sides' log-probs from files: (train, infer, mask, note). Shapes must match.
    Masks that differ stop here (the files disagree on which tokens are real), unless
    intersect: then only tokens both call real are used and `note` says how many were left
    out. One mask alone is used for both sides."""
    from trainprobes import drift
    from trainprobes.errors import DataFileError

    train, tmask = drift.load_logprobs(train_path)
    infer, imask = drift.load_logprobs(infer_path)
    if train.shape != infer.shape:
        raise DataFileError(f"{str(infer_path)!r} has shape {tuple(infer.shape)}, expected "
                            f"{tuple(train.shape)} like {str(train_path)!r}")
    if tmask is None or imask is None:
        return train, infer, (tmask if imask is None else imask), ""
    differ = tmask != imask
    n = int(differ.sum())
    if not n:
        return train, infer, tmask, ""
    first = [int(i) for i in differ.nonzero()[0]]
    where = (f"first at record {first[0]}" + (f", position {first[1]}" if len(first) > 1 else "")
             + f": train {bool(tmask[tuple(first)])}, infer {bool(imask[tuple(first)])}")
    if not intersect:
        raise DataFileError(
            f"the masks of {str(train_path)!r} and {str(infer_path)!r} differ at {n} of "
            f"{differ.numel()} positions ({where}): the two sides disagree on which tokens are "
            "real; fix the files, or pass --intersect-masks to use only tokens both call real")
    mask = tmask & imask
    note = (f"masks differed at {n} positions ({where}); {int(tmask.sum() - mask.sum())} train "
            f"and {int(imask.sum() - mask.sum())} infer tokens outside the intersection were "
            f"left out (--intersect-masks): {int(mask.sum())} tokens compared")
    return train, infer, mask, note


def _results(args) -> list:
    from trainprobes import drift

    kw = dict(alpha=args.alpha, clip=args.clip, noise_kl_max=args.noise_kl_max, min_bias=args.min_bias,
              clean_tol=args.clean_tol, thresholds=dict(args.threshold) or None)
    sources = [k for k in ("demo", "rollouts", "train", "infer") if getattr(args, k)]
    if args.demo:
        from trainprobes.drift.demo import run_demo

        if len(sources) > 1 or kw["thresholds"]:
            raise InvalidArgument("--demo runs its own engine pair: it takes no --train/--infer/"
                                  "--rollouts and no --threshold")


        options = {k: v for k, v in kw.items() if k != "thresholds"}
        with progress_for(args, "drift --demo", unit="scenarios") as p:
            return run_demo(n_prompts=args.demo_prompts, max_new_tokens=args.demo_tokens,
                            seed=args.seed, progress=p.step, **options)
    if args.rollouts:
        if args.train or args.infer:
            raise InvalidArgument("give --rollouts FILE alone (it holds both sides), or --train "
                                  "FILE and --infer FILE")
        ro = drift.load_rollouts(args.rollouts)
        train = ro.train_logprobs
        if args.hf_model:
            train = drift.recompute_with_hf(args.hf_model, ro)
        if train is None:
            raise InvalidArgument(f"{args.rollouts!r} has no train_logprobs; add them or pass "
                                  "--hf-model DIR")
        return [drift.compare(train, ro.infer_logprobs, mask=ro.mask, target=args.rollouts, **kw)]
    if not (args.train and args.infer):
        raise InvalidArgument("give --train FILE and --infer FILE, or --rollouts FILE, or --demo"
                              + (f" (only --{sources[0]} was given)" if sources else ""))
    train, infer, mask, note = load_pair(args.train, args.infer, intersect=args.intersect_masks)
    r = drift.compare(train, infer, mask=mask, target=f"{args.train} vs {args.infer}", **kw)
    if note:
        r.evidence["masks"] = note
        r.message += f"; {note}"
    return [r]


def _fmt(v) -> str:
    from trainprobes.display import format_number
    return format_number(v)


def render(results) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.metrics.get('drift_verdict', '?').upper()}  {r.summary_line()}")
        expect = r.evidence.get("scenario", {}).get("expect")
        if expect:
            lines.append(f"    expected {expect}: {'yes' if expect == r.metrics['drift_verdict'] else 'NO'}")
        for k in KEY_METRICS:
            if k in r.metrics:
                lines.append(f"    {k:<20} {_fmt(r.metrics[k])}")
        rows = r.evidence.get("by_probability", [])
        if rows:
            lines.append("    by p_infer:  " + "  ".join(
                f"[{row['p_low']:.2g},{row['p_high']:.2g}] {row['mean_log_ratio']:+.3g} (n={row['n']})"
                for row in rows[:6]))
        lines.append("")
    return "\n".join(lines)


def plot(results, path, *, replace: bool = True) -> None:
    """One row per Result: the log-ratio histogram with every token drawn (tails past the
    bulk as "N beyond" bars) and the bias by inference probability with 99% confidence
    intervals, the same pictures report.html draws (trainprobes.report.plots)."""
    from trainprobes.audit.families import drift_plots
    from trainprobes.report.plots import have_matplotlib, png_sheet
    from trainprobes.result import write_atomic
    if not have_matplotlib():
        raise InvalidArgument("--plot needs matplotlib: pip install 'trainprobes[plots]'")
    rows = []
    for r in results:
        specs = drift_plots(r)
        # two files' names, not their folders: the title stays whole
        names = " vs ".join(Path(t).name for t in r.target.split(" vs "))
        title = f"{r.metrics.get('drift_verdict', '?')}: {names}"
        for spec in specs[:1]:
            spec["title"] = f"{title[:60]}: log-ratio per token"
        rows.append(specs)
    write_atomic(path, png_sheet(rows), replace=replace)


def run(args) -> int:
    if getattr(args, "drift_mode", None) == "localize":
        from trainprobes.commands import drift_localize
        return drift_localize.run(args)
    results = _results(args)
    if args.plot:
        write_announced(args.plot, lambda p: plot(results, p, replace=args.force), "plot")
    emit_report(args, results)
    if not args.json:
        print(render(results))
    if args.demo:  # the demo succeeds when every scenario shows the drift it is meant to show
        return 0 if all(r.metrics["drift_verdict"] == r.evidence["scenario"]["expect"] for r in results) else 1
    return 0 if all(r.passed for r in results) else 1
