"""The router, update and GEMM watches beside the bucket sentinel, all on at once, on real
DDP gloo ranks (torch 2.13 CPU): no bit of the run changes, no global generator is drawn,
and the ranks agree on every verdict."""
import pytest
import torch
from trainprobes.distributed.launcher import launch
from trainprobes.result import Result
from trainprobes.watch.demo_watches import watches_task


def _same(a, b) -> bool:
    return (torch.equal(a["losses"], b["losses"]) and a["weights"].keys() == b["weights"].keys()
            and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
            and torch.equal(a["rng"]["torch"], b["rng"]["torch"])
            and torch.equal(a["rng"]["numpy"], b["rng"]["numpy"])
            and a["rng"]["numpy_rest"] == b["rng"]["numpy_rest"]
            and a["rng"]["python"] == b["rng"]["python"]
            and a["rng"]["python_rest"] == b["rng"]["python_rest"])


def _final(run) -> dict:
    """target -> the last Result for it (close() writes the final one last)."""
    return {Result.from_json(x).target: Result.from_json(x) for x in run["results"]}


@pytest.mark.slow
def test_all_watches_on_ddp_ranks_change_no_bit_and_the_ranks_agree():
    """8 AdamW steps of a MoE LM on 2 gloo ranks, the batch drawn from numpy's global generator,
    its crop from python's, dropout from torch's; the bucket sentinel (every bucket), the router
    watch (every 2 steps), the update watch and the GEMM watch (one Linear's three GEMMs every
    step, exact operands on an fp32 accumulator) all on: losses, weights and all three global
    generators bitwise as without them. Bucket and update verdicts are judged on numbers
    every rank holds alike (the reduced gradients, the replicated weights): equal to the bit.
    Router and GEMM verdicts are judged on each rank's own micro-batch and operands (DDP
    shares gradients, not activations): the same verdict on each rank. A router switched to
    expert choice at step 3 is caught at the next check (step 4) on both ranks; bf16 weights
    at lr 1e-5 (updates stall) are called biased on both ranks, to the same bit."""
    runs = [{"watch": False}, {"watch": True}, {"watch": True, "switch_at": 3},
            {"watch": True, "dtype": "bfloat16", "lr": 1e-5, "steps": 10}]
    out = launch(watches_task, 2, args=(runs,), timeout=600)
    for r, rank in enumerate(out):
        assert _same(rank[0], rank[1]), f"rank {r}: the watches changed the run"
        assert rank[1]["own_errors"] == [] and rank[2]["own_errors"] == [], f"rank {r}"
    v0, v1 = _final(out[0][1]), _final(out[1][1])
    assert v0.keys() == v1.keys()
    kinds = {t.split("[")[0] for t in v0}
    assert kinds == {"watch:ddp", "watch:router", "watch:updates", "watch:gemm"}, kinds
    for t, a in v0.items():
        b = v1[t]
        assert a.verdict == b.verdict == "pass", (t, a.message, b.message)
        if t.startswith(("watch:ddp", "watch:updates")):  # numbers alike on every rank
            assert a.metrics == b.metrics, t
    assert v0["watch:router[moe.router]"].metrics["causal_checks"] == 4  # steps 0, 2, 4, 6
    assert v0["watch:updates[AdamW].all_groups"].metrics["trials"] == 8
    assert sum(r.metrics["checks"] for t, r in v0.items() if t.endswith(".wgrad")) == 8
    assert v0["watch:ddp[allreduce_hook].all_buckets"].metrics["trials"] >= 8
    for rank in out:
        router = _final(rank[2])["watch:router[moe.router]"]
        assert router.verdict == "fail" and router.codes == ["TP-C1"], router.message
        assert router.metrics["first_noncausal_step"] == 4 and router.metrics["causal_checks"] == 2
    bf16 = [_final(rank[3])["watch:updates[AdamW].all_groups"] for rank in out]
    assert bf16[0].verdict == "fail" and bf16[0].codes == ["TP-B1"], bf16[0].message
    assert bf16[0].metrics == bf16[1].metrics and bf16[0].metrics["stalled_share"] > 0.9
    assert bf16[0].evidence["found_at_step"] == bf16[1].evidence["found_at_step"] == 4  # the first look with 3 samples
