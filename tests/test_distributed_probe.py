"""probes/distributed/probe.py: real gloo ranks predicted bit for bit by the emulator."""
import pytest
import torch
import trainprobes.distributed.probe as P
from trainprobes.distributed import Case, emulate_collective, run_collective, run_collectives
from trainprobes.result import Result

MiB = 1 << 20


def cases_for(world: int) -> list:
    cases = []
    for k, dt in enumerate(("fp32", "fp16", "bf16")):
        for op in ("sum", "avg"):
            for n in (1, world + 1, 1000):
                cases.append(Case("all_reduce", dt, op, n, "normal", seed=n + k))
            cases.append(Case("reduce_scatter", dt, op, world * 301, "gradient", seed=k))
            cases.append(Case("reduce", dt, op, 999, "normal", seed=k, root=world - 1))
        cases.append(Case("all_gather", dt, "sum", 33, "normal", seed=k))
    if world == 3:
        # Past gloo's 2 * world segment minimum (more than two 1 MiB segments per rank),
        # where all_reduce and reduce segment differently; fp64 has the fewest elements per
        # byte, and at 3 ranks the order already shows (which rank comes last). All world
        # sizes 2-8 at such sizes: benchmarks/bench_distributed.py.
        cases.append(Case("all_reduce", "fp64", "sum", (9 * MiB + 40) // 8, "gradient", seed=11))
        cases.append(Case("reduce", "fp64", "sum", (9 * MiB + 16) // 8, "normal", seed=12))
    return cases


@pytest.fixture(scope="module")
def real_runs():
    """One set of real gloo ranks per world size, all cases in it (spawning is the cost)."""
    cache = {}

    def get(world):
        if world not in cache:
            cases = cases_for(world)
            outs = P.launch(P.cases_task, world, timeout=300, args=(cases, "gloo"))
            cache[world] = (cases, outs)
        return cache[world]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_is_predicted_bit_for_bit_on_every_rank(world, real_runs):
    cases, outs = real_runs(world)
    for k, case in enumerate(cases):
        per_rank = [outs[r][k] for r in range(world)]
        res = P.result_from_outputs(case, per_rank, backend="gloo", world=world)
        assert res.metrics["bitwise_match_fraction"] == 1.0, (case, res.evidence["mismatch_report"])
        assert res.verdict in ("pass", "warn") and "TP-B4" not in res.codes
        if case.op == "sum" and case.collective != "all_gather":
            # W-1 roundings, each at most half an ulp of a partial sum <= W * max|x|
            assert res.metrics["max_ulp_error"] <= world * (world - 1) / 2
        expect = 0 if case.collective == "reduce" else world
        assert len([t for t in per_rank if t is not None]) in (expect, 1)


def test_nccls_ring_model_misses_gloo_at_four_ranks(real_runs):
    cases, outs = real_runs(4)
    k = next(i for i, c in enumerate(cases) if c.numel == 1000 and c.dtype == "bf16")
    res = P.result_from_outputs(cases[k], [outs[r][k] for r in range(4)], backend="gloo",
                                world=4, algorithm="ring")
    assert res.verdict == "fail" and res.codes[0] == "TP-B4"
    assert 0 < res.metrics["bitwise_match_fraction"] < 1
    assert "Mismatched elements:" in res.evidence["mismatch_report"]
    assert Result.from_json(res.to_json()).metrics == res.metrics


def test_one_call_api_and_progress():
    lines = []
    res = run_collective(backend="gloo", world=2, dtype="bf16", op="avg", numel=257,
                         data="positive", seed=4, progress=lines.append)
    assert res.probe == "distributed.collective" and res.seed == 4
    assert res.metrics["bitwise_match_fraction"] == 1.0
    assert res.metrics["world"] == 2 and res.metrics["algorithm"] == "gloo"
    assert any("started 2 gloo ranks" in x for x in lines)


def test_cases_are_validated_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(P, "launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match="must be divisible by world=4"):
        run_collectives([Case("all_reduce"), Case("reduce_scatter", numel=5)], world=4)
    with pytest.raises(ValueError, match=r"root=3 must be an int in \[0, 1\] \(a rank\)"):
        run_collective(world=2, collective="reduce", root=3)
    with pytest.raises(ValueError, match="op='prod'"):
        run_collective(world=2, op="prod")


@pytest.mark.parametrize("dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_gloo_has_no_fp8_so_it_is_emulated_and_said(dtype, monkeypatch):
    monkeypatch.setattr(P, "launch", lambda *a, **k: pytest.fail("gloo cannot reduce fp8"))
    res = run_collective(backend="gloo", world=4, dtype=dtype, numel=256)
    assert res.verdict == "warn" and "no float8" in res.message
    assert "bitwise_match_fraction" not in res.metrics


def test_emulated_at_thousands_of_ranks_shows_the_bf16_stall_bias():
    res = emulate_collective(world=4096, dtype="bf16", op="sum", numel=64, data="positive")
    assert res.metrics["backend"] == "emulated" and "bitwise_match_fraction" not in res.metrics
    # 4096 same-signed values: partial sums grow until adds round away -> sum too small
    assert res.metrics["bias"] < 0 and res.metrics["bias_relative"] < -0.1
    assert res.verdict == "warn" and res.codes == ["TP-B1"]
    assert "not applicable" in res.message


@pytest.mark.parametrize("algorithm", ["ring", "tree", "gloo", "halving_doubling"])
def test_emulated_error_is_measured_against_fp64(algorithm):
    r16 = emulate_collective(world=64, dtype="bf16", numel=512, algorithm=algorithm)
    r64 = emulate_collective(world=64, dtype="fp64", numel=512, algorithm=algorithm)
    assert r16.metrics["mean_ulp_error"] > 0.1  # 63 bf16 roundings per element
    assert abs(r64.metrics["bias_relative"]) < 1e-12
    if algorithm == "ring":  # the reference's own order: identical bits
        assert r64.metrics["max_ulp_error"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for backend='nccl'")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_nccl_world_one_gpu(dtype):
    res = run_collective(backend="nccl", world=1, dtype=dtype, op="sum", numel=4096)
    assert res.metrics["bitwise_match_fraction"] == 1.0
    assert res.metrics["max_ulp_error"] == 0.0  # one rank: nothing is added
