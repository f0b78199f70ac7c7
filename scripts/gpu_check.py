"""Every GPU check of trainprobes in one short run; writes a JSON report. Called by
scripts/gpu-check.sh.

1. NCCL: the distributed runner with backend nccl on world 1 (and on every visible GPU
   when there are more): all_reduce / reduce_scatter / all_gather / reduce in fp32, fp16,
   bf16, sum and avg, compared bit for bit with the emulator (NCCL ring model) and with
   fp64; fp8 all_reduce where NCCL takes it; the order revealed from crafted inputs when
   there are 3 or more GPUs.
2. Parallel transforms under NCCL (trainprobes.transforms): the demo step under DDP (plain,
   fp16 and bf16 compression hooks), gradient accumulation (token-weighted and mean of
   micro-batch means, which is biased), FSDP2 (fp32; bf16 params and reduction), and with
   2+ GPUs tensor, sequence and 1F1B pipeline parallelism and the zoo of published bugs
   beside their fixed twins; one rank per GPU (NCCL refuses two ranks on one GPU, so one
   GPU runs world 1). Under NCCL, FSDP2's bf16 ReduceOp.AVG is PreMulSum with bf16(1/n):
   biased for n not a power of two, which the probe should call biased.
3. Accumulator reveal on GPU kernels (trainprobes.numerics.reveal, device="cuda"): torch.matmul
   in fp16 and bf16 with allow_fp16/bf16_reduced_precision_reduction off and on, and fp8
   torch._scaled_mm where the GPU has it (sm89+).
4. Causality (trainprobes.causality) on CUDA tensors: every reference router, both modes,
   every cut, its known verdict.
5. Isolation (trainprobes.isolation): the per-op batch-invariance map on the GPU and the
   packed-document table with flash_attention_2 (where flash_attn is installed) beside sdpa.
6. fp8 torch._scaled_mm outputs on crafted inputs (trainprobes.numerics.gemm_pin), saved to
   tests/data/scaled_mm_outputs.json (a few KB; --force replaces an existing file) with the
   accumulator presets that match them bit for bit: commit it, and tests/test_gemm_pin.py
   pins the presets to this hardware on every CPU run.
Without CUDA it exits 2 and says so: nothing is checked, nothing passes. --allow-cpu runs
the same code paths on the CPU (gloo, device="cpu") to check the script itself; that
report says "cpu_dry_run": it is not a GPU check.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _check(report: dict, name: str, fn) -> None:
    """Run one check; record its figures, or its error (which fails the run)."""
    t = time.perf_counter()
    try:
        report["checks"][name] = {"status": "ok", **fn()}
    except Exception as e:  # noqa: BLE001 - a failed check is recorded and fails the run
        report["checks"][name] = {"status": "error", "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()}
    report["checks"][name]["seconds"] = round(time.perf_counter() - t, 2)
    print(f"[{report['checks'][name]['status']:5}] {name} "
          f"({report['checks'][name]['seconds']}s)", flush=True)


def nccl_checks(report: dict, backend: str, worlds: list[int]) -> None:
    from trainprobes.distributed import Case, run_collectives
    from trainprobes.distributed.reveal import reveal_result

    for world in worlds:
        def collectives(world=world):
            cases = [Case(c, dt, op, n, "normal", seed=1)
                     for c in ("all_reduce", "reduce_scatter", "all_gather", "reduce")
                     for dt in ("fp32", "fp16", "bf16") for op in ("sum", "avg")
                     for n in (world * 1024, world * 65536)]
            res = run_collectives(cases, backend=backend, world=world, timeout=120)
            rows = [{"case": r.target, **{k: r.metrics[k] for k in (
                "bitwise_match_fraction", "max_ulp_error", "bias", "bias_p")},
                "verdict": r.verdict, "codes": r.codes} for r in res]
            return {"world": world, "cases": rows,
                    "all_bitwise": all(x["bitwise_match_fraction"] == 1.0 for x in rows)}
        _check(report, f"{backend}_collectives_world{world}", collectives)

        def fp8(world=world):
            if backend != "nccl":
                return {"skipped": "gloo has no float8 reduction"}
            from trainprobes.distributed import WorkerFailed
            case = Case("all_reduce", "fp8_e4m3fn", "sum", world * 1024, "normal", seed=2)
            try:
                r = run_collectives([case], backend=backend, world=world, timeout=120)[0]
            except WorkerFailed as e:  # an NCCL/torch build without fp8 reductions says so
                if any(w in e.traceback.lower() for w in ("float8", "unsupported", "not supported")):
                    return {"unsupported": e.traceback.strip().splitlines()[-1]}
                raise
            return {"case": r.target, **{k: r.metrics[k] for k in (
                "bitwise_match_fraction", "max_ulp_error", "bias")}}
        _check(report, f"{backend}_fp8_world{world}", fp8)

        if world >= 3:
            _check(report, f"{backend}_order_reveal_world{world}", lambda world=world: reveal_result(
                backend=backend, world=world, numel=4096, dtype="fp32", timeout=120).to_dict())


def transform_checks(report: dict, backend: str, world: int) -> None:
    from trainprobes.transforms import DDP, FSDP2, Accumulation, Pipeline, Probe, TensorParallel, run_probes
    from trainprobes.transforms.demo import SP_PLAN, TP_PLAN, step

    def builtins():
        bf16_fsdp = FSDP2(param_dtype="bf16", reduce_dtype="bf16")
        transforms = [DDP(), DDP(hook="fp16"), DDP(hook="bf16"), Accumulation(),
                      Accumulation(normalization="mean-of-means"), FSDP2(), bf16_fsdp]
        if world >= 2:
            transforms += [TensorParallel(plan=TP_PLAN), TensorParallel(plan=SP_PLAN), Pipeline()]
        # 96 trials for FSDP2's bf16 reduction: its NCCL PreMulSum bias (+0.195% at world 3)
        # sits below what 16 trials resolve in bf16 (~0.4%)
        results = run_probes([Probe(step, t, trials=96 if t is bf16_fsdp else 16)
                              for t in transforms], world=world, backend=backend, timeout=300)
        rows = [{"transform": r.evidence["transform"], **{k: r.metrics.get(k) for k in (
            "transform_verdict", "equivalent", "scale", "scale_ci_low", "scale_ci_high",
            "worst_parameter", "max_added_error", "dtype")}} for r in results]
        # the one known finding: a mean of micro-batch means over uneven documents
        known = {r["transform"]: r["transform_verdict"] for r in rows}
        return {"world": world, "rows": rows,
                "mean_of_means_biased": known.get("accumulation(normalization=mean-of-means)") == "biased"}
    _check(report, f"{backend}_transforms_world{world}", builtins)

    if world >= 2:
        def zoo():
            from trainprobes.transforms.zoo import run_zoo
            rows = run_zoo(trials=8, backend=backend)
            return {"rows": [{"entry": r.bug.name, "expected": r.bug.expected,
                              "bug": r.buggy.metrics["transform_verdict"],
                              "fixed": r.fixed.metrics["transform_verdict"]} for r in rows],
                    "reproduced": sum(r.reproduced for r in rows), "entries": len(rows)}
        _check(report, f"{backend}_transforms_zoo", zoo)


def matmul_checks(report: dict, device: str) -> None:
    import torch
    from trainprobes.numerics.reveal import matmul_reduction, reveal, scaled_mm_reduction

    knobs = {"fp16": "allow_fp16_reduced_precision_reduction",
             "bf16": "allow_bf16_reduced_precision_reduction"}
    for dtype, knob in knobs.items():
        for allow in (False, True):
            def one(dtype=dtype, knob=knob, allow=allow):
                old = getattr(torch.backends.cuda.matmul, knob)
                setattr(torch.backends.cuda.matmul, knob, allow)
                try:
                    r = reveal(matmul_reduction(), n=32, dtype=dtype, device=device,
                               target=f"torch.matmul[{dtype},{knob}={allow}]")
                finally:
                    setattr(torch.backends.cuda.matmul, knob, old)
                return {"knob": knob, "allowed": allow, "metrics": r.metrics,
                        "message": r.message}
            _check(report, f"matmul_{dtype}_{'reduced' if allow else 'default'}", one)

    def fp8():
        if device != "cuda":
            return {"skipped": "torch._scaled_mm needs CUDA"}
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9) or not hasattr(torch, "_scaled_mm"):
            return {"skipped": f"no fp8 GEMM on compute capability {cap}"}
        r = reveal(scaled_mm_reduction(), n=32, dtype="fp8_e4m3fn", device=device,
                   target="torch._scaled_mm[fp8_e4m3fn->bf16]")
        return {"capability": list(cap), "metrics": r.metrics, "message": r.message}
    _check(report, "scaled_mm_fp8", fp8)


# Real fp8 GEMM outputs on crafted inputs (trainprobes.numerics.gemm_pin), kept in the repo so
# CPU tests pin the accumulator presets to the hardware (tests/test_gemm_pin.py)
SCALED_MM_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "scaled_mm_outputs.json"


def scaled_mm_data(report: dict, device: str, out: Path, force: bool) -> None:
    """Save torch._scaled_mm's outputs on the crafted cases to `out` (a few KB), with the
    presets that match them bit for bit. Only a real GPU run writes (a CPU dry run would
    save the CPU kernel as if it were the hardware); an existing file is kept unless --force."""
    def save():
        import torch
        from trainprobes.numerics.gemm_pin import mismatches, record, scaled_mm_runner
        from trainprobes.reference.gemm import PRESETS
        from trainprobes.result import write_atomic
        if device != "cuda":
            return {"skipped": "a CPU dry run saves nothing: the data must come from a GPU"}
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9) or not hasattr(torch, "_scaled_mm"):
            return {"skipped": f"no fp8 GEMM on compute capability {cap}"}
        doc = record(scaled_mm_runner(device), device_name=torch.cuda.get_device_name(),
                     capability=cap, torch_version=torch.__version__)
        matched = [p for p in PRESETS if not mismatches(doc, p)]
        doc["presets_matched"] = matched
        # raises OutputExists (recorded as this check's error) rather than replace data
        # another run saved
        write_atomic(out, json.dumps(doc, indent=1) + "\n", replace=force)
        return {"path": str(out), "device": doc["device"], "capability": list(cap),
                "presets_matched": matched, "bytes": out.stat().st_size}
    _check(report, "scaled_mm_saved_outputs", save)


def causality_checks(report: dict, device: str) -> None:
    def routers():
        import torch
        from trainprobes.causality import check
        from trainprobes.reference import routing
        x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0)).to(device)
        rows, wrong = [], []
        for name, known in routing.KNOWN_VERDICTS.items():
            for mode, causal in zip(("perturb", "truncate"), known):
                r = check(getattr(routing, name), x, mode=mode, cuts="all", decision=0, scores=1)
                rows.append({"router": name, "mode": mode, "causal": r.metrics["causal"],
                             "known": causal, "n_evaluations": r.metrics["n_evaluations"]})
                if r.metrics["causal"] is not causal:
                    wrong.append(f"{name}[{mode}]: {r.summary_line()}")
        if wrong:
            raise AssertionError("verdicts differ from the known ones on " + device + ": " + "; ".join(wrong))
        return {"rows": rows}
    _check(report, "causality_routers", routers)


def isolation_checks(report: dict, device: str) -> None:
    """trainprobes.isolation on the device: the per-op batch-invariance map (small shapes)
    and the packed-document table of tiny HF models under every attention implementation
    present there (flash_attention_2 where flash_attn is installed: bf16, cu_seq_lens)."""
    def ops():
        from trainprobes.isolation.ops import op_map
        rs = op_map(device=device, quick=True, sizes=(2, 3, 4, 8, 32), trials=2)
        return {"ops": [{"target": r.target, "batch_invariant": r.metrics["batch_invariant"],
                         "breaking_sizes": r.metrics["breaking_sizes"],
                         "max_abs_diff": r.metrics["max_abs_diff"]} for r in rs]}
    _check(report, "isolation_op_map", ops)

    def table():
        from trainprobes.isolation.hf import available_implementations, packed_table
        # the GPU's own question: flash_attention_2 (varlen via cu_seq_lens) beside sdpa;
        # eager and flex_attention are in the CPU table (docs/isolation.md), and flex's
        # compilation would eat the run's time budget
        impls = [i for i in available_implementations() if i in ("sdpa", "flash_attention_2")]
        rows = packed_table(("llama", "qwen2_moe"), impls, device=device)
        return {"rows": [{"family": r.family, "implementation": r.implementation,
                          "convention": r.convention, "isolated": r.result.metrics["isolated"],
                          "max_leak": r.result.metrics["max_leak"], "by_hand": r.by_hand,
                          "fp64": r.result.metrics["fp64"]} for r in rows]}
    _check(report, "isolation_packed_table", table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/gpu-check.json")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run the code paths on the CPU (gloo) to test this script; NOT a GPU check")
    ap.add_argument("--scaled-mm-data", default=str(SCALED_MM_DATA),
                    help="where to save real torch._scaled_mm outputs on crafted inputs")
    ap.add_argument("--force", action="store_true", help="replace an existing --scaled-mm-data file")
    args = ap.parse_args(argv)
    import torch
    from trainprobes.result import environment, write_atomic

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu-check: FAILED: torch.cuda.is_available() is False: no GPU check was run "
              "(nothing passes without a GPU; --allow-cpu only tests this script)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    report = {"environment": environment(), "cpu_dry_run": not cuda, "checks": {}}
    if cuda:
        n = torch.cuda.device_count()
        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
        nccl_checks(report, "nccl", sorted({1, min(n, 8)}))
        transform_checks(report, "nccl", min(n, 8))
        matmul_checks(report, "cuda")
        scaled_mm_data(report, "cuda", Path(args.scaled_mm_data), args.force)
        causality_checks(report, "cuda")
        isolation_checks(report, "cuda")
    else:
        nccl_checks(report, "gloo", [3])
        transform_checks(report, "gloo", 2)
        matmul_checks(report, "cpu")
        scaled_mm_data(report, "cpu", Path(args.scaled_mm_data), args.force)
        causality_checks(report, "cpu")
        isolation_checks(report, "cpu")
    report["seconds"] = round(time.perf_counter() - started, 1)
    failed = [k for k, v in report["checks"].items() if v["status"] != "ok"]
    report["failed"] = failed
    write_atomic(args.out, json.dumps(report, indent=2, default=str))
    print(f"gpu-check: {len(report['checks']) - len(failed)}/{len(report['checks'])} checks ran "
          f"in {report['seconds']}s{' (CPU DRY RUN, not a GPU check)' if not cuda else ''}; "
          f"report: {args.out}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
