"""trainprobes.watch.fsdp: FSDP2's reduce-scatter watched through set_custom_reduce_scatter,
on real gloo ranks (torch 2.13 CPU): no bit of the run changed, the verdicts right, and what
would go unwatched refused."""
import pytest
import torch
from test_watch import _same  # the DDP tests' bitwise comparison of two runs
from trainprobes.distributed.launcher import launch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.result import Result
from trainprobes.watch import Sentinel, attach_fsdp2
from trainprobes.watch.fsdp import op_scale
from trainprobes.watch.fsdp_demo import (
    fsdp_branch_task,
    fsdp_refusal_task,
    fsdp_runs_task,
    lightning_fsdp_runs_task,
)


def test_the_reference_scales_the_fp64_sum_as_the_op_fsdp_passes():
    from torch.distributed import ReduceOp
    assert op_scale(ReduceOp.SUM, 4) == 1.0
    assert op_scale(ReduceOp.AVG, 4) == 0.25  # FSDP2's default for fp32 and bf16
    assert op_scale(ReduceOp.PREMUL_SUM(1 / 3), 4) == 1 / 3  # set_gradient_divide_factor(3)
    assert op_scale(ReduceOp.MAX, 4) is None


def test_bad_input_names_what_is_not_watched():
    with pytest.raises(InvalidArgument, match="no process group"):
        attach_fsdp2(torch.nn.Linear(2, 2), Sentinel())
    with pytest.raises(InvalidType, match="model=list must be a torch.nn.Module"):
        attach_fsdp2([], Sentinel())
    with pytest.raises(InvalidType, match="sentinel=None must be"):
        attach_fsdp2(torch.nn.Linear(2, 2), None)


@pytest.mark.slow
def test_attaching_changes_no_bit_of_the_run():
    """2 gloo ranks, 8 steps with dropout, every reduce-scatter sampled: losses, the gathered
    weights and the global generator bit for bit as without the sentinel, with torch's
    reduce-scatter and with a custom one (wrapped, not replaced); the Results name what
    FSDP passed the comm (dtype, op)."""
    kw = {"sample": 1.0, "interval": 4, "max_per_step": 4, "window": 4096, "budget": 1 << 20}
    runs = [{"reduce": r, "steps": 8, "watch": w, "sentinel_kwargs": kw}
            for r in ("fp32", "truncating", "bf16") for w in (False, True)]
    out = launch(fsdp_runs_task, 2, args=(runs,), timeout=300)
    for r, rank in enumerate(out):
        for i in (0, 2, 4):
            assert _same(rank[i], rank[i + 1]), f"rank {r}, {runs[i]['reduce']}"
            assert rank[i + 1]["own_errors"] == 0
    for i, comm, dtype in ((1, "DefaultReduceScatter", "float32"),
                           (3, "TruncatingReduceScatter", "float32"),
                           (5, "DefaultReduceScatter", "bfloat16")):
        # the last Result per stream (findings at looks come before the final ones)
        res = list({r.target: r for r in map(Result.from_json, out[0][i]["results"])}.values())
        # 4 Linear modules' streams and the pooled one
        assert len(res) == 5 and all(r.target.startswith(f"watch:fsdp2[{comm}].module:") or
                                     r.target.endswith(".all_buckets") for r in res)
        pooled = [r for r in res if r.target.endswith(".all_buckets")][0]
        # the first step checks one (no buckets counted yet), then 4 a step
        assert pooled.metrics["trials"] == 1 + 7 * 4
        assert pooled.evidence["reduce_dtypes_seen"] == [dtype]
        assert pooled.evidence["reduce_ops_seen"] == ["AVG"]


@pytest.mark.slow
def test_verdicts_at_the_defaults(tmp_path):
    """At the defaults (sample 0.25, a look every 10 steps), 2 gloo ranks, 60 steps: a
    reduce-scatter that truncates to bf16 is called biased by step 30 and stops both ranks
    at the same step (measured over seeds 0-4: steps 20, 20, 30, 20, 20); fp32, fp32 with
    force-sum (SUM, FSDP divides after), set_gradient_divide_factor(3) (PREMUL_SUM(1/3),
    done by a custom comm as gloo refuses it), reduce_dtype=bf16 (gloo: round to nearest) and a
    bf16 round-to-nearest comm are noise, the two bf16 ones with a large spread."""
    found = tmp_path / "findings.jsonl"
    runs = [{"reduce": "truncating", "steps": 60, "watch": True,
             "sentinel_kwargs": {"findings": str(found), "stop_on_finding": True}}]
    runs += [{"reduce": r, "steps": 60, "watch": True}
             for r in ("fp32", "force_sum", "divide_factor", "bf16", "rounding")]
    out = launch(fsdp_runs_task, 2, args=(runs,), timeout=300)
    assert out[0][0]["stopped_at"] == out[1][0]["stopped_at"] and out[0][0]["stopped_at"] <= 30
    first = Result.from_json(found.read_text().splitlines()[0])
    assert first.verdict == "fail" and first.codes == ["TP-B1"] and first.metrics["bias"] < -1e-3
    assert first.target.startswith("watch:fsdp2[TruncatingReduceScatter].")
    for i, reduce in enumerate(("fp32", "force_sum", "divide_factor", "bf16", "rounding"), start=1):
        res = [Result.from_json(x) for x in out[0][i]["results"]]
        assert res and not [r.message for r in res if r.verdict == "fail"], reduce
        # a module sampled fewer than 3 times in 60 steps cannot be judged alone (said so);
        # every sample counts in the pooled stream
        assert all(r.verdict == "pass" or (r.verdict == "error" and r.metrics["trials"] < 3)
                   for r in res), [r.message for r in res]
        pooled = [r for r in res if r.target.endswith(".all_buckets")][0]
        assert pooled.verdict == "pass" and pooled.metrics["biased"] is False
        assert pooled.metrics["trials"] >= 8
        if reduce in ("bf16", "rounding"):
            assert pooled.metrics["std"] > 1e-5 and abs(pooled.metrics["bias"]) < 2.0 ** -12
        else:
            assert abs(pooled.metrics["bias"]) < 1e-7
        # a reference that missed the op's factor would be off by -2/3 (biased)
        ops = {"force_sum": ["SUM"], "divide_factor": ["PREMUL_SUM"]}.get(reduce, ["AVG"])
        assert pooled.evidence["reduce_ops_seen"] == ops


@pytest.mark.slow
def test_fp32_and_symmetric_rounding_are_never_called_biased_over_seeds():
    """Seeds 1-6 (run and sentinel), 40 steps, every step sampled: no finding for fp32 or a
    round-to-nearest bf16 comm on 2 ranks."""
    runs = [{"reduce": r, "steps": 40, "watch": True, "seed": s,
             "sentinel_kwargs": {"seed": s, "sample": 1.0}}
            for s in range(1, 7) for r in ("fp32", "rounding")]
    out = launch(fsdp_runs_task, 2, args=(runs,), timeout=300)
    for run, got in zip(runs, out[0]):
        res = [Result.from_json(x) for x in got["results"]]
        assert res and not [r.message for r in res if r.verdict != "pass"], run


@pytest.mark.slow
def test_what_would_go_unwatched_is_refused():
    cases = ["plain", "hsdp", "custom_set", "all_reduce_hook", "partial", "twice", "replicate",
             "one_rank", "frozen", "tp", "grouped", "ok"]
    got = dict(zip(cases, launch(fsdp_refusal_task, 2, args=(cases,), timeout=120)[0]))
    # torch 2.13: replicate() is an FSDPModule that all-reduces and never calls the
    # reduce-scatter, nor does a 1-rank shard group; attached, they watched nothing
    assert "replicate" in got["replicate"] and "all-reduce" in got["replicate"], got["replicate"]
    assert "1 rank" in got["one_rank"] and "no reduce-scatter" in got["one_rank"], got["one_rank"]
    assert "no trainable parameter" in got["frozen"], got["frozen"]
    # FSDP beside TP is refused (each data-parallel group would judge alone) but is not HSDP
    assert "2-D mesh" in got["tp"] and "HSDP" not in got["tp"], got["tp"]
    assert got["plain"].startswith("InvalidType: model=Sequential is not fully_shard'ed")
    assert "HSDP" in got["hsdp"] and "2-D mesh" in got["hsdp"] and "would go unwatched" in got["hsdp"]
    assert "TruncatingReduceScatter" in got["custom_set"] and "no public getter" in got["custom_set"]
    assert "reduce_scatter=comm" in got["custom_set"]
    assert "all-reduce hook" in got["all_reduce_hook"]
    assert "not managed by fully_shard" in got["partial"] and "'3.weight'" in got["partial"]
    assert "already attached" in got["twice"]
    assert got["ok"] == ""
    # fully_shard([a, b]): one reduce-scatter for both, so one comm and one stream named for
    # both (it was two comms, the first never run, and the stream named for the last alone)
    assert got["grouped"] == "0+3", got["grouped"]


@pytest.mark.slow
def test_a_module_whose_reduce_scatter_changes_size_keeps_its_stream():
    """The root holds a Linear used on odd steps only, so its reduce-scatter alternates
    between two sizes (FSDP reduces only parameters with a gradient). That is one module's
    stream, not a re-layout: its samples are kept and judged (a truncating comm: biased).
    It was reset at every change of size, left with one sample: "cannot judge"."""
    out = launch(fsdp_branch_task, 2, args=("truncating", 20), timeout=180)[0]
    final = {r.target: r for r in map(Result.from_json, out["results"])}
    root = final["watch:fsdp2[TruncatingReduceScatter].module:<root>"]
    assert out["relayouts"] == 0
    assert root.verdict == "fail" and root.metrics["trials"] >= 19, (root.verdict, root.metrics)


@pytest.mark.slow
def test_a_reduce_scatter_replaced_after_attach_is_not_judged_a_pass():
    """After 10 clean steps every module's comm is replaced (set_custom_reduce_scatter with
    a truncating comm, behind the sentinel's back): the 20 steps after it go unwatched, so
    the sentinel says it cannot judge them, naming the comm, instead of a pass on the
    first 10 steps alone."""
    runs = [{"reduce": "fp32", "steps": 30, "watch": True, "replace_at": 10,
             "sentinel_kwargs": {"sample": 1.0, "interval": 5}}]
    got = launch(fsdp_runs_task, 2, args=(runs,), timeout=180)[0][0]
    res = [Result.from_json(x) for x in got["results"]]
    lost = [r for r in res if r.verdict == "error" and "replaced" in r.message]
    assert lost and "TruncatingReduceScatter" in lost[0].message and "step 10" in lost[0].message, \
        [r.message for r in res]


@pytest.mark.slow
def test_a_failure_on_one_rank_skips_that_sample_on_every_rank():
    """Rank 1's copy of its 2nd and 5th samples raises: rank 1 still issues the fp64
    reduction (with its flag), so both ranks leave exactly those samples out and pair every
    other one right: the fp32 run stays clean, bit for bit as without the sentinel."""
    kw = {"sample": 1.0, "interval": 5}
    runs = [{"reduce": "fp32", "steps": 20, "watch": w, "sentinel_kwargs": kw,
             "break_takes": {1: [1, 4]}} for w in (False, True)]
    out = launch(fsdp_runs_task, 2, args=(runs,), timeout=180)
    for r, (plain, watched) in enumerate(out):
        assert _same(plain, watched), f"rank {r}"
        assert watched["skipped"] == 2, f"rank {r}: {watched['skipped']}"
    assert out[0][1]["own_errors"] == 0 and out[1][1]["own_errors"] == 2
    res = {r.target: r for r in map(Result.from_json, out[0][1]["results"])}
    pooled = res["watch:fsdp2[DefaultReduceScatter].all_buckets"]
    assert pooled.verdict == "pass" and pooled.metrics["trials"] == 18
    assert pooled.evidence["skipped_samples"] == 2 and abs(pooled.metrics["bias"]) < 1e-7


@pytest.mark.slow
def test_lightning_callback_attaches_to_a_fully_shard_model():
    """Lightning 2.6.6 ModelParallelStrategy (fully_shard in configure_model), 2 gloo ranks,
    CPU: SentinelLightning attaches with attach_fsdp2; fp32 is clean and a truncating
    reduce-scatter given to the callback is biased by step 30; the logger gets the numbers."""
    pytest.importorskip("lightning")
    runs = [{"reduce": "fp32", "steps": 30}, {"reduce": "truncating", "steps": 30}]
    clean, trunc = launch(lightning_fsdp_runs_task, 2, args=(runs,), timeout=300)[0]
    final = {r.target: r for r in map(Result.from_json, clean["results"])}
    pooled = final["watch:fsdp2[DefaultReduceScatter].all_buckets"]
    assert pooled.verdict == "pass" and pooled.metrics["trials"] >= 3
    assert not [r.message for r in final.values() if r.verdict == "fail"]
    assert clean["logged"]["sentinel/step"] == 30 and clean["logged"]["sentinel/biased"] == 0
    fails = [r for r in map(Result.from_json, trunc["results"]) if r.verdict == "fail"]
    assert fails and fails[0].target.startswith("watch:fsdp2[TruncatingReduceScatter].")
    assert fails[0].evidence["found_at_step"] <= 30 and trunc["logged"]["sentinel/biased"] == 1
