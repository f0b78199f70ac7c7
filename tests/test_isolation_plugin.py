"""The plugin's isolation helpers, called as a test would (in-process, on a real fixture)."""
import pytest
import torch
from trainprobes.isolation.controls import (
    VOCAB,
    block_diagonal,
    causal_over_row,
    exact_matmul,
    integer_rows,
    split_by_batch,
)
from trainprobes.pytest_plugin import Recorder, TrainProbes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

X = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def tp(request):
    return TrainProbes(request, Recorder())


def test_assert_documents_isolated(tp):
    r = tp.assert_documents_isolated(block_diagonal(), X, [5, 7], vocab=VOCAB, causal=False)
    assert r.metrics["isolated"] is True and tp.results == [r]
    with pytest.raises(pytest.fail.Exception, match="packed documents not isolated"):
        tp.assert_documents_isolated(causal_over_row(), X, [5, 7], vocab=VOCAB, causal=False)


def test_assert_batch_invariant(tp):
    tp.assert_batch_invariant(exact_matmul, integer_rows(), sizes=(2, 3))
    with pytest.raises(pytest.fail.Exception, match="(?s)batch-variant.*TP-I2"):
        tp.assert_batch_invariant(split_by_batch, integer_rows(), sizes=(2,))
    assert len(tp.results) == 2 and tp.results[1].metrics["batch_invariant"] is False
