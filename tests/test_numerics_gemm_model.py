"""trainprobes.numerics.gemm_model: a model's Linear GEMMs from one fp32 step."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.gemm_model import capture_linears, judge_model


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (4, 128))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.slow
def test_tiny_llama_names_the_weight_gradient_gemms_riskiest():
    model, batch = _llama()
    rows = judge_model(model, batch, preset="h200-scaled-mm", samples=128, trials=16)
    gemms = [r.metrics["gemm"] for r in rows]
    assert set(gemms) == {"fprop", "dgrad", "wgrad"}
    assert gemms[0] == "wgrad", [r.target for r in rows[:5]]
    risk = {g: sum(abs(r.evidence["accumulator_bias"]) for r in rows if r.metrics["gemm"] == g)
            / gemms.count(g) for g in set(gemms)}
    assert risk["wgrad"] > 1.5 * max(risk["fprop"], risk["dgrad"]), risk
    top = rows[0]
    assert top.metrics["k"] == 4 * 128 and top.evidence["layer"] in top.target


def test_capture_matches_the_linear():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    (c,) = capture_linears(torch.nn.Sequential(lin), x)
    assert c.x.shape == (15, 8) and c.dy.shape == (15, 4)
    assert torch.allclose(c.x.float(), x.reshape(15, 8))


def test_a_model_with_no_linear_is_refused():
    with pytest.raises(InvalidArgument, match="no torch.nn.Linear"):
        judge_model(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(2, 3))


class _TwoHeads(torch.nn.Module):
    """One Linear on the loss's path, one off it, one fed all zeros."""

    def __init__(self):
        super().__init__()
        self.used, self.unused, self.dead = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        self.unused(x.detach())
        return self.used(x) + self.dead(torch.zeros_like(x))


def test_skipped_linears_and_zero_gemms_are_listed_with_the_reason():
    torch.manual_seed(0)
    rows = judge_model(_TwoHeads(), torch.randn(4, 16, 16), samples=64, trials=8)
    skipped = rows[0].evidence["skipped"]
    assert {"layer": "unused", "gemm": "all"}.items() <= skipped[0].items(), skipped
    assert any(s["layer"] == "dead" and "all-zero" in s["reason"] for s in skipped), skipped
    assert {r.evidence["layer"] for r in rows} >= {"used"}


def test_a_nan_weight_names_the_layer():
    lin = torch.nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    with pytest.raises(InvalidArgument, match="layer '0'"):
        judge_model(torch.nn.Sequential(lin), torch.randn(4, 16, 16), samples=64, trials=8)
