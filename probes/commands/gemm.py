"""`trainprobes gemm`: low-precision GEMMs (recipe x accumulator) against fp64."""
from __future__ import annotations

from trainprobes.commands.options import (
    add_progress_options,
    add_report_options,
    emit_report,
    parse_list,
    progress_for,
)
from trainprobes.numerics.gemm_defaults import DEFAULT_SAMPLES, DEFAULT_TOLERANCE, DEFAULT_TRIALS
from trainprobes.validation import parse_choice, parse_int, parse_number

# the names, without importing torch before argparse needs them
PRESET_NAMES = ("h200-scaled-mm", "h200-scaled-mm-signfill", "h200-scaled-mm-sum", "deepseek-v3",
                "b200-25bit", "fp32")
RECIPE_NAMES = ("exact", "bf16", "fp8-tensor", "fp8-tensor-e4m3", "fp8-rowwise", "fp8-rowwise-pow2",
                "mxfp8", "mxfp8-e5m2-grads", "mxfp4", "nvfp4", "nvfp4-paper")
IMPACT_RECIPES = ("bf16", "fp8-tensor", "fp8-rowwise", "mxfp8", "nvfp4")  # numerics.gemm_impact.RECIPES
TABLE_PRESETS = ("h200-scaled-mm", "h200-scaled-mm-signfill", "deepseek-v3", "fp32")
TARGET_RECIPE = "fp8-tensor"  # numerics.gemm_model.judge_model's default
ROWS = 256

HELP = ("bias of low-precision GEMMs (FP8/MXFP8/NVFP4 recipes, tensor-core accumulators) against "
        "fp64: the preset x recipe x K table, or a model's Linear GEMMs (exit status 1 when biased)")


def add_arguments(parser) -> None:
    parser.add_argument("--presets", type=parse_list(parse_choice("presets", PRESET_NAMES), "--presets"),
                        default=None, metavar="A,B",
                        help=f"accumulator presets (default: {','.join(TABLE_PRESETS)}; with "
                             f"--target one, default {TABLE_PRESETS[0]})")
    parser.add_argument("--recipes", type=parse_list(parse_choice("recipes", RECIPE_NAMES), "--recipes"), default=None,
                        metavar="A,B", help="quantisation recipes (default: exact: the operands "
                        "are already e4m3, the accumulator alone is judged; with --target: "
                        f"{TARGET_RECIPE}, what an fp8 training step multiplies; with --impact: "
                        f"{','.join(IMPACT_RECIPES)})")
    parser.add_argument("--what-if", action="store_true",
                        help="also judge a preset on products it was not measured on (e.g. fp32 "
                             "or bf16 operands, or block scales, under an fp8 tensor core's "
                             "accumulator): without it such a combination is refused (--target) "
                             "or left out of the table with the reason; with it the Result says "
                             "WHAT-IF")
    parser.add_argument("--k", type=parse_list(parse_int("k", min=1), "--k"), default=None,
                        metavar="K1,K2", help="reduction lengths (default: 1024,4096; with "
                        "--impact one K, the tokens of the weight gradient, default 4096)")
    parser.add_argument("--gemm", default="fprop", type=parse_choice("gemm", ("fprop", "dgrad", "wgrad")),
                        help="the operands' roles for the recipe (default: %(default)s)")
    parser.add_argument("--mean", type=parse_number("mean"), default=None,
                        help="mean of the random operands before the cast (default 0: "
                             "zero-mean; 1: mostly positive, as post-activation inputs; with "
                             "--impact the inputs' mean, default 1)")
    parser.add_argument("--impact", action="store_true",
                        help="train least squares a few dozen steps with the weight-gradient "
                             "GEMM emulated under each recipe x preset, and print the loss gap "
                             "to fp64 (exit 1 when a gap passes --loss-tol)")
    parser.add_argument("--steps", type=parse_int("steps", min=1), default=30,
                        help="SGD steps of --impact (default: %(default)s)")
    parser.add_argument("--loss-tol", type=parse_number("loss-tol", min=0.0), default=0.02,
                        help="largest final-loss gap to fp64 --impact passes (default: %(default)s)")
    parser.add_argument("--operands", default="auto", type=parse_choice("operands", OPERANDS),
                        help="the random operands' format: e4m3, bf16 or fp32; auto (default): "
                             "e4m3 under the exact recipe (the accumulator alone, products "
                             "exact), bf16 under a quantising one (what a bf16 training step "
                             "hands it: e4m3 values re-quantised under a scale that is not a "
                             "power of two are a double rounding, a bias of their own)")
    parser.add_argument("--rows", type=parse_int("rows", min=1), default=None,
                        help=f"M = N of the random GEMMs (default: {ROWS})")
    parser.add_argument("--target", default=None, metavar="pkg.mod:factory",
                        help="a factory returning (model, batch): judge every Linear's three GEMMs "
                             "from one fp32 step instead of random operands")
    parser.add_argument("--load", action="append", default=None, metavar="FILE",
                        help="judge your own operands, C = A B^T (A: M x K, B: N x K, K last in "
                             "both), saved as .pt, .npz or .safetensors: one --load FILE holding "
                             "tensors A and B (named by --a-key/--b-key), or --load A_FILE --load "
                             "B_FILE, one operand each (its only tensor, or the one the key names)")
    parser.add_argument("--a-key", default=None, metavar="NAME",
                        help="the name of operand A in its --load file (default: A in a file holding "
                             "both; the only tensor in a file of its own)")
    parser.add_argument("--b-key", default=None, metavar="NAME",
                        help="the name of operand B in its --load file (default: B, likewise)")
    parser.add_argument("--samples", type=parse_int("samples", min=16), default=DEFAULT_SAMPLES,
                        help="sampled output elements per GEMM (default: %(default)s)")
    parser.add_argument("--trials", type=parse_int("trials", min=3), default=DEFAULT_TRIALS,
                        help="independent groups the samples are split into (default: %(default)s)")
    parser.add_argument("--tolerance", type=parse_number("tolerance", min=0.0), default=None,
                        help=f"smallest |relative bias| called biased (default: {DEFAULT_TOLERANCE:g})")
    parser.add_argument("--alpha", default=0.01,
                        type=parse_number("alpha", min=0.0, max=1.0, min_open=True, max_open=True))
    parser.add_argument("--seed", type=parse_int("seed", min=0), default=0)
    add_report_options(parser)
    add_progress_options(parser)


# the share of random operands the e4m3 cast may saturate before the table is refused
SATURATED_SHARE = 0.01
OPERANDS = ("auto", "e4m3", "bf16", "fp32")


def operands_for(choice: str, recipe: str) -> str:
    """The random operands' format (--operands; auto: e4m3 under exact, else bf16)."""
    if choice != "auto":
        return choice
    return "e4m3" if recipe == "exact" else "bf16"


def _random_results(args, progress):
    import torch
    from trainprobes.budget import check_fits
    from trainprobes.errors import InvalidArgument
    from trainprobes.numerics.gemm import combination, gemm_bias
    from trainprobes.reference.gemm import get_preset
    from trainprobes.reference.recipes import E4M3_MAX, get_recipe

    recipes, ks = args.recipes or ["exact"], args.k or [1024, 4096]
    presets, rows = args.presets or list(TABLE_PRESETS), args.rows or ROWS
    mean = 0.0 if args.mean is None else args.mean
    for p in presets:
        get_preset(p)  # unknown names stop here, with the list
    for r in recipes:
        get_recipe(r)
    check_fits(8 * 12 * max(ks) * (2 * rows + args.samples),
               f"--k {max(ks)} --rows {rows} --samples {args.samples}",
               fix="lower --rows, --samples or --k")
    dtypes = {"e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
    out, not_run = [], []
    total = len(ks) * len(recipes) * len(presets)
    for K in ks:
        g = torch.Generator().manual_seed(args.seed + K)
        raw = [torch.randn(rows, K, generator=g) + mean for _ in "ab"]
        for recipe in recipes:
            fmt = operands_for(args.operands, recipe)
            if fmt == "e4m3":
                # torch's e4m3 cast saturates at +-448: operands past it all read +-448, every
                # product is the same and every accumulator looks exact; refuse beyond a small share
                over = sum(int((r.abs() > E4M3_MAX).sum()) for r in raw) / (2 * raw[0].numel())
                if over > SATURATED_SHARE:
                    raise InvalidArgument(
                        f"--mean {mean!r}: the e4m3 cast saturates {over:.1%} of the operands at "
                        f"+-{E4M3_MAX:g} (more than {SATURATED_SHARE:.0%}), so every output is the "
                        f"same and no accumulator can be judged; use |--mean| <= {E4M3_MAX - 5:g}")
            a, b = (r.to(dtypes[fmt]).double() for r in raw)
            held = (HELD[fmt],) * 2 if get_recipe(recipe).element is None else None
            for preset in presets:
                why = combination(get_preset(preset), get_recipe(recipe), args.gemm, held)
                if why and not args.what_if:  # a cell no hardware runs: left out, said why
                    not_run.append({"recipe": recipe, "preset": preset, "k": K, "reason": why})
                    continue
                kw = {} if args.tolerance is None else {"tolerance": args.tolerance}
                progress.step(len(out), total, f"K={K} {recipe} {preset}")
                r = gemm_bias(a, b, preset=preset, recipe=recipe, gemm=args.gemm,
                              samples=args.samples, trials=args.trials, seed=args.seed,
                              alpha=args.alpha, what_if=args.what_if, **kw)
                r.evidence["operands"] = f"random {fmt}, mean {mean:g}, {rows} x {K} each"
                out.append(r)
    if not out:
        raise InvalidArgument(f"no recipe x preset named here was measured on the operands it "
                              f"would judge: {not_run[0]['reason']}; name a combination that "
                              "was (e.g. --recipes fp8-tensor with an fp8 preset, or --presets "
                              "fp32), or add --what-if")
    for r in out:
        r.evidence["not_run"] = not_run
    return out


# --operands' formats as numerics.gemm.held_in names them
HELD = {"e4m3": "fp8_e4m3fn", "bf16": "bf16", "fp32": "fp32"}


def _loaded_results(args, progress):
    """The table over recipes x presets for the user's own A and B (--load)."""
    from trainprobes.errors import InvalidArgument
    from trainprobes.numerics.gemm import combination, gemm_bias, held_in
    from trainprobes.numerics.gemm_operands import load_operands
    from trainprobes.reference.gemm import get_preset
    from trainprobes.reference.recipes import get_recipe

    given = [flag for flag, value in (("--k", args.k), ("--mean", args.mean), ("--rows", args.rows),
                                      ("--target", args.target)) if value is not None] + (
        ["--operands"] if args.operands != "auto" else [])
    if given:
        raise InvalidArgument(f"{', '.join(given)} set(s) operands of their own, and --load judges "
                              "the operands in your files (K and the rows from their shapes); drop "
                              f"{'it' if len(given) == 1 else 'them'}")
    a, b = load_operands(args.load, args.a_key, args.b_key)
    held = (held_in(a.tensor), held_in(b.tensor))
    # operands already in fp8 are what the tensor core multiplies (the accumulator alone);
    # anything wider is what an fp8 training step quantises
    default = "exact" if all(f.startswith("fp8") for f in held) else TARGET_RECIPE
    recipes, presets = args.recipes or [default], args.presets or list(TABLE_PRESETS)
    for p in presets:
        get_preset(p)
    out, not_run = [], []
    K = a.tensor.shape[1]
    for recipe in recipes:
        formats = held if get_recipe(recipe).element is None else None
        for preset in presets:
            why = combination(get_preset(preset), get_recipe(recipe), args.gemm, formats)
            if why and not args.what_if:
                not_run.append({"recipe": recipe, "preset": preset, "k": K, "reason": why})
                continue
            kw = {} if args.tolerance is None else {"tolerance": args.tolerance}
            progress.step(len(out), len(recipes) * len(presets), f"{recipe} {preset}")
            r = gemm_bias(a.tensor, b.tensor, preset=preset, recipe=recipe, gemm=args.gemm,
                          samples=args.samples, trials=args.trials, seed=args.seed,
                          alpha=args.alpha, what_if=args.what_if, **kw)
            r.evidence["operands"] = (f"A {a.source} ({held[0]} values, {tuple(a.tensor.shape)}), "
                                      f"B {b.source} ({held[1]} values, {tuple(b.tensor.shape)})")
            out.append(r)
    if not out:
        raise InvalidArgument(f"no recipe x preset named here was measured on these operands: "
                              f"{not_run[0]['reason']}; name a recipe that quantises them (e.g. "
                              f"--recipes {TARGET_RECIPE}), or --presets fp32, or add --what-if")
    for r in out:
        r.evidence["not_run"] = not_run
    return out


def _model_results(args, progress):
    from trainprobes.errors import InvalidArgument
    from trainprobes.numerics.gemm_model import judge_model
    from trainprobes.targets import call_target, load_target

    # one preset and one recipe per model table (its rows are keyed by layer and GEMM), and
    # the random operands' options mean nothing here: refused, never dropped without a word
    for flag, value in (("--presets", args.presets), ("--recipes", args.recipes)):
        if value and len(value) > 1:
            raise InvalidArgument(f"--target judges one preset and one recipe per run; {flag} "
                                  f"names {len(value)} ({','.join(value)}): run once per {flag[2:-1]}")
    given = [flag for flag, value in (("--k", args.k), ("--mean", args.mean), ("--rows", args.rows))
             if value is not None] + (["--operands"] if args.operands != "auto" else [])
    if given:
        raise InvalidArgument(f"{', '.join(given)} set(s) the random operands, which --target does "
                              "not use (its operands are the model's own, K from its shapes); drop "
                              f"{'it' if len(given) == 1 else 'them'}")

    factory = load_target(args.target, from_cwd=True)
    made = call_target(factory, args.target, what="the factory (it must return (model, batch))")
    if not (isinstance(made, tuple) and len(made) == 2):
        from trainprobes.errors import TargetError
        raise TargetError(f"--target {args.target}: the factory must return (model, batch), got "
                          f"{type(made).__name__}")
    model, batch = made
    kw = {} if args.tolerance is None else {"tolerance": args.tolerance}
    return judge_model(model, batch, preset=(args.presets or TABLE_PRESETS)[0],
                       recipe=(args.recipes or [TARGET_RECIPE])[0], what_if=args.what_if,
                       samples=args.samples, trials=args.trials, seed=args.seed, alpha=args.alpha,
                       target=args.target, progress=progress.step, **kw)


def _impact(args) -> int:
    from trainprobes.errors import InvalidArgument
    from trainprobes.numerics.gemm_impact import gemm_impact, label

    if args.target or args.load:
        raise InvalidArgument(f"--impact trains its own least-squares model; drop "
                              f"{'--target' if args.target else '--load'} (or --impact to judge "
                              "your own GEMMs)")
    if args.k and len(args.k) != 1:
        raise InvalidArgument(f"--impact takes one --k (the weight gradient's tokens), got {args.k!r}")
    recipes, presets = args.recipes or IMPACT_RECIPES, args.presets or list(TABLE_PRESETS)
    r = gemm_impact(recipes=recipes, presets=presets, tokens=args.k[0] if args.k else 4096,
                    steps=args.steps, mean=1.0 if args.mean is None else args.mean,
                    seed=args.seed, tol=args.loss_tol, what_if=args.what_if)
    emit_report(args, [r])
    if not args.json:
        m = r.metrics
        share = "fp32" in presets
        head = ["recipe"] + list(presets)
        def cell(rec, p):
            if f"loss_gap[{label(rec, p)}]" not in m:
                return "not run"
            gap = m.get(f"accumulator_gap[{label(rec, p)}]")
            return f"{m[f'loss_gap[{label(rec, p)}]']:+.2%}" + (
                f" ({gap:+.2%})" if gap is not None and p != "fp32" else "")
        rows = [head] + [[rec] + [cell(rec, p) for p in presets] for rec in recipes]
        w = [max(len(t[i]) for t in rows) for i in range(len(head))]
        print(f"final-loss gap to fp64 after {m['steps']} SGD steps (least squares, weight "
              f"gradient K={m['tokens']} emulated{'; in brackets the accumulator share: the gap minus fp32' if share else ''})")
        for k, t in enumerate(rows):
            print("  ".join(c.ljust(x) for c, x in zip(t, w)))
            if k == 0:
                print("  ".join("-" * x for x in w))
        for nr in r.evidence["not_run"]:
            print(f"not run: {label(nr['recipe'], nr['preset'])}: {nr['reason']} (--what-if runs it)")
        print(r.message)
    return 1 if r.verdict == "fail" else 0


def _shown(m: dict) -> str:
    """The verdict column: a 'noise' whose CI excludes 0 is a real bias shown to lie within
    the tolerance, which a reader should not mistake for rounding noise."""
    if m["gemm_verdict"] == "noise" and any(m[p + "ci_low"] > 0 or m[p + "ci_high"] < 0
                                            for p in ("", "offset_") if p + "ci_low" in m):
        return "bias<tol"
    return m["gemm_verdict"]


def _needed(m: dict) -> str:
    """The N_C cell: K means none needed, so a biased row whose search did not run (--target
    judges without it) says so instead of K."""
    if m.get("biased") and not m.get("promotion_searched", True):
        return "not searched"
    return f"{m['promote_every_needed']:g}"


def run(args) -> int:
    if (args.a_key or args.b_key) and not args.load:
        from trainprobes.errors import InvalidArgument
        raise InvalidArgument("--a-key/--b-key name tensors in --load files; add --load FILE")
    if args.impact:
        return _impact(args)
    with progress_for(args, "gemm", unit="GEMMs") as p:
        results = (_loaded_results if args.load else _model_results if args.target else
                   _random_results)(args, p)
    emit_report(args, results)
    if not args.json:
        head = ("target", "K", "relative bias", f"{1 - args.alpha / 2:.1%} CI", "offset",
                "offset CI", "max err", "SQNR dB", "growth", "stall K", "N_C needed", "verdict")
        rows = [head]
        for r in results:
            m = r.metrics
            rows.append((r.target, str(m["k"]), f"{m['relative_bias']:+.2e}",
                         f"[{m['ci_low']:+.1e}, {m['ci_high']:+.1e}]", f"{m['relative_offset']:+.2e}",
                         f"[{m['offset_ci_low']:+.1e}, {m['offset_ci_high']:+.1e}]",
                         f"{m['max_relative_error']:.2e}",
                         f"{m['sqnr_db']:.1f}", f"{m['growth_exponent']:.2f}", f"{m['stall_k']:g}",
                         _needed(m), _shown(m)))
        w = [max(len(t[i]) for t in rows) for i in range(len(head))]
        for k, t in enumerate(rows):
            print("  ".join(c.ljust(x) if i in (0, len(head) - 1) else c.rjust(x)
                            for i, (c, x) in enumerate(zip(t, w))))
            if k == 0:
                print("  ".join("-" * x for x in w))
        print("\nrelative bias: sum(sign(ref) (out - ref)) / sum |ref| over the GEMM (estimated from "
              "the weighted sample; < 0: too small); offset: sum(out - ref) / sum |ref| (a shift "
              "whatever the sign, which the bias cancels on zero-mean outputs); each CI at 1 - "
              "alpha/2, and either one can make a GEMM biased; max err: max |out - ref| / rms(ref); growth: exponent of the accumulator's "
              "error in K (~0.5 noise, ~1 bias); N_C needed: fp32 promotion interval that keeps the "
              "bias within tolerance (K: none needed, nan: none found, not searched: a biased GEMM "
              "whose search did not run, as --target judges); bias<tol: a bias whose "
              f"whole CI lies within the tolerance ({results[0].metrics['tolerance']:g}), passed"
              if results else "")
        if results:
            if args.target:
                m0 = results[0].metrics
                print(f"recipe {m0['recipe']} with the {m0['preset']} accumulator")
            print(f"{results[0].evidence['sampling']}")
            for ops in dict.fromkeys(r.evidence["operands"] for r in results if "operands" in r.evidence):
                print(f"operands: {ops}")
            for sk in results[0].evidence.get("skipped", []):
                print(f"not judged: {sk['layer']} {sk['gemm']}: {sk['reason']}")
            for nr in results[0].evidence.get("not_run", []):
                print(f"not run: K={nr['k']} {nr['recipe']} x {nr['preset']}: {nr['reason']} "
                      "(no hardware runs it; --what-if judges it anyway)")
            for r in results:
                if r.metrics.get("what_if"):
                    print(f"WHAT-IF {r.target}: {r.evidence['combination']}")
    if any(r.metrics.get("biased") for r in results):
        return 1
    unjudged = [r.target for r in results if r.metrics.get("gemm_verdict") == "inconclusive"]
    if unjudged:  # fail closed: a sample that cannot rule a bias out never passes
        from trainprobes.errors import CannotJudge
        raise CannotJudge(f"cannot judge {len(unjudged)} GEMM(s) at the tolerance ({', '.join(unjudged[:4])}"
                          f"{', ...' if len(unjudged) > 4 else ''}): their CI holds 0 and reaches past "
                          "it; raise --samples or state a --tolerance")
    return 0
