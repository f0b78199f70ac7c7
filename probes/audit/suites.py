"""The built-in default suite: what `trainprobes audit` runs with no configuration.

Each family builder returns Checks that call the real probes (imported when the check runs)
and add plot specs (trainprobes.report.plots) to the evidence. A family whose probe module is
not installed is skipped with a note in the report, never stubbed.
"""
from __future__ import annotations

import importlib.util

from trainprobes.audit.run import Check

# Formats in the stall table: the ones training recipes use.
STALL_FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def stall_plot(rows: list[dict]) -> dict:
    """Fraction of the true sum that n sequential adds of the increment reach, per format.

    Drawn from each row's exact stall point: the sum climbs by the increment until it
    reaches `stall_at` and stays there; the measured sum at the row's n is in the table.
    """
    grid = [2 ** k for k in range(0, 15)]
    series = {}
    for r in rows:
        inc, stall_at = r["increment_stored"], r["stall_at"]
        if not inc or r["increment"] != 1.0:
            continue
        series[r["format"]] = [min(n * inc, stall_at) / (n * r["increment"]) for n in grid]
    return {"kind": "line", "title": "sequential sum of n ones / n (stalls at the stall point)",
            "x": grid, "series": series, "xlabel": "additions n", "ylabel": "fraction of true sum",
            "logx": True}


def stall_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    def run():
        from trainprobes.numerics.stall import stall
        r = stall(formats=STALL_FORMATS, increments=(1.0, 1e-3), n=2_000 if quick else 10_000)
        r.evidence["plots"] = [stall_plot(r.evidence.get("rows", []))]
        return r
    return [Check("numerics", "stall table (sum of ones, 1e-3)", run)]


def causality_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The reference routers (positive and negative controls) and the tiny MoE block with a
    correct and an off-by-one attention mask, every cut certified, in both modes."""
    T = 32 if quick else 64

    def one(name, fn_path, known, mode, kwargs):
        def run():
            import torch
            from trainprobes.audit.families import causality_result
            from trainprobes.causality import check
            from trainprobes.targets import load_target
            x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(seed))
            r = check(load_target(fn_path), x, mode=mode, cuts="all", seed=seed, **kwargs)
            r.target = f"{fn_path}[{mode}]"
            r = causality_result(r, T)
            if known is not None:
                r.metrics["known_causal"] = known
                r.metrics["matches_known_verdict"] = r.metrics.get("causal") is known
                r.message = (f"control, known {'causal' if known else 'leaky'}: " + r.message)
            return r
        return Check("causality", f"{name} [{mode}]", run)

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


# (dtype, world, op, algorithm, extra): NCCL-style ring and tree at realistic world sizes,
# the ncclAvg pre-multiply at a world that is not a power of two, stochastic rounding and
# fp8 (adds in fp16, saturating cast back, as NCCL does).
COLLECTIVES = (
    ("bf16", 1024, "sum", "ring", {}),
    ("bf16", 16, "sum", "tree", {}),
    ("bf16", 128, "sum", "ring", {"rounding": "stochastic"}),
    ("bf16", 6, "avg", "ring", {}),
    ("fp16", 8, "avg", "ring", {}),
    ("fp32", 128, "sum", "ring", {}),
    ("fp8_e4m3fn", 32, "sum", "ring", {}),
)


def collectives_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """Bias of emulated all-reduces against the fp64 reference on gradient-like data."""
    def one(dtype, world, op, algorithm, extra):
        def run():
            from trainprobes.audit.families import bias_result
            from trainprobes.numerics.bias import collective_bias
            w = min(world, 64) if quick else world
            return bias_result(collective_bias(dtype=dtype, world=w, numel=1024, op=op,
                                               algorithm=algorithm, trials=16, seed=seed,
                                               **extra))
        label = f"all_reduce {dtype} {algorithm} {op} w={world}" + "".join(
            f" {v}" for v in extra.values())
        return Check("collectives", label, run)
    return [one(*c) for c in COLLECTIVES]


def drift_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The tiny LM engine pair (trainprobes.drift.demo): each precision / sampling combination
    sampled by the KV-cache inference engine and rescored by the training engine."""
    from trainprobes.drift.demo import SCENARIOS

    def one(scenario):
        def run():
            from trainprobes.audit.families import drift_result
            from trainprobes.drift.demo import run_scenario
            # 16 x 24 tokens per scenario keeps the whole suite under 2 minutes on a laptop
            # and still gives every scenario its expected verdict at seed 0
            n, t = (12, 16) if quick else (16, 24)
            r = run_scenario(scenario, n_prompts=n, max_new_tokens=t, seed=seed)
            if scenario.expect:
                r.metrics["expected_verdict"] = scenario.expect
                r.metrics["matches_expected"] = r.metrics.get("drift_verdict") == scenario.expect
                r.message = f"control, expected {scenario.expect}: {r.message}"
            return drift_result(r)
        return Check("drift", scenario.name, run)
    return [one(s) for s in SCENARIOS]


def gloo_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """Real gloo all-reduces on a few local ranks (one launch): the emulator's bit-for-bit
    prediction and the error against fp64, for fp32/fp16/bf16, sum and avg."""
    world = 2 if quick else 4

    def run():
        from trainprobes.distributed import Case, run_collectives
        cases = [Case("all_reduce", dtype, op, 4096, data, seed)
                 for dtype in ("fp32", "fp16", "bf16") for op in ("sum", "avg")
                 for data in ("gradient", "positive")]
        return run_collectives(cases, backend="gloo", world=world, timeout=120.0)
    return [Check("distributed", f"gloo all_reduce on {world} local ranks", run)]


def sites_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The stall where it happens in training: a 1024-rank bf16 all-reduce of same-signed
    gradients, micro-batch accumulation into a bf16 .grad, and bf16 SGD updates."""
    def run():
        from trainprobes.numerics.sites import all_sites
        return all_sites(dtype="bf16", seed=seed)
    return [Check("numerics", "accumulation sites (bf16)", run)]


def reveal_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """Accumulator precision and order of this machine's kernels and of the emulated ring,
    revealed from crafted inputs: `accumulator_mantissa_bits` is what the gate compares."""
    def one(label, dtype, make_fn, output_dtype=None):
        def run():
            from trainprobes.numerics import reveal as rv
            kw = {"output_dtype": output_dtype} if output_dtype else {}
            return rv.reveal(make_fn(rv), dtype=dtype, target=label, **kw)
        return Check("numerics", f"reveal {label}", run)
    return [one("torch.sum[fp16]", "fp16", lambda rv: (lambda x: x.sum())),
            one("torch.sum[bf16]", "bf16", lambda rv: (lambda x: x.sum())),
            one("torch.matmul[bf16]", "bf16", lambda rv: rv.matmul_reduction()),
            one("all_reduce[bf16,ring]", "bf16", lambda rv: rv.collective_reduction("bf16"),
                output_dtype="bf16")]


def isolation_ops_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """This machine's per-op batch-invariance map (trainprobes.isolation.ops): each op alone
    vs inside batches, bit for bit, fp32 and bf16, small shapes. A variant op fails with
    TP-I2 (the verdict follows `batch_invariant`), though it is a fact about the torch build
    and device rather than a bug; the gate blocks an op that was invariant in the baseline
    and is variant now."""
    from trainprobes.isolation.ops import OP_NAMES

    def one(op):
        def run():
            from trainprobes.isolation.ops import op_map
            return op_map([op], sizes=(2, 3, 4, 8) if quick else (2, 3, 4, 7, 8, 16, 32),
                          trials=2 if quick else 3, seed=seed, quick=True)
        return Check("isolation", f"batch invariance of torch.{op}", run)
    return [one(op) for op in OP_NAMES]


def isolation_documents_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The packed-document table of the HF attention implementations present: tiny random
    Llama and Qwen2-MoE (quick: Llama, and no flex_attention, whose compilation alone takes
    10-30 s) under each packing convention transformers offers. A correct block-diagonal
    4-D mask is a control known to isolate (expected pass); the other rows are findings
    about the installed transformers."""
    from trainprobes.isolation.hf import available_implementations

    families = ("llama",) if quick else ("llama", "qwen2_moe")
    impls = [i for i in available_implementations() if not (quick and i == "flex_attention")]

    def one(impl):
        def run():
            from trainprobes.isolation.hf import packed_table
            out = []
            for row in packed_table(families, [impl], seed=seed):
                r = row.result
                r.metrics["by_hand_change"] = row.by_hand
                if row.convention == "mask_4d":
                    r.expected = "pass"
                    r.message = "control, a block-diagonal mask isolates: " + r.message
                out.append(r)
            return out
        return Check("isolation", f"packed documents under {impl} attention", run)
    return [one(impl) for impl in impls]


FAMILIES = {
    # family: (module that must exist, builder)
    "stall": ("trainprobes.numerics.stall", stall_checks),
    "sites": ("trainprobes.numerics.sites", sites_checks),
    "reveal": ("trainprobes.numerics.reveal", reveal_checks),
    "collectives": ("trainprobes.numerics.bias", collectives_checks),
    "causality": ("trainprobes.causality", causality_checks),
    "drift": ("trainprobes.drift.demo", drift_checks),
    "gloo": ("trainprobes.distributed", gloo_checks),
}


def default_suite(*, seed: int = 0, quick: bool = False,
                  families=None) -> tuple[list[Check], dict[str, str]]:
    """(checks, skipped): skipped maps a family to why it is not in this run."""
    names = list(FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"families={unknown!r} are not default-suite families; "
                         f"choose from {sorted(FAMILIES)}")
    checks, skipped = [], {}
    for name in names:
        module, build = FAMILIES[name]
        if not _available(module):
            skipped[name] = f"{module} is not installed in this build"
            continue
        checks.extend(build(seed=seed, quick=quick))
    return checks, skipped
