"""`trainprobes isolation`: packed documents that must not see each other, and outputs that
must not depend on the batch.

  trainprobes isolation documents --hf llama --attn sdpa --convention flattening
  trainprobes isolation documents --target mypkg.model:packed_forward --lengths 10,12,8
  trainprobes isolation table                      # HF families x attention x packing here
  trainprobes isolation batch --target mypkg.ops:my_kernel --shape 8,4096
  trainprobes isolation ops --quick                # this machine's per-op map
  trainprobes isolation vllm tests/data/vllm_tiny_llama.npz
Exit 0 fine, 1 a finding (a leak, a batch-variant target, a control not reproduced; the
per-op map exits 0: it maps the machine), 2 could not run.
"""
from __future__ import annotations

HELP = "packed-document isolation and batch invariance (per op, end to end, vLLM)"
SUBCOMMANDS = ("documents", "table", "batch", "ops", "vllm")


def _ints(metavar: str, min_value: int = 1):
    """`type=` for comma-separated integers >= min_value, checked by check_int."""
    from trainprobes.errors import InvalidArgument
    from trainprobes.validation import check_int, parse_with

    def convert(text):
        return [int(t) for t in text.split(",") if t.strip()]

    def check(values, name):
        if not isinstance(values, list) or not values:
            raise InvalidArgument(f"{name}={values!r} must be comma-separated integers >= "
                                  f"{min_value}, e.g. 2,4,8")
        return [check_int(v, name, min=min_value) for v in values]
    return parse_with(convert, check, metavar)


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _lengths(text: str):
    """'10,12,8' for one row, '10,12/8,14' for two rows."""
    import argparse
    try:
        rows = [[int(n) for n in row.split(",") if n.strip()] for row in text.split("/")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r} must be document lengths like "
                                         f"10,12,8 (rows separated by /: 10,12/8,14)") from None
    return rows[0] if len(rows) == 1 else rows


def _common(p, json_too: bool = True) -> None:
    from trainprobes.commands.options import add_progress_options
    from trainprobes.validation import parse_int
    p.add_argument("--seed", type=parse_int("seed", min=0), default=0, help="seed (0)")
    add_progress_options(p)
    if json_too:
        from trainprobes.commands.options import add_report_options
        add_report_options(p)


def add_arguments(parser) -> None:
    from trainprobes.commands.options import parse_device
    from trainprobes.validation import parse_choice, parse_int, parse_number
    sub = parser.add_subparsers(dest="isolation_command", metavar="SUBCOMMAND", required=True)

    d = sub.add_parser("documents", help="does a packed document's output depend on another's tokens?")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", metavar="PKG.MOD:FN", help="fn(tokens, packing) -> per-token outputs")
    src.add_argument("--make", metavar="PKG.MOD:FN", help="make(seed) -> such a target (e.g. a model)")
    src.add_argument("--hf", metavar="FAMILY", type=parse_choice("--hf", ("llama", "qwen2", "mistral", "qwen2_moe")),
                     help="a tiny random transformers model: llama, qwen2, mistral, qwen2_moe")
    d.add_argument("--attn", default="sdpa", metavar="IMPL",
                   help="with --hf: eager, sdpa, flex_attention, flash_attention_2 (sdpa)")
    d.add_argument("--convention", default="flattening", metavar="NAME",
                   help="with --hf: flattening, flattening_no_cache, mask_4d, mask_4d_bool, "
                        "position_ids_ones_mask")
    d.add_argument("--lengths", default="10,12,8", type=_lengths,
                   help="document lengths of the packed row(s): 10,12,8 or 10,12/8,14 (10,12,8)")
    kind = d.add_mutually_exclusive_group()
    kind.add_argument("--vocab", type=parse_int("--vocab", min=2), help="token ids in [0, V) (128)")
    kind.add_argument("--hidden", type=parse_int("--hidden", min=1), help="float inputs [B, L, D]")
    d.add_argument("--output-key", default=None, metavar="INDEX|NAME",
                   help="which part of the target's output is compared (default: the output)")
    d.add_argument("--batched", action="store_true",
                   help="one call with every perturbed copy (only for batch-isolated targets)")
    twin = d.add_mutually_exclusive_group()
    twin.add_argument("--no-fp64", action="store_true", help="no float64 twin")
    twin.add_argument("--fp64", metavar="PKG.MOD:FN", default=None,
                      help="your float64 twin fn64(tokens, packing), imported like --target")
    d.add_argument("--tokens", metavar="FILE", default=None,
                   help="your own token ids [B, L] (or [L]): a .pt tensor or a .npy array; "
                        "--lengths must sum to L per row")
    d.add_argument("--no-causal", action="store_true", help="skip the within-row causality check")
    _common(d)

    t = sub.add_parser("table", help="the documents probe on tiny HF models: family x attention x packing")
    t.add_argument("--family", type=_names, default=None, help="comma-separated (all)")
    t.add_argument("--attn", type=_names, default=None, help="comma-separated (all available here)")
    t.add_argument("--convention", type=_names, default=None, help="comma-separated (all)")
    t.add_argument("--lengths", default="10,12,8", type=_lengths, help="one packed row (10,12,8)")
    _common(t)

    b = sub.add_parser("batch", help="is a row's output the same bits alone and inside batches?")
    b.add_argument("--target", metavar="PKG.MOD:FN", required=True, help="fn(rows [b, ...]) -> [b, ...]")
    b.add_argument("--shape", type=_ints("--shape"), default=[8, 256],
                   help="random float rows N,D,... drawn from the seed (8,256)")
    b.add_argument("--vocab", type=parse_int("--vocab", min=2), help="token-id rows [N, shape[1]] instead")
    b.add_argument("--inputs", metavar="PKG.MOD:FN", help="make(seed) -> rows [N, ...] instead")
    b.add_argument("--sizes", type=_ints("--sizes", 2), default=None, help="batch sizes (2,3,4,7,8,16,32)")
    b.add_argument("--trials", type=parse_int("--trials", min=1), default=3, help="batches per size (3)")
    b.add_argument("--atol", type=parse_number("--atol", min=0.0), default=0.0, help="tolerance (0: bits)")
    b.add_argument("--output-key", default=None, metavar="INDEX|NAME", help="which part of the output")
    _common(b)

    o = sub.add_parser("ops", help="this machine's per-op batch-invariance map")
    o.add_argument("--ops", type=_names, default=None, help="comma-separated op names (all)")
    o.add_argument("--dtype", type=_names, default=["fp32", "bf16"], help="formats (fp32,bf16)")
    o.add_argument("--sizes", type=_ints("--sizes", 2), default=None, help="batch sizes (2,3,4,7,8,16,32)")
    o.add_argument("--rows", type=parse_int("--rows", min=1), default=8, help="pool rows per op (8)")
    o.add_argument("--device", type=parse_device, default="cpu",
                   help="torch device this machine has: cpu, cuda, cuda:1, mps (cpu)")
    o.add_argument("--quick", action="store_true", help="small shapes only")
    _common(o)

    v = sub.add_parser("vllm", help="judge saved real vLLM output against transformers")
    v.add_argument("file", help=".npz written by scripts/vllm_run.py (tests/data/vllm_tiny_llama.npz)")
    _common(v)


def _picker(s):
    if s is None:
        return None
    return int(s) if s.lstrip("-").isdigit() else s


def run(args) -> int:
    from trainprobes.commands.options import emit_report
    from trainprobes.errors import TrainprobesError
    try:
        results, code = globals()[f"_{args.isolation_command}"](args)
    except ImportError as e:  # transformers, or a target's own dependency, is missing
        raise TrainprobesError(f"isolation {args.isolation_command} cannot run: {e}") from e
    emit_report(args, results, command=f"isolation {args.isolation_command}")
    return code


def _progress(args, unit: str):
    from trainprobes.commands.options import progress_for
    return progress_for(args, f"isolation {args.isolation_command}", unit=unit)


# --- documents ---------------------------------------------------------------------------

def _documents(args):
    import torch
    from trainprobes.isolation import Packing, documents
    from trainprobes.targets import call_target, load_target

    packing = Packing.of(args.lengths)
    if args.hf:
        from trainprobes.isolation.hf import VOCAB, PackedModel, tiny_model
        fn = PackedModel(tiny_model(args.hf, args.attn, seed=args.seed), args.convention)
        name, vocab = f"{args.hf}[{args.attn},{args.convention}]", VOCAB
    else:
        obj = load_target(args.target or args.make, from_cwd=True)
        fn = call_target(obj, args.make, args.seed, what="make(seed)") if args.make else obj
        name, vocab = args.target or args.make, args.vocab or (None if args.hidden else 128)
    g = torch.Generator().manual_seed(args.seed)
    shape = (packing.batch, packing.length)
    if args.tokens:
        x = _load_tokens(args.tokens)
        vocab = vocab if args.vocab or args.hf else int(x.max()) + 1
    else:
        x = torch.randn(*shape, args.hidden, generator=g) if args.hidden else torch.randint(0, vocab, shape, generator=g)
    fp64 = False if args.no_fp64 else load_target(args.fp64, from_cwd=True) if args.fp64 else None
    with _progress(args, "calls") as p:
        r = documents(fn, x, packing, output=_picker(args.output_key), seed=args.seed,
                      vocab=vocab, fp64=fp64, batched=args.batched, causal=not args.no_causal,
                      target=name, progress=p.step)
    if not args.json:
        print(format_documents(r))
    from trainprobes.commands.options import exit_for
    return [r], exit_for([r])


def _load_tokens(path: str):
    """Token ids from a .pt tensor or a .npy array, as long [B, L] (a [L] row gets B = 1)."""
    import torch
    from trainprobes.errors import DataFileError
    try:
        if path.endswith(".npy"):
            import numpy as np
            x = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            x = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - one clear line for any unreadable file
        raise DataFileError(f"--tokens {path!r} cannot be read as a tensor: {type(e).__name__}: {e}") from None
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dim() not in (1, 2):
        raise DataFileError(f"--tokens {path!r} holds {type(x).__name__} "
                            f"{tuple(getattr(x, 'shape', ()))!r}; expected integer token ids [B, L] or [L]")
    return (x[None] if x.dim() == 1 else x).long()


def _said(flag) -> str:
    """A verdict boolean in words: unknown, never None."""
    return {True: "True", False: "False", None: "unknown"}[flag]


def format_documents(r) -> str:
    m, ev = r.metrics, r.evidence
    lines = [r.summary_line(), ""]
    if m.get("deterministic") is False:
        return "\n".join(lines)
    docs = ev["documents"]
    lines.append(f"documents      {len(docs)} (lengths {ev['lengths']}), seed {r.seed}")
    lines.append(f"isolated       {_said(m['isolated'])}  (structural {m['n_leaks']}, numerical "
                 f"{m['n_numerical']} excused, unverified {m['n_unverified']})")
    lines.append("causal         not checked (--no-causal)" if m["causal"] is None
                 and not m["causality_evaluations"] else
                 f"causal         {_said(m['causal'])}  (causality probe: "
                 f"{m['causality_evaluations']} evaluations)")
    budget = "batched: 2" if m.get("batched") else f"d + 2 = {len(docs) + 2}"
    lines.append(f"evaluations    {m['n_evaluations']} ({budget}); fp64 twin "
                 f"{m['n_fp64_evaluations']}, {m['fp64']}")
    if ev.get("batched_fallback"):
        lines.append(f"               batched call not used: {ev['batched_fallback']}")
    lines.append("")
    lines.append("largest change of each document's outputs (rows: perturbed document, columns: affected)")
    lines.append("        " + "".join(f"{j:>11}" for j in range(len(docs))))
    for i, row in enumerate(ev["leak_max"]):
        cells = []
        for j, v in enumerate(row):
            k = ev["leak_kind"][i][j]
            mark = "" if i == j or k is None else {"structural": " L", "numerical": " n",
                                                    "unverified": " ?"}.get(k, "")
            cells.append(f"{v:9.3g}{mark:2}")
        lines.append(f"  doc {i:<2}" + "".join(cells))
    lines.append("  (diagonal: the document itself; L leak, n rounding noise, ? unverified)")
    return "\n".join(lines)


# --- table -------------------------------------------------------------------------------

def _table(args):
    from trainprobes.isolation.hf import CONVENTIONS, FAMILIES, packed_table
    from trainprobes.validation import check_choice
    fams = args.family or list(FAMILIES)
    for f in fams:
        check_choice(f, "--family", FAMILIES)
    convs = args.convention or list(CONVENTIONS)
    for c in convs:
        check_choice(c, "--convention", CONVENTIONS)
    with _progress(args, "cases") as p:
        rows = packed_table(fams, args.attn, convs, lengths=tuple(args.lengths), seed=args.seed,
                            progress=p.step)
    agree = [table_agrees(row) for row in rows]
    if not args.json:
        print(format_table(rows))
        print(f"\n{sum(agree)}/{len(rows)} verdicts agree with perturbation by hand")
    return [row.result for row in rows], 0 if all(agree) else 1


BY_HAND_LEAK = 1e-4  # logits moving by more than this when another document changes: a leak


def table_agrees(row) -> bool:
    """The probe's verdict against the hand check (change document 0, watch the later ones;
    changes below 1e-4 are rounding noise of fp32 logits): a backward-only leak is beyond
    the hand check, so a leak verdict agrees when the hand check or a backward leak shows it."""
    iso = row.result.metrics.get("isolated")
    if row.by_hand > BY_HAND_LEAK:
        return iso is False
    backward = any(lk["kind"] == "structural" and lk["direction"] != "forward"
                   for lk in row.result.evidence.get("leaks", []))
    return iso is True or (iso is False and backward)


def format_table(rows) -> str:
    head = f"{'family':10} {'attention':15} {'convention':22} {'verdict':8} {'isolated':8} " \
           f"{'leaks':>5} {'noise':>5} {'max leak':>9} {'by hand':>9} {'evals':>5}  agrees"
    out = [head, "-" * len(head)]
    for row in rows:
        m = row.result.metrics
        out.append(f"{row.family:10} {row.implementation:15} {row.convention:22} "
                   f"{row.result.verdict:8} {_said(m['isolated']):8} {m['n_leaks']:5d} "
                   f"{m['n_numerical']:5d} {m['max_leak']:9.3g} {row.by_hand:9.3g} "
                   f"{m['n_evaluations']:5d}  {'yes' if table_agrees(row) else 'NO'}")
    from trainprobes.isolation.hf import CONVENTION_NOTES
    leaked = dict.fromkeys(r.convention for r in rows if r.result.metrics.get("isolated") is False)
    notes = [f"  {c}: {CONVENTION_NOTES[c]}" for c in leaked if c in CONVENTION_NOTES]
    if notes:
        out += ["", "why these leak, and what to pass instead:", *notes]
    return "\n".join(out)


# --- batch and ops -------------------------------------------------------------------------

def _batch(args):
    import torch
    from trainprobes.isolation import batch_invariance
    from trainprobes.isolation.batch import DEFAULT_SIZES
    from trainprobes.targets import call_target, load_target

    fn = load_target(args.target, from_cwd=True)
    g = torch.Generator().manual_seed(args.seed)
    if args.inputs:
        x = call_target(load_target(args.inputs, from_cwd=True), args.inputs, args.seed,
                        what="inputs(seed)")
    elif args.vocab:
        x = torch.randint(0, args.vocab, tuple(args.shape[:2]), generator=g)
    else:
        x = torch.randn(*args.shape, generator=g)
    with _progress(args, "calls") as p:
        r = batch_invariance(fn, x, sizes=args.sizes or DEFAULT_SIZES, trials=args.trials,
                             seed=args.seed, output=_picker(args.output_key), atol=args.atol,
                             target=args.target, progress=p.step)
    if not args.json:
        print(r.summary_line())
        print(format_sizes(r))
    from trainprobes.commands.options import exit_for
    return [r], exit_for([r])


def format_sizes(r) -> str:
    lines = [f"  {'batch':>5} {'rows':>5} {'differ':>6} {'outputs differ':>14} {'max |diff|':>10} {'max ulps':>9}"]
    for s in r.evidence.get("by_size", []):
        lines.append(f"  {s['size']:5d} {s['rows']:5d} {s['rows_differ']:6d} "
                     f"{s['frac_outputs_differ']:14.2%} {s['max_abs_diff']:10.3g} {s['max_ulps']:9.3g}")
    return "\n".join(lines)


def _ops(args):
    from trainprobes.isolation.batch import DEFAULT_SIZES
    from trainprobes.isolation.ops import op_map
    with _progress(args, "ops") as p:
        results = op_map(args.ops, dtypes=args.dtype, sizes=args.sizes or DEFAULT_SIZES, rows=args.rows,
                         seed=args.seed, device=args.device, quick=args.quick, progress=p.step)
    if not args.json:
        print(format_ops(results))
    return results, 0


def format_ops(results) -> str:
    import torch
    head = f"{'op':30} {'shape':18} {'dtype':5} {'invariant':9} {'breaks at batch':22} {'max |diff|':>10} {'max ulps':>8}"
    out = [f"torch {torch.__version__}, device {results[0].evidence['device'] if results else '?'}",
           head, "-" * len(head)]
    for r in results:
        ev, m = r.evidence, r.metrics
        out.append(f"{ev['op']:30} {ev['shape']:18} {ev['dtype']:5} {_said(m['batch_invariant']):9} "
                   f"{','.join(map(str, m['breaking_sizes'])) or '-':22} {m['max_abs_diff']:10.3g} "
                   f"{m['max_ulps']:8.3g}")
    return "\n".join(out)


# --- vllm --------------------------------------------------------------------------------

def _vllm(args):
    from trainprobes.isolation.vllm_sample import batch_invariance_figures, judge, load_sample
    sample = load_sample(args.file)
    model = sample.model()
    results, ok = [], True
    rows = []
    for name, case in sample.cases.items():
        for temp in sorted({1.0, case.temperature}):
            r = judge(sample, name, temperature=temp, model=model)
            want = expected_drift(case, temp)
            # a control: its drift verdict is known from the mechanism
            r.evidence["expected_drift"] = list(want)
            r.expected = "fail" if want == ("biased",) else "pass"
            good = r.metrics["drift_verdict"] in want
            ok &= good
            results.append(r)
            rows.append((name, temp, r, want, good))
    if not args.json:
        print(f"vLLM {sample.versions.get('vllm', '?')} (torch {sample.versions.get('torch', '?')}) vs "
              f"transformers fp32 here; {sample.path}")
        print(f"{'case':22} {'trainer T':>9} {'verdict':12} {'expected':18} {'mean log-ratio':>15} "
              f"{'std':>9} {'max |x|':>8}  ok")
        for name, temp, r, want, good in rows:
            m = r.metrics
            print(f"{name:22} {temp:9g} {m['drift_verdict']:12} {'/'.join(want):18} "
                  f"{m['mean_log_ratio']:+15.3g} {m['std_log_ratio']:9.3g} {m['max_abs_log_ratio']:8.3g}"
                  f"  {'yes' if good else 'NO'}")
        for label in sample.batch:
            f = batch_invariance_figures(sample, label)
            print(f"batch invariance ({label} model): {f['prompts_bitwise_equal']}/{f['prompts']} prompts "
                  f"bit for bit alone vs in one batch of {f['prompts']}; {f['tokens_differ']} of "
                  f"{f['tokens_compared']} log-probs differ (max {f['max_abs_diff']:.3g}); greedy tokens "
                  f"diverge in {f['prompts_diverging_tokens']} prompts")
    return results, 0 if ok else 1


def expected_drift(case, trainer_temperature: float) -> tuple:
    """What the mechanism predicts: the trainer's temperature must be the one vLLM's log-probs
    describe (1 for raw_logprobs, the sampling temperature for processed_logprobs), else the
    distributions differ (biased); fp32 both sides: clean (or noise-level); bf16 sampling vs
    an fp32 trainer: noisy."""
    described = case.temperature if case.logprobs_mode.startswith("processed") else 1.0
    if abs(described - trainer_temperature) > 1e-9:
        return ("biased",)
    return ("clean", "noisy") if case.dtype == "float32" else ("noisy",)
