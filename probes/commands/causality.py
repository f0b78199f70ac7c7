"""`trainprobes causality`: probe a router or model for decisions that depend on future
tokens; without --target, probe the reference routers and print their verdicts."""
from __future__ import annotations

import argparse
import itertools

from trainprobes.commands.options import (
    add_progress_options,
    add_report_options,
    emit_report,
    exit_for,
    progress_for,
)
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.validation import parse_choice, parse_int, parse_number, parse_with

HELP = "find routing/dropping decisions that depend on future tokens (perturb or truncate)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", metavar="PKG.MOD:FN",
                   help="callable mapping inputs [B, T] (ids) or [B, T, D] (floats, with "
                        "--hidden D) to per-token decisions [B, T, ...]; found from the current "
                        "directory as with `python -m`; pkg.mod.fn works too; omitted: run the "
                        "reference routers")
    p.add_argument("--mode", type=parse_choice("mode", ("perturb", "truncate")), default="perturb",
                   help="perturb: change tokens after each cut (training view); truncate: run the "
                        "prefix only (inference view, reports mismatch_rate). Default perturb")
    p.add_argument("--seq-len", type=parse_int("seq_len", min=2), default=256, metavar="T",
                   help="sequence length (256)")
    p.add_argument("--batch", type=parse_int("batch", min=1), default=4, metavar="B",
                   help="sequences per batch (4)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--vocab", type=parse_int("vocab", min=2), metavar="V",
                     help="token-id inputs in [0, V) (the default, V=1000)")
    src.add_argument("--hidden", type=parse_int("hidden", min=1), metavar="D",
                     help="float inputs [B, T, D] instead of ids (routers and blocks that take "
                          "hidden states)")
    p.add_argument("--flat", action="store_true",
                   help="the target takes one sequence [T] / [T, D] without a batch axis")
    p.add_argument("--cuts", type=parse_with(str, check_cuts, "cuts"), default=None,
                   metavar="all|N|c1,c2,...",
                   help="cuts to test: 'all' (full certification), a count to sample, or positions; "
                        "default: a few evenly spaced cuts that catch global leaks")
    p.add_argument("--trials", type=parse_int("trials", min=1), default=1,
                   help="perturbations per cut (1)")
    p.add_argument("--seed", type=parse_int("seed", min=0), default=0,
                   help="seed for inputs and perturbations (0)")
    p.add_argument("--atol", type=parse_number("atol", min=0.0), default=0.0,
                   help="tolerance for float decisions (0)")
    p.add_argument("--decision", type=_picker, default=None, metavar="INDEX|NAME",
                   help="which part of a tuple/dict/named output is the decision")
    p.add_argument("--scores", type=_picker, default=None, metavar="INDEX|NAME",
                   help="which part of the output holds routing scores [B, T, E] (for margins)")
    p.add_argument("--no-fp64", action="store_true", help="never re-run the target in float64")
    p.add_argument("--near-ties", type=parse_int("near_ties", min=0), default=32, metavar="N",
                   help="without --scores, on float inputs: decisions brought to a tie by "
                        "bisection before the future is perturbed, so a small leak flips one "
                        "(32; 0: off)")
    p.add_argument("--max-batch-tokens", type=parse_int("max_batch_tokens", min=1), default=65536,
                   help="memory budget for packing perturbed copies into one call (65536)")
    p.add_argument("--show", type=parse_int("show", min=0), default=10, metavar="N",
                   help="leaks to print (10)")
    add_report_options(p)
    add_progress_options(p)


def _picker(s: str):
    return int(s) if s.lstrip("-").isdigit() else s


def check_cuts(value, name: str = "cuts"):
    """'all', a count (int), or positions [int, ...]."""
    if value == "all":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    try:
        cuts = [int(c) for c in str(value).split(",") if c.strip()]
    except ValueError:
        cuts = []
    if not cuts:
        raise InvalidArgument(f"{name}={value!r} must be 'all', a count, or positions like "
                              "10,20,30")
    return cuts


def _inputs(args):
    import torch
    g = torch.Generator().manual_seed(args.seed)
    B, T = (1 if args.flat else args.batch), args.seq_len
    if args.hidden:
        x = torch.randn(B, T, args.hidden, generator=g)
    else:
        x = torch.randint(0, args.vocab or 1000, (B, T), generator=g)
    return x[0] if args.flat else x


def _first_call(fn, x, args) -> None:
    """One call before the probe, so a target that cannot take these inputs is told what
    to pass (ids where it wants floats: --hidden; floats where it wants ids: --vocab)."""
    try:
        fn(x)
    except Exception as e:  # the user's code: any failure on these inputs
        what = (f"hidden states {list(x.shape)} (float32)" if args.hidden else
                f"token ids {list(x.shape)} (int64, from --vocab {args.vocab or 1000})")
        fix = ("if it takes token ids, drop --hidden (and pass --vocab V)" if args.hidden else
               "if it takes hidden states (floats [B, T, D], e.g. a router), pass --hidden D")
        flat = "" if args.flat else "; if it takes one sequence without a batch axis, --flat"
        raise TargetError(f"target={args.target!r} failed on {what}: {type(e).__name__}: {e}; "
                          f"{fix}{flat}") from e


def run(args) -> int:
    from trainprobes.budget import NEEDS, check_fits
    from trainprobes.causality import check
    from trainprobes.targets import load_target

    check_fits(NEEDS["causality_float" if args.hidden else "causality_ids"] * args.batch
               * args.seq_len * (args.hidden or 1),
               f"--batch {args.batch} --seq-len {args.seq_len}"
               + (f" --hidden {args.hidden}" if args.hidden else ""),
               fix="lower --seq-len or --batch (a leak shows at the sequence lengths you "
                   "train with; the target's own memory comes on top)")
    if args.target is None:
        return _controls(args)
    fn = load_target(args.target, from_cwd=True)
    x = _inputs(args)
    _first_call(fn, x, args)
    with progress_for(args, f"causality {args.target}", unit="cuts x trials") as p:
        res = check(fn, x, mode=args.mode, cuts=args.cuts, trials=args.trials,
                    seed=args.seed, atol=args.atol, decision=args.decision,
                    scores=args.scores, layout="flat" if args.flat else "batched",
                    vocab=None if args.hidden else (args.vocab or 1000),
                    fp64=False if args.no_fp64 else None, max_batch_tokens=args.max_batch_tokens,
                    target=args.target, near_ties=args.near_ties, progress=p.step)
    emit_report(args, [res])
    if not args.json:
        print(format_result(res, show=args.show))
    return exit_for([res])


def _controls(args) -> int:
    from trainprobes.causality.suite import controls, expected, run_controls
    modes = ("perturb", "truncate")
    total = len(controls()) * len(modes)
    with progress_for(args, "causality", total, unit="controls") as p:
        started = itertools.count()   # run_controls reports each control as it begins
        rows = run_controls(seq_len=args.seq_len, batch=args.batch, seed=args.seed, cuts=args.cuts,
                            modes=modes, progress=lambda what: p.step(next(started), current=what))
    for ctl, mode, res in rows:  # controls: each key once, with its known verdict
        res.target = f"{ctl.name}[{mode}]"
        res.expected = "pass" if expected(ctl, mode) else "fail"
    good = [res.metrics.get("causal") is expected(ctl, mode) for ctl, mode, res in rows]
    emit_report(args, [r for _, _, r in rows],
                controls={"reproduced": sum(good), "of": len(rows)})
    if args.json:
        return 0 if all(good) else 1
    w = max(len("target"), *(len(ctl.name) for ctl, _, _ in rows))
    head = (f"{'target':{w}} {'mode':8} {'expected':9} {'verdict':8} {'causal':6} {'n_leaks':>7} "
            f"{'flip_rate':>9} {'mismatch':>8} {'evals':>5}  ok")
    print(f"reference routers and blocks: B={args.batch} T={args.seq_len} seed={args.seed}")
    print(head)
    print("-" * len(head))
    for (ctl, mode, res), ok in zip(rows, good):
        m = res.metrics
        exp = "causal" if expected(ctl, mode) else "leaky"
        mm = f"{m['mismatch_rate']:.4f}" if "mismatch_rate" in m else "-"
        print(f"{ctl.name:{w}} {mode:8} {exp:9} {res.verdict:8} {str(m.get('causal')):6} "
              f"{m.get('n_leaks', 0):7d} {m.get('flip_rate', 0):9.4f} {mm:>8} "
              f"{m.get('n_evaluations', 0):5d}  {'yes' if ok else 'NO'}")
    print(f"\n{sum(good)}/{len(rows)} verdicts as known from the mechanism")
    return 0 if all(good) else 1


def _short(v) -> str:
    """ids and masks (up to 16 values) whole, float vectors (hidden states) abridged."""
    if isinstance(v, list) and (len(v) > 16 or len(v) > 4 and any(isinstance(u, float) for u in v)):
        return "[" + ", ".join(f"{u:.4g}" if isinstance(u, float) else str(u) for u in v[:3]) + \
            f", ...] ({len(v)} values)"
    if isinstance(v, list):
        return "[" + ", ".join(f"{u:.4g}" if isinstance(u, float) else str(u) for u in v) + "]"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_result(res, show: int = 10) -> str:
    """Human-readable report of a causality Result."""
    m, ev = res.metrics, res.evidence
    lines = [res.summary_line(), ""]
    if m.get("deterministic") is False:
        lines.append(f"deterministic      no ({m.get('n_nondeterministic')} tokens moved between "
                     f"identical calls; first {ev.get('nondeterministic_positions', [])[:3]})")
        lines.append(f"n_evaluations      {m.get('n_evaluations')}")
        return "\n".join(lines)
    shape = "x".join(str(s) for s in ev["shape"])
    lines += [
        f"mode               {ev['mode']} ({len(ev['cuts'])} cuts x {m['trials']} trials on "
        f"{shape} {ev['input_dtype'].replace('torch.', '')}, seed {res.seed})",
        f"causal             {m['causal']}",
        f"n_leaks            {m['n_leaks']}  (structural {m['n_structural']}, unconfirmed "
        f"{m['n_unconfirmed']}; numerical {m['n_numerical']} excused, unverified "
        f"{m['n_unverified']})",
        f"flip_rate          {m['flip_rate']:.6f}  ({m['n_leaks']} of {m['n_compared']} decisions "
        f"at or before a cut)",
        "mismatch_rate      " + (f"{m['mismatch_rate']:.6f}  (inference view; at the last token "
                                  f"of the prefix {m['inference_mismatch_rate']:.6f})"
                                  if "mismatch_rate" in m else "n/a in perturb mode (use --mode truncate)"),
        f"batch isolated     {_yn(m['batch_isolated'])}; batch-invariant {_yn(m['batch_invariant'])}; "
        f"packed {_yn(m['packed'])}; fp64 {m['fp64']}",
        f"n_evaluations      {m['n_evaluations']}  (tokens {m['tokens_evaluated']}; "
        + ("no decision flipped)" if m.get("evaluations_to_first_flip") is None
           else f"first flip after {m['evaluations_to_first_flip']})"),
    ]
    if ev["leak_distances"]:
        lines.append("leak distances     " + ", ".join(f"{d}: {n}" for d, n in
                                                         list(ev["leak_distances"].items())[:12]))
    if ev["leaks"] and show:
        lines += ["", f"first leaks (of {m['n_leaks'] + m['n_unverified']}):",
                  f"  {'batch':>5} {'pos':>5} {'cut':>5} {'dist':>4}  {'kind':11} before -> after"]
        for lk in ev["leaks"][:show]:
            lines.append(f"  {lk['batch']:5d} {lk['position']:5d} {lk['cut']:5d} {lk['distance']:4d}  "
                         f"{lk['kind']:11} {_short(lk['before'])} -> {_short(lk['after'])}")
    return "\n".join(lines)


def _yn(v) -> str:
    return {True: "yes", False: "NO", None: "n/a"}[v]
