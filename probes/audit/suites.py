"""The built-in default suite: what `trainprobes audit` runs with no configuration.

It has two parts, kept apart in every report and exit code:
  your stack   what this torch build and this machine actually do: the accumulators of its
               sum and matmul kernels (and on a GPU: cuBLAS in reduced precision, fp8 GEMM),
               real gloo (and NCCL) collectives against the emulator. Findings: PASS means
               fine, WARN means watch out.
  calibration  controls whose verdict is known from their mechanism: the stall table, the
               accumulation sites, emulated collectives, the reference routers and MoE
               blocks, the tiny-LM engine pair. Each Result carries its known verdict
               (`Result.expected`); reproducing it, pass or fail, is a pass of the harness.

Each family builder returns Checks that call the real probes (imported when the check runs).
A family whose probe module is not installed is skipped (named in the report), one that
needs hardware this machine lacks is listed as "not on this machine"; nothing is stubbed.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from trainprobes.audit.localize_family import localize_checks
from trainprobes.audit.machine import cuda_missing
from trainprobes.audit.run import Check
from trainprobes.audit.suite_gemm import gemm_checks
from trainprobes.audit.zoo_family import zoo_checks
from trainprobes.validation import check_choice

STACK, CALIBRATION = "stack", "calibration"
# Controls run at this seed whatever --seed says: a control is a fixed case with a known
# verdict, so a miss means this machine or this trainprobes changed, never a 1-in-100 draw
# of a statistical test (the unbiased ones are tested at alpha 0.01). --seed moves findings.
CONTROL_SEED = 0


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _cuda() -> str | None:
    return cuda_missing()


def _nccl() -> str | None:
    why = _cuda()
    if why:
        return why
    import torch.distributed as dist
    return None if dist.is_available() and dist.is_nccl_available() else "torch built without NCCL"


# --- your stack ----------------------------------------------------------------------------

def _reveal_check(label: str, dtype: str, make_fn, device: str = "cpu", **kw) -> Check:
    def run():
        from trainprobes.audit.families import accumulator_finding
        from trainprobes.numerics import reveal as rv
        r = rv.reveal(make_fn(rv), dtype=dtype, device=device, target=label, **kw)
        return accumulator_finding(r)
    return Check("numerics", f"reveal {label}", run)


def _sum(rv):
    return lambda x: x.sum()


def _matmul(rv):
    return rv.matmul_reduction()


def reveal_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The accumulators of this torch build's CPU kernels: torch.sum and torch.matmul in
    fp16, bf16 and fp32, revealed from crafted inputs (trainprobes.numerics.reveal).
    Narrower than fp32 is a WARN (TP-B3): sums of many small terms lose them."""
    return [_reveal_check(f"torch.{op}[{dt},cpu]", dt, make)
            for op, make in (("sum", _sum), ("matmul", _matmul)) for dt in ("fp16", "bf16", "fp32")]


def gpu_kernel_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The same on the GPU, with this process's reduced-precision settings as they are:
    torch.matmul in fp16/bf16 (allow_{fp16,bf16}_reduced_precision_reduction) and fp32
    (allow_tf32: TF32 shows as 10 mantissa bits), and fp8 torch._scaled_mm where the GPU has
    it (sm89+). Untested where this was written (no GPU): scripts/gpu-check.sh runs them."""
    import torch
    m = torch.backends.cuda.matmul
    flags = {"fp16": f"reduced_precision={m.allow_fp16_reduced_precision_reduction}",
             "bf16": f"reduced_precision={m.allow_bf16_reduced_precision_reduction}",
             "fp32": f"allow_tf32={m.allow_tf32}"}
    checks = [_reveal_check(f"torch.{op}[{dt},cuda,{flags[dt]}]" if op == "matmul" else
                            f"torch.{op}[{dt},cuda]", dt, make, device="cuda")
              for op, make in (("sum", _sum), ("matmul", _matmul)) for dt in ("fp16", "bf16", "fp32")]
    if torch.cuda.get_device_capability(0) >= (8, 9) and hasattr(torch, "_scaled_mm"):
        checks.append(_reveal_check("torch._scaled_mm[fp8_e4m3fn,cuda,out=bf16]", "fp8_e4m3fn",
                                    lambda rv: rv.scaled_mm_reduction(), device="cuda",
                                    output_dtype="bf16"))
    return checks


def _real_collectives(backend: str, world: int, seed: int) -> Check:
    def run():
        from trainprobes.distributed import Case, run_collectives
        cases = [Case("all_reduce", dtype, op, 4096, data, seed)
                 for dtype in ("fp32", "fp16", "bf16") for op in ("sum", "avg")
                 for data in ("gradient", "positive")]
        return run_collectives(cases, backend=backend, world=world, timeout=120.0)
    return Check("distributed", f"{backend} all_reduce on {world} local ranks", run,
                 background=True)


def gloo_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """Real gloo all-reduces on a few local ranks (one launch, beside the other checks):
    the emulator's bit-for-bit prediction and the error against fp64, for fp32/fp16/bf16,
    sum and avg, on gradient-like and same-signed data."""
    return [_real_collectives("gloo", 2 if quick else 4, seed)]


def nccl_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The same on NCCL, one rank per visible GPU (up to 8). Untested where this was written."""
    import torch
    return [_real_collectives("nccl", min(torch.cuda.device_count(), 8), seed)]


def isolation_ops_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """This machine's per-op batch-invariance map (trainprobes.isolation.ops): each op alone
    vs inside batches, bit for bit, fp32 and bf16, small shapes. A variant op is a
    watch-out (warn, TP-I2; the probe isolation.op_map is advisory in result.PROBES): a fact
    about the torch build and device (CPU fp32 matmuls are variant), not a bug; the gate
    still blocks an op that was invariant in the baseline and is variant now."""
    from trainprobes.isolation.ops import OP_NAMES

    # on a GPU machine the GPU's kernels are what an inference engine runs: map both
    devices = ["cpu"] if _cuda() else ["cpu", "cuda"]

    def one(op, device):
        def run():
            from trainprobes.isolation.ops import op_map
            return op_map([op], sizes=(2, 3, 4, 8) if quick else (2, 3, 4, 7, 8, 16, 32),
                          trials=2 if quick else 3, seed=seed, quick=True, device=device)
        return Check("isolation", f"batch invariance of torch.{op} on {device}", run)
    return [one(op, d) for d in devices for op in OP_NAMES]


def isolation_documents_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The packed-document table of the HF attention implementations present: tiny random
    Llama and Qwen2-MoE (quick: Llama, and no flex_attention, whose compilation alone takes
    10-30 s) under each packing convention transformers offers. Rows whose verdict the
    mechanism fixes (isolation.hf.design_verdict: a block-diagonal 4-D mask and the training
    call isolate, the cached call and packed position ids beside a mask of ones leak) are
    controls; the others (a boolean mask under flex) are findings about the installed
    transformers."""
    from trainprobes.isolation.hf import available_implementations

    families = ("llama",) if quick else ("llama", "qwen2_moe")
    impls = [i for i in available_implementations() if not (quick and i == "flex_attention")]

    def one(impl):
        def run():
            from trainprobes.isolation.hf import packed_table
            out = []
            from trainprobes.isolation.hf import design_verdict
            for row in packed_table(families, [impl], seed=seed):
                r = row.result
                r.metrics["by_hand_change"] = row.by_hand
                known = design_verdict(impl, row.convention)   # known from the mechanism: a control
                if known is not None:
                    r.expected = "pass" if known == "isolated" else "fail"
                    r.message = f"control, {known} by transformers' design: " + r.message
                out.append(r)
            return out
        return Check("isolation", f"packed documents under {impl} attention", run)
    return [one(impl) for impl in impls]


# --- calibration ---------------------------------------------------------------------------

# Formats in the stall table: the ones training recipes use.
STALL_FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")
STALL_INCREMENTS = (1.0, 1e-3)
STALL_ADDS = 4096  # past fp16's stall at 2048, so every narrow format shows its stall


def stall_expected(formats, increments, n: int, rel_tol: float) -> str:
    """The stall table's verdict from the stall points alone: WARN when some format stops
    growing (at its exact stall point) more than rel_tol short of n adds."""
    import torch
    from trainprobes.reference.formats import get_format
    for name in formats:
        f = get_format(name)
        for inc in increments:
            d = f.round(torch.tensor([inc], dtype=torch.float64)).item()
            if d == 0.0 or f.stall_point(d) < n * inc * (1 - rel_tol):
                return "warn"
    return "pass"


def stall_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    def run():
        from trainprobes.audit.families import stall_plot
        from trainprobes.numerics.stall import stall
        r = stall(formats=STALL_FORMATS, increments=STALL_INCREMENTS, n=STALL_ADDS)
        r.expected = stall_expected(STALL_FORMATS, STALL_INCREMENTS, STALL_ADDS,
                                    r.metrics.get("rel_tol", 1e-2))
        r.evidence["plots"] = [stall_plot(r)]
        return r
    return [Check("numerics", f"stall table (sums of {STALL_ADDS} adds of 1 and 1e-3)", run,
                  control=True)]


def sites_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The stall where it happens in training, each a known loss in bf16: a 1024-rank
    all-reduce of 0.001 gradients (stalls at 0.5), 1024 micro-batches accumulated into a
    bf16 .grad, and SGD at lr 1e-4 whose updates are under half an ulp of the weights."""
    def run():
        from trainprobes.numerics import sites
        out = [sites.collective_site(dtype="bf16", seed=seed),
               sites.grad_accumulation_site(dtype="bf16", seed=seed),
               sites.weight_update_site(dtype="bf16", seed=seed, steps=25)]
        for r in out:
            r.expected = "fail"
        return out
    return [Check("numerics", "accumulation sites (bf16)", run, control=True)]


@dataclass(frozen=True)
class Collective:
    dtype: str
    world: int
    op: str
    algorithm: str
    expected: str          # from the mechanism, in `why`
    why: str
    rounding: str = "nearest"
    numel: int = 1024
    quick_numel: int = 128  # quick mode keeps the world (the mechanism) and holds fewer values
    quick_trials: int = 16

    def kwargs(self, quick: bool) -> dict:
        """collective_bias arguments of this control, in full or quick mode."""
        return dict(dtype=self.dtype, world=self.world, op=self.op, algorithm=self.algorithm,
                    rounding=self.rounding, numel=self.quick_numel if quick else self.numel,
                    trials=self.quick_trials if quick else 16)


# NCCL-style ring and tree at realistic world sizes, the ncclAvg pre-multiply at a world
# that is not a power of two, stochastic rounding and fp8 (adds in fp16, saturating cast).
# Quick mode keeps every world: the ring's stall is a property of the world (at 64 ranks
# bf16 is off by -2e-4, under its floor u/16 = 2.4e-4; between 256 and 384 the sign of the
# bias still flips), so it trims values per rank and trials instead. Measured with
# scripts/bias_rates.py (tests/data/bias_control_power.json), each control over 200 seeds
# at quick and full sizes, the known verdict came out in (quick / full):
#   bf16 ring w=1024 fail 200/200 / 200/200     bf16 tree w=16 pass 200/200 / 200/200
#   bf16 ring w=128 stochastic pass 200/200 / 200/200     bf16 avg w=6 fail 200/200 / 200/200
#   fp16 avg w=8 pass 200/200 / 200/200     fp32 ring w=128 pass 200/200 / 200/200
#   fp8_e4m3fn ring w=32 fail 200/200 / 200/200
# (power >= 0.982 for each at 95% confidence, Clopper-Pearson; the pass controls' miss rate
# is bounded by the two-stage test's false-positive rate, <= alpha = 0.01).
COLLECTIVES = (
    Collective("bf16", 1024, "sum", "ring", "fail", "every hop rounds to bf16: small "
               "gradients stop adding once the partial sum is 2^8 times larger", numel=256,
               quick_numel=16, quick_trials=8),
    Collective("bf16", 16, "sum", "tree", "pass", "4 levels of round-to-nearest on sums of "
               "like size: no drift"),
    Collective("bf16", 128, "sum", "ring", "pass", "stochastic rounding is unbiased",
               rounding="stochastic"),
    Collective("bf16", 6, "avg", "ring", "fail", "ncclAvg pre-multiplies by bf16(1/6) = "
               "0.16699: +0.195%"),
    Collective("fp16", 8, "avg", "ring", "pass", "1/8 is exact in fp16"),
    Collective("fp32", 128, "sum", "ring", "pass", "fp32's spacing is far below the "
               "gradients' size"),
    Collective("fp8_e4m3fn", 32, "sum", "ring", "fail", "3 mantissa bits: partial sums stall "
               "within a few hops"),
)


def collectives_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """Bias of emulated all-reduces against the fp64 reference on gradient-like data, and
    the accumulator of the emulated ring revealed (fp32 keeps 23 bits, bf16 7)."""
    def one(c: Collective) -> Check:
        def run():
            from trainprobes.audit.families import bias_result
            from trainprobes.numerics.bias import collective_bias
            r = bias_result(collective_bias(seed=seed, **c.kwargs(quick)))
            r.expected = c.expected
            r.evidence["known"] = c.why
            return r
        extra = "" if c.rounding == "nearest" else f" {c.rounding}"
        return Check("collectives", f"all_reduce {c.dtype} {c.algorithm} {c.op} w={c.world}{extra}",
                     run, control=True)

    def ring(dtype: str, expected: str) -> Check:
        def run():
            from trainprobes.numerics import reveal as rv
            r = rv.reveal(rv.collective_reduction(dtype), dtype=dtype, output_dtype=dtype,
                          target=f"emulated all_reduce[{dtype},ring]", expected_mantissa_bits=23)
            r.expected = expected
            return r
        return Check("collectives", f"reveal emulated all_reduce[{dtype},ring]", run, control=True)
    return [one(c) for c in COLLECTIVES] + [ring("fp32", "pass"), ring("bf16", "fail")]


def causality_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The reference routers (known causal and known leaky) and the tiny MoE block with a
    correct and an off-by-one attention mask, every cut certified, in both modes."""
    T = 32 if quick else 64

    def one(name, fn_path, known_causal, mode, kwargs):
        def run():
            import torch
            from trainprobes.audit.families import causality_result
            from trainprobes.causality import check
            from trainprobes.targets import load_target
            x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(seed))
            r = check(load_target(fn_path), x, mode=mode, cuts="all", seed=seed, **kwargs)
            r.target = f"{fn_path}[{mode}]"
            r.expected = "pass" if known_causal else "fail"
            return causality_result(r, T)
        return Check("causality", f"{name} [{mode}]", run, control=True)

    from trainprobes.reference.routing import KNOWN_VERDICTS
    checks = []
    for name, (perturb, truncate) in KNOWN_VERDICTS.items():
        for mode, known in (("perturb", perturb), ("truncate", truncate)):
            checks.append(one(name, f"trainprobes.reference.routing:{name}", known, mode,
                              {"decision": 0, "scores": 1}))
    for name, known in (("causal_block", True), ("off_by_one_block", False)):
        checks.append(one(name, f"trainprobes.reference.models.moe:{name}", known, "perturb",
                          {"decision": "expert_ids", "scores": "router_probs"}))
    return checks


# What each drift label means as a verdict (trainprobes.drift.compare).
DRIFT_VERDICT = {"clean": "pass", "noisy": "pass", "heavy-tailed": "warn", "biased": "fail"}


def drift_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The tiny LM engine pair (trainprobes.drift.demo): each precision / sampling combination
    sampled by the KV-cache inference engine and rescored by the training engine."""
    from trainprobes.drift.demo import SCENARIOS

    def one(scenario):
        def run():
            from trainprobes.audit.families import drift_result
            from trainprobes.drift.demo import run_scenario
            # 16 x 24 tokens per scenario: every scenario gets its expected label at seed 0
            n, t = (12, 16) if quick else (16, 24)
            r = run_scenario(scenario, n_prompts=n, max_new_tokens=t, seed=seed)
            r.expected = DRIFT_VERDICT[scenario.expect]
            label = r.metrics.get("drift_verdict")
            if label != scenario.expect:
                r.message += f" (known {scenario.expect}, labelled {label})"
            return drift_result(r)
        return Check("drift", scenario.name, run, control=True)
    return [one(s) for s in SCENARIOS if s.expect]


# --- the registry ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    part: str                                  # STACK or CALIBRATION
    module: str                                # must be installed, else the family is skipped
    build: Callable[..., list]                 # (seed=, quick=) -> [Check]
    needs: Callable[[], "str | None"] | None = None   # why this machine cannot run it
    worker: bool = False       # run in a second process beside the others (a second core)
    default: bool = True       # in the suite without --families (else asked for by name)


# In run order; the stack first. `needs` is called when the suite is built (through a
# lambda, so the hardware check it names is looked up then: a test can stand in for a GPU).
# Not in the default run, only by name: documents (tiny HF models under each attention
# implementation: importing transformers alone takes several seconds of a 10-second audit).
FAMILIES = {
    "reveal": Family(STACK, "trainprobes.numerics.reveal", reveal_checks),
    "gpu_kernels": Family(STACK, "trainprobes.numerics.reveal", gpu_kernel_checks,
                          lambda: _cuda()),
    "gloo": Family(STACK, "trainprobes.distributed", gloo_checks),
    "nccl": Family(STACK, "trainprobes.distributed", nccl_checks, lambda: _nccl()),
    "batch_invariance": Family(STACK, "trainprobes.isolation.ops", isolation_ops_checks),
    "documents": Family(STACK, "transformers", isolation_documents_checks, default=False),
    "stall": Family(CALIBRATION, "trainprobes.numerics.stall", stall_checks),
    "sites": Family(CALIBRATION, "trainprobes.numerics.sites", sites_checks),
    # the largest calibration family: in a worker process it balances the two cores (gloo's
    # ranks take the second one for a moment too)
    "collectives": Family(CALIBRATION, "trainprobes.numerics.bias", collectives_checks,
                          worker=True),
    "causality": Family(CALIBRATION, "trainprobes.causality", causality_checks),
    "drift": Family(CALIBRATION, "trainprobes.drift.demo", drift_checks),
    "gemm": Family(CALIBRATION, "trainprobes.audit.suite_gemm", gemm_checks, default=False),
    "drift_localize": Family(CALIBRATION, "transformers", localize_checks, default=False),
    "zoo": Family(CALIBRATION, "transformers", zoo_checks, default=False),
}


def _names(families) -> list[str]:
    if families is None:
        return [name for name, fam in FAMILIES.items() if fam.default]
    if isinstance(families, str):
        families = [families]
    return [check_choice(n, "families", FAMILIES, hint="default-suite families") for n in families]


def not_here(families=None) -> dict[str, str]:
    """Families this machine cannot run (no GPU, no NCCL) and why: not a skip, since there
    is nothing here for them to check."""
    out = {}
    for name in _names(families):
        fam = FAMILIES[name]
        why = fam.needs() if fam.needs and _available(fam.module) else None
        if why:
            out[name] = why
    return out


def default_suite(*, seed: int = 0, quick: bool = False, families=None,
                  in_process: bool = False) -> tuple[list[Check], dict[str, str]]:
    """(checks, skipped): skipped maps a family to why it is not in this run (its probe
    module is missing). Families this machine has no hardware for: not_here().
    in_process: build worker families' checks here too (what the worker process does)."""
    from trainprobes.audit.remote import worker_check

    names = _names(families)
    absent = not_here(names)
    checks, skipped = [], {}
    for name in names:
        fam = FAMILIES[name]
        family_seed = seed if fam.part == STACK else CONTROL_SEED
        if not _available(fam.module):
            skipped[name] = f"{fam.module} is not installed in this build"
        elif name in absent:
            continue
        elif fam.worker and not in_process:
            checks.append(worker_check(name, f"{name} (in a worker process)", seed=family_seed,
                                       quick=quick, control=fam.part == CALIBRATION))
        else:
            checks.extend(fam.build(seed=family_seed, quick=quick))
    return checks, skipped
