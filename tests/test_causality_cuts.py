"""trainprobes.causality.cuts: out-of-memory told by exception type (the chunk halves), any
other refusal of a bigger batch stops packing, and packing finds what calls alone find."""
import pytest
import torch
from trainprobes.causality import check
from trainprobes.causality.cuts import out_of_memory
from trainprobes.errors import TargetError
from trainprobes.reference import routing as r

X = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(0))
OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def refuses_over(rows, error):
    def fn(x):
        if x.shape[0] > rows:
            raise error(f"CUDA out of memory. Tried to allocate a batch of {x.shape[0]}")
        return r.expert_choice(x)[0]
    return fn


def _wrapped(e):
    try:
        try:
            raise e
        except Exception as inner:
            raise TargetError("target raised") from inner
    except TargetError as outer:
        return outer


def test_out_of_memory_is_told_by_type_not_by_text():
    assert out_of_memory(_wrapped(OOM("x")))
    assert out_of_memory(_wrapped(MemoryError()))
    assert not out_of_memory(_wrapped(RuntimeError("CUDA out of memory")))


def test_out_of_memory_halves_the_chunk_and_packing_goes_on():
    alone = check(refuses_over(2, OOM), X, cuts="all", pack=False, max_leaks=10_000)
    res = check(refuses_over(20, OOM), X, cuts="all", max_leaks=10_000)
    assert res.metrics["packed"] is True and res.evidence["packing_error"] is None
    assert res.evidence["leaks"] == alone.evidence["leaks"] and res.metrics["n_leaks"] > 0


def test_a_refusal_that_only_mentions_memory_stops_packing():
    res = check(refuses_over(4, RuntimeError), X, cuts="all")  # halving would fit
    assert res.metrics["packed"] is False and "out of memory" in res.evidence["packing_error"]
    assert res.metrics["causal"] is False


@pytest.mark.parametrize("fn", [r.expert_choice, r.sequence_normalized, r.topk_softmax])
def test_packed_and_alone_agree_on_every_leak(fn):
    kw = dict(cuts="all", decision=0, scores=1, max_leaks=10_000)
    packed, alone = check(fn, X, **kw), check(fn, X, pack=False, **kw)
    assert packed.metrics["packed"] is True and alone.metrics["packed"] is False
    for key in ("leaks", "score_leaks", "leak_map"):
        assert packed.evidence[key] == alone.evidence[key]
