"""`trainprobes transforms`: does a parallel transform compute the single-device step?

Without --target: the zoo of published bugs and their fixed twins as a table, side by side
with what a 5% loss tolerance, rtol 1e-5 on gradients and a bitwise loss comparison say.
With --target pkg.mod:step (a TrainingStep, or a function returning one): each --transform
on --world ranks. Exit 0 equivalent (the zoo: every verdict as known), 1 a finding, 2 could
not run.
"""
from __future__ import annotations

import argparse
import json

from trainprobes.commands.options import (
    add_progress_options,
    add_report_options,
    options_of,
    parse_backend,
    write_announced,
)
from trainprobes.transforms.options import add_probe_options, add_step_options, user_steps
from trainprobes.validation import parse_int, parse_number

HELP = ("judge parallel transforms (DDP, FSDP2, TP, PP, accumulation, custom) against the fp64 "
        "single-device step: exact, noise, biased, inconsistent or wrong")
SUMMARY = ("transform", "world", "dtype", "equivalent", "transform_verdict", "scale", "scale_ci_low",
           "scale_ci_high", "worst_parameter")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", metavar="PKG.MOD:STEP",
                   help="a trainprobes.transforms.TrainingStep (or a function returning one); "
                        "omitted: run the zoo of published bugs")
    p.add_argument("--transform", action="append", metavar="NAME[:OPTIONS]",
                   help="ddp, accumulation, fsdp2, tp, pp, with options, e.g. 'ddp:hook=bf16', "
                        "'fsdp2:param_dtype=bf16,reduce_dtype=bf16', 'tp:plan=1:colwise;3:rowwise', "
                        "'pp:schedule=gpipe,micro_batches=4,split=0+1|2+3+4', or JSON after the "
                        "colon; repeat for several (default: ddp). --list shows them all")
    add_step_options(p)
    p.add_argument("--world", type=parse_int("world", min=1), default=None,
                   help="ranks, for --target (default 2; the zoo always runs on 2)")
    add_probe_options(p)
    p.add_argument("--backend", type=parse_backend(("gloo", "nccl")), default=None,
                   help="gloo (CPU) or nccl (one GPU per rank), for --target (default gloo; "
                        "the zoo always runs on 2 gloo ranks)")
    p.add_argument("--timeout", type=parse_number("timeout", min=0, min_open=True), default=600.0,
                   help="seconds before every rank is stopped (default 600)")
    p.add_argument("--list", action="store_true", help="list the transforms, their options and the zoo")
    add_report_options(p)  # each result also carries the summary fields at its top level
    add_progress_options(p)


def _summary(r) -> dict:
    m = r.metrics
    out = {"transform": r.evidence.get("transform"), **{k: m.get(k) for k in SUMMARY[1:]}}
    if "known_verdict" in m:
        out["known_verdict"] = m["known_verdict"]
    return out


def _document(args, results) -> dict:
    """The report document, each Result with its summary fields (transform, world, dtype,
    equivalent, transform_verdict, scale and CI, worst_parameter) at its top level too."""
    from trainprobes.result import report_document, to_jsonable
    doc = report_document(results, command="transforms", options=options_of(args))
    for obj, r in zip(doc["results"], results):
        obj.update(to_jsonable(_summary(r)))
    return doc


def _emit(args, results) -> None:
    from trainprobes.result import save_results
    if args.output:
        write_announced(args.output, lambda p: save_results(p, results, command="transforms",
                                                            options=options_of(args)), "report")
    if args.json:
        print(json.dumps(_document(args, results), indent=2, allow_nan=False))


def _progress(args, what: str):
    """Progress of the ranks: what they are doing (they report only when done, so the
    estimate is their timeout's bound)."""
    from trainprobes.commands.options import progress_for
    return progress_for(args, what, limit=args.timeout)


def _list() -> int:
    import dataclasses

    from trainprobes.reference.bugs import ZOO
    from trainprobes.transforms import NORMALIZATIONS, TRANSFORMS
    print("transforms (--transform NAME:key=value,...):")
    for name, cls in TRANSFORMS.items():
        opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        print(f"  {name:13} {opts}")
    print(f"  normalization: {', '.join(NORMALIZATIONS)}")
    print("\nzoo (run with no --target):")
    for b in ZOO:
        print(f"  {b.name:22} {b.expected:12} {b.source}")
    return 0


def run(args) -> int:
    """Refusals (a bad target or option, a failed run) propagate to trainprobes.cli: exit 2."""
    from trainprobes.errors import InvalidArgument

    if args.list:
        return _list()
    if args.target is None:
        if args.transform or args.step:
            raise InvalidArgument(f"{'--transform' if args.transform else '--step'} needs --target "
                                  f"(the single-device step; the zoo runs its own steps)")
        if args.backend not in (None, "gloo") or args.world not in (None, 2):
            flag = f"--world {args.world}" if args.world not in (None, 2) else f"--backend {args.backend}"
            raise InvalidArgument(f"{flag} needs --target: the zoo runs its published bugs on 2 "
                                  f"gloo ranks")
        return _zoo(args)
    from trainprobes.targets import search_cwd
    from trainprobes.transforms import Probe, parse_transform, run_probes
    search_cwd()  # --target imports from the current folder, as causality's does
    mine = user_steps(args)
    transforms = [parse_transform(t) for t in (args.transform or ([] if mine else ["ddp"]))] + mine
    probes = [Probe(args.target, t, trials=args.trials, seed=args.seed, alpha=args.alpha,
                    min_effect=args.min_effect, noise_tol=args.noise_tol) for t in transforms]
    with _progress(args, f"transforms {args.target}") as p:
        results = run_probes(probes, world=args.world or 2, backend=args.backend or "gloo",
                             timeout=args.timeout, progress=p.say)
    _emit(args, results)
    if not args.json:
        for r in results:
            print(_human(r))
    return 0 if all(r.metrics.get("equivalent") is True for r in results) else 1


def _human(r) -> str:
    m = r.metrics
    lines = [f"{r.target}: {m['transform_verdict'].upper()} ({'equivalent' if m['equivalent'] else 'NOT equivalent'})",
             f"  scale {m['scale']:.6g} ({1 - m['alpha']:.0%} CI [{m['scale_ci_low']:.6g}, "
             f"{m['scale_ci_high']:.6g}]), signed relative error {m['signed_relative_error']:+.3g}, "
             f"max relative error {m['max_relative_error']:.3g}, worst parameter {m['worst_parameter']}"]
    if m.get("loss_reported"):
        lines.append(f"  loss x{m['loss_scale']:.6g} (CI [{m['loss_scale_ci_low']:.6g}, "
                     f"{m['loss_scale_ci_high']:.6g}])")
    lines.append(f"  {m['world']} ranks, dtype {m['dtype']}, {m['trials']} trials, seed {r.seed}")
    lines.append(f"  {r.message}")
    return "\n".join(lines)


def _mark(flag) -> str:
    return {True: "yes", False: "no", None: "n/a"}[flag]


def _zoo(args) -> int:
    from trainprobes.transforms.zoo import analytic_checks, run_zoo

    with _progress(args, "transforms (the zoo)") as p:
        rows = run_zoo(trials=args.trials, seed=args.seed, alpha=args.alpha,
                       min_effect=args.min_effect, timeout=args.timeout, progress=p.say)
    results = [r for row in rows for r in (row.buggy, row.fixed)]
    _emit(args, results)
    ok = all(row.reproduced for row in rows)
    if args.json:
        return 0 if ok else 1
    print(f"the zoo: published bugs beside their fixed twins, 2 gloo ranks, {args.trials} trials, "
          f"seed {args.seed}")
    head = (f"{'entry':21} {'expected':12} {'bug':12} {'fixed':6} {'scale [CI]':27} "
            f"{'worst parameter':17} {'loss5%':6} {'rtol':5} {'bits':5} ok")
    print(head)
    print("-" * len(head))
    for row in rows:
        m, f = row.buggy.metrics, row.fixed.metrics
        tol = row.buggy.evidence["tolerances"]
        scale = f"{m['scale']:.4g} [{m['scale_ci_low']:.4g}, {m['scale_ci_high']:.4g}]"
        print(f"{row.bug.name:21} {row.bug.expected:12} {m['transform_verdict']:12} "
              f"{f['transform_verdict']:6} {scale:27} {m['worst_parameter']:17} "
              f"{_mark(tol['loss_rtol_5pct']):6} {_mark(tol['grad_rtol_1e-5']):5} "
              f"{_mark(tol['loss_bitwise']):5} {'yes' if row.reproduced else 'NO'}")
    n = len(rows)
    caught = sum(row.buggy.metrics["transform_verdict"] == row.bug.expected for row in rows)
    print(f"\ncaught {caught} of {n} published bugs with their known verdict; fixed twins "
          f"equivalent: {sum(row.fixed.metrics['equivalent'] for row in rows)} of {n}")
    for key, label in (("loss_rtol_5pct", "a 5% loss tolerance"), ("grad_rtol_1e-5", "rtol 1e-5 on gradients"),
                       ("loss_bitwise", "a bitwise loss comparison")):
        hit = sum(bool(row.buggy.evidence["tolerances"][key]) for row in rows)
        false = sum(bool(row.fixed.evidence["tolerances"][key]) for row in rows)
        print(f"{label} flags {hit} of {n} (and {false} of {n} fixed twins)")
    checks = [(row.bug.name, c) for row in rows for c in analytic_checks(row)]
    inside = sum(c[-1] for _, c in checks)
    print(f"analytic scale factors inside the measured CI: {inside} of {len(checks)}")
    for name, (what, value, est, lo, hi, within) in checks:
        if not within:
            print(f"  {name} {what}: analytic {value:.6g}, measured {est:.6g} [{lo:.6g}, {hi:.6g}]")
    return 0 if ok else 1
