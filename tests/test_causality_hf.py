"""Real library routers (transformers), probed as a user would: verdicts from the mechanism."""
import pytest
import torch
from trainprobes.causality import check

switch = pytest.importorskip("transformers.models.switch_transformers.modeling_switch_transformers")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
from transformers import MixtralConfig, SwitchTransformersConfig  # noqa: E402

X = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["perturb", "truncate"])
def test_switch_router_with_fixed_capacity_is_causal(mode):
    """Switch Transformers grants expert slots by a cumsum over positions and a fixed
    expert_capacity: tokens are dropped (here about a third), but never because of later ones."""
    torch.manual_seed(0)
    cfg = SwitchTransformersConfig(d_model=32, num_experts=8, expert_capacity=3,
                                   router_jitter_noise=0.0)
    router = switch.SwitchTransformersTop1Router(cfg).eval()
    dispatch = router(X)[0]
    assert (dispatch.sum(-1) == 0).any()  # capacity binds: the test is not vacuous
    res = check(router, X, mode=mode, cuts="all", decision=0, scores=2)
    assert res.verdict == "pass" and res.metrics["causal"] is True


def test_switch_router_made_to_drop_by_probability_is_leaky():
    """The same router, slots granted by router probability instead of position: leaky."""
    torch.manual_seed(0)
    cfg = SwitchTransformersConfig(d_model=32, num_experts=8, expert_capacity=3,
                                   router_jitter_noise=0.0)
    router = switch.SwitchTransformersTop1Router(cfg).eval()

    def by_probability(x):
        one_hot, probs, logits = router(x)
        chosen = logits.softmax(-1).argmax(-1)
        p = logits.softmax(-1).amax(-1)
        # rank of each token among those that chose its expert, most probable first
        same = chosen[:, :, None] == chosen[:, None, :]
        rank = (same & (p[:, None, :] > p[:, :, None])).sum(-1)
        return torch.where(rank < 3, chosen, -1), logits

    res = check(by_probability, X, cuts="all", decision=0, scores=1)
    assert res.metrics["causal"] is False and "TP-C1" in res.codes


def test_mixtral_gate_in_flat_layout_and_block():
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=8,
                        num_experts_per_tok=2)
    block = mixtral.MixtralSparseMoeBlock(cfg).eval()
    # built alone, the block's weights are never initialised (torch.empty; a PreTrainedModel
    # would run _init_weights): its output was NaN, and NaN never flips
    for p in block.parameters():
        torch.nn.init.normal_(p, std=cfg.initializer_range)
    assert block(X).isfinite().all()
    # the gate takes the flattened token list [T, D] and returns (logits, weights, ids)
    res = check(block.gate, X[0], layout="flat", cuts="all", decision=2, scores=0)
    assert res.verdict == "pass" and res.evidence["layout"] == "flat"
    res = check(block, X, mode="truncate", cuts=[3, 17, 30])
    assert res.metrics["causal"] is True and res.verdict == "pass"
