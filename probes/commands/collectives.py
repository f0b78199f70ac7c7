"""`trainprobes collectives`: a real (or emulated) collective against its emulator and fp64."""
from __future__ import annotations

import json
import sys

HELP = ("run a real collective (gloo on CPU, nccl on GPU) or an emulated one; report bitwise "
        "agreement with the emulator and the error against the fp64 reference")
_NA = "not applicable: --backend emulated runs no real collective to compare with"


def add_arguments(parser) -> None:
    from trainprobes.distributed.inputs import DATA
    from trainprobes.distributed.worker import COLLECTIVES, OPS
    from trainprobes.reference.schedules import ALGORITHMS

    parser.add_argument("--backend", choices=("gloo", "nccl", "emulated"), default="gloo",
                        help="gloo: CPU ranks; nccl: one GPU per rank; emulated: no processes "
                             "(default: %(default)s)")
    parser.add_argument("--world", type=int, default=4,
                        help="number of ranks (emulated: up to thousands) (default: %(default)s)")
    parser.add_argument("--dtype", default="bf16",
                        help="wire dtype: fp32, fp16, bf16 (emulated and nccl: also fp8_e4m3fn, "
                             "fp8_e5m2, ...) (default: %(default)s)")
    parser.add_argument("--op", choices=OPS, default="sum", help="(default: %(default)s)")
    parser.add_argument("--collective", choices=COLLECTIVES, default="all_reduce",
                        help="(default: %(default)s)")
    parser.add_argument("--numel", type=int, default=4096,
                        help="elements per rank (default: %(default)s)")
    parser.add_argument("--data", choices=list(DATA), default="normal",
                        help="input distribution: " + "; ".join(f"{k}: {v}" for k, v in DATA.items()))
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--root", type=int, default=0, help="root rank of reduce (default: 0)")
    # hierarchical and order need ranks_per_node= / order=, which this command cannot pass:
    # offering them only led to an error after every rank had run
    parser.add_argument("--algorithm", choices=[a for a in ALGORITHMS if a not in ("hierarchical", "order")],
                        default=None,
                        help="emulator order; default: gloo for --backend gloo, ring otherwise")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before every rank is stopped (default: %(default)s)")
    parser.add_argument("--port", type=int, default=None,
                        help="rendezvous port (default: a free one)")
    parser.add_argument("--reveal", action="store_true",
                        help="instead: reveal the backend's per-element order with crafted "
                             "inputs and compare it with trainprobes.reference.gloo's model")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _progress(args):
    if args.json:
        return None
    return lambda line: print(f"  .. {line}", file=sys.stderr, flush=True)


def _summary(res, args) -> dict:
    m = res.metrics
    return {"backend": m["backend"], "world": m["world"], "dtype": m["dtype"], "op": m["op"],
            "collective": m["collective"], "numel": m["numel"], "data": args.data,
            "seed": res.seed, "algorithm": m["algorithm"],
            "bitwise_match_fraction": m.get("bitwise_match_fraction"),
            **({"bitwise_match": _NA} if "bitwise_match_fraction" not in m else {}),
            "mismatched": m.get("mismatched"),
            "max_ulp_error": m["max_ulp_error"], "mean_ulp_error": m["mean_ulp_error"],
            "bias": m["bias"], "bias_z": m["bias_z"], "bias_p": m["bias_p"],
            "bias_relative": m["bias_relative"], "verdict": res.verdict, "codes": res.codes,
            "message": res.message,
            "mismatch_report": res.evidence.get("mismatch_report", ""),
            "note": res.evidence.get("note", ""), "result": res.to_dict()}


def _human(s: dict) -> str:
    head = (f"{s['backend']} {s['collective']} {s['dtype']} {s['op']}: {s['world']} ranks x "
            f"{s['numel']} elements ({s['data']}, seed {s['seed']})")
    if s["bitwise_match_fraction"] is None:
        bit = f"bitwise match         {_NA}"
    else:
        n = s["result"]["metrics"]["compared"]
        bit = (f"bitwise match         {100 * s['bitwise_match_fraction']:.4f}% of {n} elements "
               f"over every rank (emulator algorithm={s['algorithm']!r} vs real)")
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
    dtype = args.dtype if args.dtype in ("fp32", "fp16", "bf16", "fp64") else "fp32"
    res = reveal_result(backend=args.backend, world=args.world, numel=args.numel, dtype=dtype,
                        collective="reduce" if args.collective == "reduce" else "all_reduce",
                        timeout=args.timeout, port=args.port, progress=_progress(args))
    if args.json:
        print(json.dumps({**res.metrics, "verdict": res.verdict, "codes": res.codes,
                          "message": res.message, "result": res.to_dict()}, indent=2))
    else:
        print(res.summary_line())
        for d in res.evidence["first_differences"]:
            print(f"  element {d['index']}: revealed {d['revealed']} model {d['model']}")
    return 1 if res.verdict == "fail" else 0


def run(args) -> int:
    from trainprobes.distributed import LaunchError, run_collective
    from trainprobes.result import to_jsonable

    try:
        if args.reveal:
            if args.backend == "emulated":
                print("error: --reveal needs a real backend (--backend gloo or nccl)",
                      file=sys.stderr)
                return 2
            return _reveal(args)
        res = run_collective(backend=args.backend, world=args.world, collective=args.collective,
                             dtype=args.dtype, op=args.op, numel=args.numel, data=args.data,
                             seed=args.seed, root=args.root, timeout=args.timeout,
                             port=args.port, algorithm=args.algorithm, progress=_progress(args))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"error: the distributed run failed: {e}", file=sys.stderr)
        return 2
    s = _summary(res, args)
    print(json.dumps(to_jsonable(s), indent=2) if args.json else _human(s))
    return 1 if res.verdict == "fail" else 0
