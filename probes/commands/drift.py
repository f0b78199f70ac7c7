"""`trainprobes drift`: compare train and inference log-probs (files) or run the engine-pair demo."""
from __future__ import annotations

import json
import sys

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
    opt.add_argument("--alpha", type=float, default=0.01, help="level of the bias test (default 0.01)")
    opt.add_argument("--clip", type=float, default=2.0, help="C of the ratio band [1/C, C] (default 2)")
    opt.add_argument("--noise-kl-max", type=float, default=1e-3,
                     help="largest k2 KL (nats/token) that sampling noise may explain (default 1e-3)")
    opt.add_argument("--min-bias", type=float, default=1e-5,
                     help="smallest |mean log-ratio| (nats/token) that fails as biased; a significant "
                          "bias below it is reported only (default 1e-5; 0 fails any significant bias)")
    opt.add_argument("--clean-tol", type=float, default=1e-3,
                     help="largest log-ratio std (nats) called clean (default 1e-3)")
    opt.add_argument("--threshold", action="append", default=[], metavar="METRIC=MAX",
                     help="fail (TP-D3) when |METRIC| > MAX, e.g. k3_kl=0.001; repeatable")
    opt.add_argument("--seed", type=int, default=0, help="demo seed (model, prompts, sampling)")
    opt.add_argument("--demo-prompts", type=int, default=32, help="demo sequences per scenario")
    opt.add_argument("--demo-tokens", type=int, default=32, help="demo tokens per sequence")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    out.add_argument("--output", metavar="FILE", help="also save the JSON report here")
    out.add_argument("--plot", metavar="PNG", help="histogram of log-ratios and bias by probability")


def _thresholds(items) -> dict:
    from trainprobes.drift.stats import METRICS

    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in METRICS:
            raise ValueError(f"--threshold {item!r} must be METRIC=MAX with METRIC one of {sorted(METRICS)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--threshold {item!r}: {value!r} is not a number") from None
    return out


def _results(args) -> list:
    from trainprobes import drift

    kw = dict(alpha=args.alpha, clip=args.clip, noise_kl_max=args.noise_kl_max, min_bias=args.min_bias,
              clean_tol=args.clean_tol, thresholds=_thresholds(args.threshold) or None)
    if args.demo:
        from trainprobes.drift.demo import run_demo

        if kw["thresholds"]:
            raise ValueError("--threshold applies to --train/--infer or --rollouts, not --demo")

        def progress(i, n, name):
            print(f"[{i + 1}/{n}] {name}", file=sys.stderr, flush=True)

        options = {k: v for k, v in kw.items() if k != "thresholds"}
        return run_demo(n_prompts=args.demo_prompts, max_new_tokens=args.demo_tokens, seed=args.seed,
                        progress=progress, **options)
    if args.rollouts:
        ro = drift.load_rollouts(args.rollouts)
        train = ro.train_logprobs
        if args.hf_model:
            train = drift.recompute_with_hf(args.hf_model, ro)
        if train is None:
            raise ValueError(f"{args.rollouts!r} has no train_logprobs; add them or pass --hf-model DIR")
        return [drift.compare(train, ro.infer_logprobs, mask=ro.mask, target=args.rollouts, **kw)]
    if not (args.train and args.infer):
        raise ValueError("give --train FILE and --infer FILE, or --rollouts FILE, or --demo")
    train, tmask = drift.load_logprobs(args.train)
    infer, imask = drift.load_logprobs(args.infer)
    if train.shape != infer.shape:
        raise ValueError(f"{args.infer!r} has shape {tuple(infer.shape)}, expected "
                         f"{tuple(train.shape)} like {args.train!r}")
    mask = tmask if imask is None else (imask if tmask is None else tmask & imask)
    return [drift.compare(train, infer, mask=mask, target=f"{args.train} vs {args.infer}", **kw)]


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


def plot(results, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'trainprobes[plots]'") from None
    fig, axes = plt.subplots(len(results), 2, figsize=(10, 2.6 * len(results)), squeeze=False)
    for (a, b), r in zip(axes, results):
        h = r.evidence["log_ratio_histogram"]
        edges, counts = h["edges"], h["counts"]
        a.stairs(counts, edges, fill=True)
        a.set_yscale("log")
        a.set_xlabel("log-ratio infer - train (nats)")
        a.set_title(f"{r.metrics['drift_verdict']}: {r.target}"[:70], fontsize=8)
        rows = r.evidence.get("by_probability", [])
        b.bar(range(len(rows)), [row["mean_log_ratio"] for row in rows],
              yerr=[row["std_log_ratio"] for row in rows], capsize=2)
        b.set_xticks(range(len(rows)), [f"{row['p_high']:.2g}" for row in rows], fontsize=7)
        b.set_xlabel("p_infer bucket (upper edge)")
        b.set_ylabel("mean log-ratio")
        b.axhline(0, color="k", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> int:
    from trainprobes.result import SCHEMA_VERSION, save_results

    try:
        results = _results(args)
        if args.plot:
            plot(results, args.plot)
    except (ValueError, TypeError, ImportError) as e:
        print(f"trainprobes drift: error: {e}", file=sys.stderr)
        return 2
    if args.output:
        save_results(args.output, results, command="drift")
    if args.json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, "results": [r.to_dict() for r in results]},
                         indent=2))
    else:
        print(render(results))
    if args.demo:  # the demo succeeds when every scenario shows the drift it is meant to show
        return 0 if all(r.metrics["drift_verdict"] == r.evidence["scenario"]["expect"] for r in results) else 1
    return 0 if all(r.passed for r in results) else 1
