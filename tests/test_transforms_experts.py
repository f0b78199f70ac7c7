"""trainprobes.transforms.experts: expert parallelism as a built-in on 2 gloo ranks, tokens
sent to their expert's rank and back with all_to_all_single (reference.expert_parallel):
equivalent with the token-weighted split, biased with a mean of means over uneven
documents; a model without a MoE layer, or with experts that do not split, is refused."""
import functools

import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.bugs import data
from trainprobes.reference.bugs import expert_parallel as ep
from trainprobes.transforms import ExpertParallel, Probe, run_probes
from trainprobes.transforms.registry import parse_transform
from trainprobes.transforms.step import TrainingStep

pytestmark = pytest.mark.usefixtures("one_torch_thread")
UNEVEN = data.Layout((2, 2, 2, 2, 4, 4, 4, 4), (3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0), positions=4)
STEP = TrainingStep(model=ep.model, batch=functools.partial(data.documents, UNEVEN), loss=data.loss,
                    tokens=data.tokens, name="moe")


@pytest.mark.slow
def test_experts_over_ranks_are_equivalent_token_weighted_and_biased_as_a_mean_of_means():
    ok, bug = run_probes([Probe(STEP, ExpertParallel(), trials=8, seed=1),
                          Probe(STEP, ExpertParallel(normalization="mean-of-means"), trials=8, seed=1)], world=2)
    assert ok.metrics["transform_verdict"] == "noise", ok.message
    table = {p["parameter"]: p["ranks"] for p in ok.evidence["parameters"]}
    assert table["experts.0.weight"] == [0] and table["experts.3.weight"] == [1]  # each from its owner
    assert table["proj.weight"] == [0, 1]
    assert bug.metrics["transform_verdict"] == "biased"


def test_what_expert_parallelism_cannot_split_is_refused():
    batch = STEP.batch(torch.Generator().manual_seed(0))
    with pytest.raises(InvalidArgument, match=r"found no MoE layer"):
        ExpertParallel().check(STEP, 2, batch, data.mlp())
    with pytest.raises(InvalidArgument, match=r"expert counts not divisible by world=3"):
        ExpertParallel().check(STEP, 3, data.documents(data.full(6, 4), torch.Generator()), ep.model())
    assert parse_transform("ep") == ExpertParallel()
