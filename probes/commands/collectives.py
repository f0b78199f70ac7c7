"""`trainprobes collectives`: a real (or emulated) collective against its emulator and fp64."""
from __future__ import annotations

from trainprobes.commands.choices import ALGORITHMS, COLLECTIVES, DATA, OPS
from trainprobes.commands.options import (
    add_progress_options,
    add_report_options,
    check_dtype,
    emit_report,
    parse_backend,
    parse_dtype,
    progress_for,
)
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_int, parse_choice, parse_int, parse_number

BACKENDS = ("gloo", "nccl", "emulated")
HELP = ("run a real collective (gloo on CPU, nccl on GPU) or an emulated one; report bitwise "
        "agreement with the emulator and the error against the fp64 reference")
_NA = "not applicable: --backend emulated runs no real collective to compare with"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", type=parse_backend(BACKENDS), default="gloo",
                        help="gloo: CPU ranks; nccl: one GPU per rank; emulated: no processes. "
                             "A real backend runs or the command stops with exit 2, never "
                             "falls back to emulation (default: %(default)s)")
    parser.add_argument("--world", type=parse_int("world", min=2, hint="a collective of one "
                                                  "rank moves nothing and passes trivially"),
                        default=4, help="number of ranks (emulated: up to thousands) "
                                        "(default: %(default)s)")
    parser.add_argument("--dtype", type=parse_dtype("dtype"), default="bf16",
                        help="wire dtype, any spelling (fp32, float16, torch.bfloat16, ...); "
                             "gloo: fp64/fp32/fp16/bf16, emulated and nccl also fp8_e4m3fn, "
                             "fp8_e5m2 (default: %(default)s)")
    parser.add_argument("--op", type=parse_choice("op", OPS), default="sum",
                        help="(default: %(default)s)")
    parser.add_argument("--collective", type=parse_choice("collective", COLLECTIVES),
                        default="all_reduce", help="(default: %(default)s)")
    parser.add_argument("--numel", type=parse_int("numel", min=1), default=4096,
                        help="elements per rank (default: %(default)s)")
    parser.add_argument("--data", type=parse_choice("data", list(DATA)), default="normal",
                        help="input distribution: " + "; ".join(f"{k}: {v}" for k, v in DATA.items()))
    parser.add_argument("--seed", type=parse_int("seed", min=0), default=0,
                        help="(default: %(default)s)")
    parser.add_argument("--root", type=parse_int("root", min=0), default=0,
                        help="root rank of reduce (default: 0)")
    # hierarchical and order need ranks_per_node= / order=, which this command cannot pass:
    # offering them only led to an error after every rank had run
    parser.add_argument("--algorithm", default=None, type=parse_choice(
        "algorithm", [a for a in ALGORITHMS if a not in ("hierarchical", "order")]),
                        help="emulator order; default: gloo for --backend gloo, ring otherwise")
    parser.add_argument("--timeout", type=parse_number("timeout", min=0.0, min_open=True),
                        default=120.0, help="seconds before every rank is stopped "
                                            "(default: %(default)s)")
    parser.add_argument("--port", type=parse_int("port", min=1, max=65535), default=None,
                        help="rendezvous port (default: a free one)")
    parser.add_argument("--reveal", action="store_true",
                        help="instead: reveal the backend's per-element order with crafted "
                             "inputs and compare it with trainprobes.reference.gloo's model")
    add_report_options(parser)
    add_progress_options(parser)


def check_backend(args) -> None:
    """An explicitly requested backend runs as asked or the command stops here, naming why:
    never a silent fallback to emulation. A run this machine's memory cannot hold stops here
    too (the fp64 reference and the emulator hold every rank's data in this process)."""
    from trainprobes.budget import NEEDS, check_fits
    from trainprobes.distributed.inputs import DTYPES

    check_fits(NEEDS["emulated_collective"] * args.world * args.numel,
               f"--world {args.world} --numel {args.numel}",
               fix="lower --numel (the bias shows at a few thousand elements per rank) or --world")

    if args.reveal:
        from trainprobes.distributed.reveal import MAX_WORLD, REVEAL_DTYPES
        if args.backend == "emulated":
            raise InvalidArgument("--reveal needs a real backend (--backend gloo or nccl): it "
                                  "reveals the order a real collective adds in")
        check_dtype(args.dtype, "--dtype", allowed=REVEAL_DTYPES,
                    hint="--reveal crafts inputs in these")
        check_int(args.world, "--world", max=MAX_WORLD, hint="--reveal counts ranks in uint8")
    if args.backend == "gloo":
        check_dtype(args.dtype, "--dtype", allowed=list(DTYPES),
                    hint="gloo has no float8 reduction ('Invalid scalar type'); use --backend "
                         "emulated (NCCL's fp8 arithmetic, no processes) or nccl on GPUs")
    if args.backend == "nccl":
        import torch
        n = torch.cuda.device_count()  # parse_backend refused nccl where there is no GPU
        if args.world > n:
            raise InvalidArgument(f"--backend nccl --world {args.world} needs one GPU per rank "
                                  f"and this machine has {n}; pass --world {n} or fewer")


def _progress(args):
    """Progress of the ranks: what they are doing (they report only when done, so the
    estimate is their timeout's bound)."""
    return progress_for(args, f"collectives {args.backend} x{args.world}",
                        limit=args.timeout if args.backend != "emulated" else None)


def _summary(res, args) -> dict:
    m = res.metrics
    return {"backend": m["backend"], "world": m["world"], "dtype": m["dtype"], "op": m["op"],
            "collective": m["collective"], "numel": m["numel"], "data": args.data,
            "seed": res.seed, "algorithm": m["algorithm"],
            "bitwise_match_fraction": m.get("bitwise_match_fraction"),
            "compared": m.get("compared"),
            "max_ulp_error": m["max_ulp_error"], "mean_ulp_error": m["mean_ulp_error"],
            "bias": m["bias"], "bias_z": m["bias_z"], "bias_p": m["bias_p"],
            "bias_relative": m["bias_relative"], "verdict": res.verdict, "codes": res.codes,
            "message": res.message,
            "mismatch_report": res.evidence.get("mismatch_report", ""),
            "note": res.evidence.get("note", "")}


def _human(s: dict) -> str:
    head = (f"{s['backend']} {s['collective']} {s['dtype']} {s['op']}: {s['world']} ranks x "
            f"{s['numel']} elements ({s['data']}, seed {s['seed']})")
    if s["bitwise_match_fraction"] is None:
        bit = f"bitwise match         {_NA}"
    else:
        bit = (f"bitwise match         {100 * s['bitwise_match_fraction']:.4f}% of {s['compared']} "
               f"elements over every rank (emulator algorithm={s['algorithm']!r} vs real)")
    err = (f"vs fp64 reference     max {s['max_ulp_error']:.4g} ulp, mean "
           f"{s['mean_ulp_error']:.4g} ulp, bias {s['bias']:+.4g} ulp (z={s['bias_z']:.3g}, "
           f"p={s['bias_p']:.3g}), relative {s['bias_relative']:+.3g}")
    lines = [head, "  " + bit, "  " + err]
    if s["note"]:
        lines.append("  note: " + s["note"])
    if s["mismatch_report"]:
        lines += ["  " + x for x in s["mismatch_report"].splitlines()]
    lines.append("")
    lines.append(f"{s['verdict'].upper():5} [{', '.join(s['codes']) or 'no codes'}] {s['message']}")
    return "\n".join(lines)


def _reveal(args) -> int:
    from trainprobes.distributed.reveal import reveal_result
    with _progress(args) as p:
        res = reveal_result(backend=args.backend, world=args.world, numel=args.numel,
                            dtype=args.dtype,
                            collective="reduce" if args.collective == "reduce" else "all_reduce",
                            timeout=args.timeout, port=args.port, progress=p.say)
    emit_report(args, [res])
    if not args.json:
        print(res.summary_line())
        for d in res.evidence["first_differences"]:
            print(f"  element {d['index']}: revealed {d['revealed']} model {d['model']}")
    return 1 if res.verdict == "fail" else 0


def run(args) -> int:
    from trainprobes.distributed import run_collective

    check_backend(args)
    if args.reveal:
        return _reveal(args)
    with _progress(args) as p:
        res = run_collective(backend=args.backend, world=args.world, collective=args.collective,
                             dtype=args.dtype, op=args.op, numel=args.numel, data=args.data,
                             seed=args.seed, root=args.root, timeout=args.timeout,
                             port=args.port, algorithm=args.algorithm, progress=p.say)
    emit_report(args, [res])
    if not args.json:
        print(_human(_summary(res, args)))
    return 1 if res.verdict == "fail" else 0
