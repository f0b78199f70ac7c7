"""trainprobes.transforms.context: context parallelism as a built-in on 2 gloo ranks, a real
causal attention over all-gathered keys and values (reference.context_parallel): the
token-weighted split is equivalent, a mean of the spans' means over uneven documents is
biased, and the attention's spans are checked against one device."""
import functools

import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.bugs import context, data
from trainprobes.transforms import ContextParallel, Probe, run_probes
from trainprobes.transforms.registry import parse_transform
from trainprobes.transforms.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_torch_thread")
UNEVEN = data.Layout((8, 3, 6, 2), (1.0, 3.0, 1.5, 4.0), positions=8)
STEP = TrainingStep(model=context.model, batch=functools.partial(data.documents, UNEVEN), loss=context.main_loss,
                    tokens=data.tokens, name="attention")


@pytest.mark.slow
def test_a_token_weighted_context_split_is_equivalent_and_a_mean_of_means_is_biased():
    ok, bug = run_probes([Probe(STEP, ContextParallel(), trials=8, seed=1),
                          Probe(STEP, ContextParallel(normalization="mean-of-means"), trials=8, seed=1)], world=2)
    assert ok.metrics["transform_verdict"] == "noise", ok.message
    assert bug.metrics["transform_verdict"] == "biased" and bug.metrics["equivalent"] is False


def test_a_sequence_that_does_not_split_is_refused_before_any_rank():
    batch = data.documents(data.full(4, 7), torch.Generator().manual_seed(0))
    with pytest.raises(InvalidArgument, match=r"the sequence has 7 positions, not divisible by world=2"):
        ContextParallel().check(STEP, 2, batch, None)
    assert parse_transform("cp:normalization=sum") == ContextParallel(normalization="sum")
    assert parse_transform("context-parallel") == ContextParallel()
