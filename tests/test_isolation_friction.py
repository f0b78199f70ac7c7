"""Isolation friction (issue 22, item 5): sliding-window models whose documents fit the
window take one mask (and mixed full/sliding models a mask per layer type); the automatic
fp64 twin of a model with grouped_mm experts swaps them for the eager loop, or says how to
pass a twin; the CLI takes the user's tokens and twin."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from trainprobes.cli import main  # noqa: E402
from trainprobes.isolation import documents  # noqa: E402
from trainprobes.isolation.hf import PackedModel, tiny_model  # noqa: E402
from trainprobes.zoo.shrink import build  # noqa: E402


@pytest.mark.parametrize("lengths", [(6, 5, 7), (10, 12, 8)])
@torch.no_grad()
def test_mixed_sliding_model_takes_one_mask_or_one_per_layer_type(lengths):
    model = build("gemma2", attn_implementation="eager").model       # window 8, full + sliding
    assert len(set(model.config.layer_types)) == 2
    L = sum(lengths)
    x = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(0))
    r = documents(PackedModel(model, "mask_4d"), x, list(lengths), vocab=128, causal=False)
    assert r.metrics["isolated"] is True, r.message


class _Wrapped(torch.nn.Module):
    """A user's own module around a HF MoE model: the probe's automatic twin path.

    Grouped expert matmuls move other documents by ulps on some CPUs and not on others (the
    group sizes change the kernel's blocking where it has one): the wrapper scales every
    logit by 1 + k eps, k set by the whole row's tokens, so each machine sees the rounding-size
    coupling that only a float64 twin can excuse (in float64 the same term is 1e-16 small)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, packing):
        logits = self.model(input_ids=tokens, position_ids=packing.position_ids(), use_cache=False).logits
        k = 4 + int(tokens.sum()) % 5
        return logits * (1 + k * torch.finfo(logits.dtype).eps)


@torch.no_grad()
def test_automatic_twin_swaps_grouped_mm_experts():
    model = tiny_model("qwen2_moe", "sdpa")
    assert model.config._experts_implementation not in (None, "eager")
    x = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    r = documents(_Wrapped(model), x, [10, 12, 8], vocab=128, causal=False)
    assert r.metrics["isolated"] is True
    assert "experts" in r.metrics["fp64"] and "eager" in r.metrics["fp64"]


def test_a_twin_that_cannot_be_built_says_how():
    class Broken(_Wrapped):
        def double(self):
            raise RuntimeError("no float64 kernel")
    x = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    # grouped expert matmuls move other documents by ulps: only a twin can excuse that
    r = documents(Broken(tiny_model("qwen2_moe", "sdpa")), x, [10, 12, 8], vocab=128, causal=False)
    assert r.metrics["n_unverified"] > 0 and r.metrics["isolated"] is None
    assert "no float64 kernel" in r.metrics["fp64"] and "--fp64 PKG.MOD:FN" in r.metrics["fp64"]


def test_cli_takes_tokens_and_a_twin(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tokens.pt"
    torch.save(torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1)), path)
    (tmp_path / "mytwin.py").write_text(
        "import copy\nfrom trainprobes.isolation.hf import PackedModel, tiny_model\n"
        "_m = PackedModel(tiny_model('llama', 'sdpa').double(), 'flattening')\n"
        "def twin(tokens, packing):\n    return _m(tokens, packing)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["isolation", "documents", "--hf", "llama", "--convention", "flattening",
                 "--tokens", str(path), "--fp64", "mytwin:twin", "--no-causal", "--json"])
    assert code == 1                                                 # the cached call leaks
    out = capsys.readouterr().out
    assert '"fp64": "used"' in out
    bad = tmp_path / "bad.pt"
    torch.save(torch.randn(3, 30), bad)
    assert main(["isolation", "documents", "--hf", "llama", "--tokens", str(bad)]) == 2


@torch.no_grad()
def test_a_naive_twin_module_gets_its_grouped_mm_experts_swapped():
    # deepcopy(model).double() of grouped_mm experts fails in float64: done for the user
    import copy
    model = tiny_model("qwen2_moe", "sdpa")
    x = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    r = documents(_Wrapped(model), x, [10, 12, 8], vocab=128, causal=False,
                  fp64=_Wrapped(copy.deepcopy(model).double()))
    assert r.metrics["isolated"] is True and r.verdict == "pass"
    assert r.metrics["fp64"] == "used (substituted: experts: grouped_mm -> eager)"


@torch.no_grad()
def test_a_naive_twin_function_says_the_grouped_mm_fix_in_the_message():
    import copy
    model = tiny_model("qwen2_moe", "sdpa")
    twin = _Wrapped(copy.deepcopy(model).double())
    x = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    r = documents(_Wrapped(model), x, [10, 12, 8], vocab=128, causal=False,
                  fp64=lambda t, p: twin(t, p))
    assert r.metrics["isolated"] is None                      # unknown, never a pass
    assert "_experts_implementation = 'eager'" in r.message and "grouped_mm" in r.message
