"""`trainprobes drift localize`: which stage, op, expert choice, weight or log-prob
convention makes the trainer and the engine disagree (trainprobes.drift.decompose)."""
from __future__ import annotations

from trainprobes.commands.options import (
    add_alpha_option,
    add_int_options,
    add_progress_options,
    add_report_options,
    emit_report,
    progress_for,
    write_announced,
)
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.validation import parse_number

HELP = "localise train/inference drift: first stage and op beyond noise, weights, routing, semantics"


def add_arguments(p) -> None:
    src = p.add_argument_group("inputs (one of)")
    src.add_argument("--demo", action="store_true",
                     help="tiny HF engine pairs with injected faults (bf16 MLP, norm epsilon, stale "
                          "weight, bf16 router, temperature twice, top-p log-probs), identical and "
                          "eager-vs-sdpa controls: each must be found at its stage, op and kind")
    src.add_argument("--target", metavar="pkg.mod:factory",
                     help="the trainer: a callable returning an nn.Module (HF causal LM) or a "
                          "trainprobes.drift.engines.Engine")
    src.add_argument("--engine", metavar="pkg.mod:factory", help="the inference engine, likewise")
    src.add_argument("--pair", metavar="pkg.mod:factory",
                     help="instead of --target/--engine: a callable returning (trainer, engine), each an "
                          "nn.Module or an Engine, built together (a pair sharing weights, a tokenizer or "
                          "a process group is built once, with no module-level cache)")
    src.add_argument("--dumps", nargs=2, metavar=("TRAINER", "ENGINE"),
                     help="two per-stage dumps (.safetensors, docs/drift.md 'Dump format'): the first "
                          "divergent stage from free-running streams")
    src.add_argument("--noise-dump", metavar="FILE",
                     help="with --dumps: the trainer re-run in another batch composition (a measured floor)")
    opt = p.add_argument_group("options")
    opt.add_argument("--tokens", metavar="FILE",
                     help="with --target/--engine: .safetensors/.npz holding input_ids [B, L] (and "
                          "attention_mask); default: random ids from --seed")
    opt.add_argument("--tokenizer", metavar="DIR",
                     help="a local HF tokenizer (save_pretrained dir) to name the heaviest tokens")
    add_int_options(opt, ("--sequences", 8, 1, "random token sequences without --tokens (fewer than 4: each cut into spans of tokens)"),
                    ("--length", 24, 2, "random sequence length without --tokens"),
                    ("--seed", 0, 0, "seed (tokens, jitter)"))
    opt.add_argument("--margin", type=parse_number("margin", min=1.0), default=8.0,
                     help="a stage is beyond noise when its own error exceeds margin x its noise floor "
                          "(default 8)")
    add_alpha_option(opt, "the per-stage test, Bonferroni over stages")
    opt.add_argument("--unit-roundoff", type=parse_number("unit_roundoff", min=0.0, max=1.0, min_open=True,
                                                          max_open=True), default=None, metavar="U",
                     help="the unit roundoff of the engines' nominal precision (default: from the coarser "
                          "engine's parameter dtype; needed for a dtype without a known floor, e.g. fp8)")
    out = p.add_argument_group("output")
    add_report_options(out)
    add_progress_options(out)
    out.add_argument("--plot", metavar="PNG",
                     help="per-stage plot: free-running and own error, log scale, noise floor band")


def _build(spec: str, role: str):
    from trainprobes.targets import call_target, load_target

    label = "engine" if role == "engine" else "target"
    obj = call_target(load_target(spec, from_cwd=True, label=label), spec, what="the factory",
                      label=label)
    return _as_engine(obj, spec, role)


def _build_pair(spec: str) -> tuple:
    """(trainer, engine) from one factory that builds both (--pair)."""
    from trainprobes.targets import call_target, load_target

    obj = call_target(load_target(spec, from_cwd=True, label="pair"), spec, what="the factory", label="pair")
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise TargetError(f"--pair {spec!r} returned {_what(obj)}; expected a (trainer, engine) pair, "
                          "each an nn.Module or a trainprobes Engine")
    return _as_engine(obj[0], spec, "trainer", "pair[0]"), _as_engine(obj[1], spec, "engine", "pair[1]")


def _what(obj) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _as_engine(obj, spec: str, role: str, where: str | None = None):
    from trainprobes.drift.engines import Engine
    if isinstance(obj, Engine):
        obj.name = obj.name if obj.name != "engine" else role
        return obj
    import torch
    if not isinstance(obj, torch.nn.Module):
        option = f"--pair {spec!r}: {where} is" if where else \
            f"--{role if role == 'engine' else 'target'} {spec!r} returned"
        raise TargetError(f"{option} a {type(obj).__name__}; expected an nn.Module or a trainprobes Engine")
    return Engine(obj.eval(), name=role)


ESTIMATED_FORWARDS = 10


def _tokens(args, engine):
    import torch
    if args.tokens:
        return _read_tokens(args.tokens)
    from trainprobes.drift.localize import vocab_size
    vocab = vocab_size(engine.module)
    if vocab is None:
        raise InvalidArgument("the engine has neither config.vocab_size nor an nn.Embedding to draw random "
                              "tokens from: pass --tokens FILE")
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (args.sequences, args.length), generator=g), None


def _read_tokens(path):
    import zipfile
    import zlib

    import numpy as np
    import torch
    from trainprobes.errors import DataFileError
    p = str(path)
    try:
        if p.endswith(".safetensors"):
            import safetensors.torch as st
            t = st.load_file(p)
        elif p.endswith(".npz"):
            with np.load(p, allow_pickle=False) as z:
                t = {k: torch.from_numpy(z[k]) for k in z.files}
        else:
            raise DataFileError(f"--tokens {p!r}: expected a .safetensors or .npz file")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DataFileError(f"--tokens {p!r} cannot be read ({type(e).__name__}: {e})") from None
    if "input_ids" not in t:
        raise DataFileError(f"--tokens {p!r} has no 'input_ids' (has {sorted(t)})")
    ids = t["input_ids"].long()
    if ids.ndim != 2:
        raise DataFileError(f"--tokens {p!r}: input_ids has shape {tuple(ids.shape)}, expected [B, L]")
    am = t.get("attention_mask")
    if am is not None and am.shape != ids.shape:
        raise DataFileError(f"--tokens {p!r}: attention_mask has shape {tuple(am.shape)}, expected "
                            f"{tuple(ids.shape)} like input_ids")
    return ids, am


def _results(args) -> list:
    given = [k for k in ("demo", "target", "engine", "pair", "dumps") if getattr(args, k)]
    if args.demo:
        if len(given) > 1:
            raise InvalidArgument("--demo runs its own engine pairs: it takes no --target/--engine/--pair/--dumps")
        from trainprobes.drift.localize_demo import run_demo

        with progress_for(args, "drift localize --demo", unit="cases") as p:
            return run_demo(progress=p.step, margin=args.margin, alpha=args.alpha, seed=args.seed)
    if args.dumps:
        if args.target or args.engine or args.pair:
            raise InvalidArgument("give --dumps TRAINER ENGINE alone, or --target and --engine, or --pair")
        return [_dump_result(args)]
    if args.pair and (args.target or args.engine):
        raise InvalidArgument("--pair builds both engines: give it alone, or --target and --engine")
    if not args.pair and not (args.target and args.engine):
        raise InvalidArgument("give --target pkg.mod:factory and --engine pkg.mod:factory, or --pair "
                              "pkg.mod:factory, or --dumps TRAINER ENGINE, or --demo"
                              + (f" (only --{given[0]} was given)" if given else ""))
    from trainprobes.drift.decompose import localize

    if args.pair:
        trainer, engine = _build_pair(args.pair)
    else:
        trainer, engine = _build(args.target, "trainer"), _build(args.engine, "engine")
    ids, am = _tokens(args, engine)
    tokenizer = None
    if args.tokenizer:
        from trainprobes.drift.adapters import _require
        tokenizer = _require("transformers", "'trainprobes[hf]'").AutoTokenizer.from_pretrained(
            args.tokenizer, local_files_only=True)
    # about ten forwards of the pair's model: six to the stage, a few for the op and the parts
    with progress_for(args, "drift localize", ESTIMATED_FORWARDS, unit="forwards") as p:
        def step(done, what):
            p.step(min(round(done), ESTIMATED_FORWARDS - 1), ESTIMATED_FORWARDS, what)
        return [localize(trainer, engine, ids, am, margin=args.margin, alpha=args.alpha, seed=args.seed,
                         target=args.pair or f"{args.target} vs {args.engine}", tokenizer=tokenizer, u=args.unit_roundoff,
                         progress=step)]


def _dump_result(args):
    from trainprobes.drift.dumps import compare_dumps, dump_routing, load_dump
    from trainprobes.drift.stage_plot import stage_plot
    from trainprobes.result import Result

    a, b = (load_dump(p) for p in args.dumps)
    noise = load_dump(args.noise_dump) if args.noise_dump else None
    rows = compare_dumps(a, b, noise, margin=args.margin)
    first = next((r for r in rows if r.divergent), None)
    metrics = {"engines_agree": first is None, "kind": "noise" if first is None else "numeric",
               "first_layer": first.name if first else "", "op": "", "op_module": "",
               "margin": args.margin, "n_tokens": int((a.mask & b.mask).sum())}
    for r in rows:
        metrics[f"free_error[{r.name}]"] = r.free_error
        metrics[f"noise_floor[{r.name}]"] = r.noise_floor
    flips = dump_routing(a, b)
    for name, f in flips.items():
        metrics[f"routing_mismatch[{name}]"] = f
    if a.logprobs is not None and b.logprobs is not None:
        m = (a.mask & b.mask)[:, 1:] & (a.mask & b.mask)[:, :-1]
        metrics["max_abs_log_ratio"] = (b.logprobs - a.logprobs)[m].abs().max().item() if bool(m.any()) else 0.0
    msg = (f"no stage diverges beyond {args.margin:g}x its floor" if first is None else
           f"first divergent stage {first.name}: free error {first.free_error:.3g} > {args.margin:g} x "
           f"floor {first.noise_floor:.3g} (from dumps: the op needs the modules)")
    if any(flips.values()):
        msg += "; top-k expert sets differ at " + ", ".join(f"{n} {f:.1%}" for n, f in flips.items() if f)
    target = f"{args.dumps[0]} vs {args.dumps[1]}"
    stages = [dict(r.__dict__, own_error=None) for r in rows]
    return Result(probe="drift.localize", target=target, verdict="pass" if first is None else "fail",
                  metrics=metrics, seed=None, codes=[] if first is None else ["TP-D4"], message=msg,
                  evidence={"stages": stages, "from": "dumps",
                            "residual_convention": {"trainer": a.convention, "engine": b.convention},
                            "plots": [stage_plot(stages, args.margin, f"{metrics['kind']}: {target}")]})


def render(results) -> str:
    lines = []
    for r in results:
        m = r.metrics
        lines.append(f"{m['kind'].upper():<16} {r.summary_line()}")
        expect = r.evidence.get("expect")
        if expect:
            from trainprobes.drift.localize_demo import reproduced
            lines.append(f"    expected {expect['kind']} at {expect['first_layer'] or '-'} / {expect['op'] or '-'}: "
                         f"{'yes' if reproduced(r) else 'NO'}")
        for s in r.evidence.get("stages", []):
            own = s.get("own_error")
            unit = "  (nats)" if s.get("role") == "logprobs" else ""  # the other rows: relative errors
            lines.append(f"    {s['name']:<28} own {'-' if own is None else f'{own:.3g}':>9}  free "
                         f"{s['free_error']:.3g}  floor {s['noise_floor']:.3g}  {s.get('verdict', '')}{unit}"
                         .rstrip())
        for o in r.evidence.get("ops", []):
            if o["verdict"] == "beyond":
                lines.append(f"      op {o['name']:<34} {o['role']:<9} own {o['own_error']:.3g}  floor "
                             f"{o['noise_floor']:.3g}  x{o['ratio']:.3g}")
        lines.append("")
    return "\n".join(lines)


PLOT_COLUMNS = 3  # the demo's 15 cases as a 3 x 5 grid, not one strip of 15


def plot(results, path, *, replace: bool = True) -> None:
    """Each Result's per-stage plot (its evidence["plots"], trainprobes.drift.stage_plot, the
    picture the HTML report draws), in a grid of PLOT_COLUMNS in result order."""
    from trainprobes.report.plots import have_matplotlib, png_sheet
    from trainprobes.result import write_atomic
    if not have_matplotlib():
        raise InvalidArgument("--plot needs matplotlib: pip install 'trainprobes[plots]'")
    specs = [r.evidence["plots"][0] for r in results if r.evidence.get("plots")]
    write_atomic(path, png_sheet([specs[i:i + PLOT_COLUMNS] for i in range(0, len(specs), PLOT_COLUMNS)]),
                 replace=replace)


def refusal_document(args, exc: BaseException) -> str:
    """The report shape with no results and why (`refused`: the exit code the contract gives
    the exception, its type and message): `--json` always prints one JSON document."""
    from trainprobes.commands.options import options_of
    from trainprobes.exits import classify
    from trainprobes.result import dumps_report
    return dumps_report([], command=args.command, options=options_of(args),
                        refused={"exit_code": classify(exc), "error": type(exc).__name__,
                                 "message": str(exc) or type(exc).__name__})


def usage_document(message: str) -> str:
    """refusal_document for a command line that did not parse (no options to report)."""
    from trainprobes.exits import USAGE
    from trainprobes.result import dumps_report
    return dumps_report([], command="drift", options={"drift_mode": "localize"},
                        refused={"exit_code": USAGE, "error": "UsageError", "message": message})


def run(args) -> int:
    try:
        results = _results(args)
        if args.plot:
            write_announced(args.plot, lambda p: plot(results, p, replace=args.force), "plot")
    except (Exception, KeyboardInterrupt) as e:  # --json: a refusal is a document too, then exits as ever
        if args.json and not isinstance(e, KeyboardInterrupt):
            print(refusal_document(args, e))
        raise
    emit_report(args, results)
    if not args.json:
        print(render(results))
    if args.demo:  # the demo succeeds when every control is found where it was injected
        from trainprobes.drift.localize_demo import reproduced
        return 0 if all(reproduced(r) for r in results) else 1
    return 0 if all(r.passed for r in results) else 1
