"""Per-stage localisation by activation patching (trainprobes.drift.localize): injected faults
in tiny HF models of several families are found at their block and op, the first and the
last block included; identical engines are exact; eager vs sdpa in fp32 blames nothing."""
import copy

import pytest
import torch
from trainprobes.drift import faults
from trainprobes.drift.engines import Engine, role_of
from trainprobes.drift.localize import localize_layers
from trainprobes.errors import InvalidArgument

pytest.importorskip("transformers")
from trainprobes.isolation.hf import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))


def _pair(family, fault=None, layers=3, seed=0):
    a = tiny_model(family, "eager", seed=seed, num_hidden_layers=layers)
    b = copy.deepcopy(a)
    if fault is not None:
        fault(b)
    return Engine(a, name="trainer"), Engine(b, name="engine")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen2_moe"])
def test_noise_blames_no_layer(family):
    a = tiny_model(family, "eager", seed=2, num_hidden_layers=3)
    b = tiny_model(family, "sdpa", seed=2, num_hidden_layers=3)
    loc = localize_layers(Engine(a), Engine(b), IDS)
    assert loc.first_layer is None and loc.op is None
    assert all(r.verdict in ("exact", "noise") for r in loc.stages)
    assert any(r.verdict == "noise" for r in loc.stages)  # sdpa and eager do differ


def test_identical_engines_are_exact():
    t, e = _pair("llama")
    loc = localize_layers(t, e, IDS)
    assert loc.first_layer is None
    assert all(r.verdict == "exact" and r.own_error == 0 for r in loc.stages)


@pytest.mark.parametrize("family, block, fault, op, module", [
    ("llama", 0, lambda m: faults.in_dtype(m.model.layers[0].mlp, torch.bfloat16), "mlp", ".mlp"),
    ("llama", 2, lambda m: faults.in_dtype(m.model.layers[2].mlp, torch.bfloat16), "mlp", ".mlp"),
    ("qwen2", 1, lambda m: faults.norm_epsilon(m.model.layers[1].post_attention_layernorm, 1e-3),
     "norm", ".post_attention_layernorm"),
    ("mistral", 2, lambda m: faults.norm_epsilon(m.model.layers[2].input_layernorm, 1e-3),
     "norm", ".input_layernorm"),
    ("llama", 2, lambda m: faults.stale(m.model.layers[2].self_attn.v_proj.weight), "attention",
     ".self_attn"),
    ("qwen2", 0, lambda m: faults.in_dtype(m.model.layers[0].self_attn, torch.bfloat16), "attention",
     ".self_attn"),
    ("qwen2_moe", 1, lambda m: faults.in_dtype(m.model.layers[1].mlp.gate, torch.bfloat16), "router",
     ".mlp.gate"),
])
def test_fault_found_at_its_block_and_op(family, block, fault, op, module):
    t, e = _pair(family, fault)
    loc = localize_layers(t, e, IDS)
    assert loc.first_layer == f"model.layers.{block}"
    assert loc.op == op and loc.op_module == f"model.layers.{block}{module}"
    blamed = [r.name for r in loc.stages if r.verdict == "beyond"]
    assert blamed == [f"model.layers.{block}"]  # later blocks only carry it: no own error
    later = [r for r in loc.stages if r.block is not None and r.block > block]
    assert all(r.free_error > 0 for r in later)


def test_fault_outside_the_blocks():
    t, e = _pair("llama", lambda m: faults.norm_epsilon(m.model.norm, 1e-2))
    loc = localize_layers(t, e, IDS)
    assert loc.first_layer == "model.norm" and loc.op == "norm"


def _only_where(module, hit):
    """A module whose output is rounded to bf16 where hit(args, out) [B, L] holds: a fault only
    some tokens or sequences meet."""
    def post(m, args, out):
        return torch.where(hit(args, out)[..., None], out.bfloat16().float(), out)
    module.register_forward_hook(post)


@pytest.mark.parametrize("where, stage, op", [
    # one token id's embedding row rounded: the sequences without that id are bit-exact there
    ("token", "model.embed_tokens", "embedding"),
    # one batch slot (row 0) of an MLP in bf16: a single sequence of six carries the fault
    ("row", "model.layers.1", "mlp"),
])
def test_fault_only_some_sequences_meet_is_found(where, stage, op):
    tok = int(IDS[3, 5])
    if where == "token":
        fault = lambda m: _only_where(m.model.embed_tokens, lambda a, o: a[0] == tok)  # noqa: E731
    else:
        def fault(m):
            _only_where(m.model.layers[1].mlp, lambda a, o: (torch.arange(o.shape[0]) == 0)[:, None]
                        .expand(o.shape[:2]))
    t, e = _pair("llama", fault)
    loc = localize_layers(t, e, IDS)
    assert loc.first_layer == stage and loc.op == op
    row = next(r for r in loc.stages if r.name == stage)
    assert row.max_ratio > 8.0 ** 2 and row.verdict == "beyond"


def test_layer_count_and_names_must_match():
    a = tiny_model("llama", num_hidden_layers=2)
    b = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(InvalidArgument, match="2 blocks and the engine 3"):
        localize_layers(Engine(a, name="trainer"), Engine(b, name="engine"), IDS)


@pytest.mark.parametrize("rows", [1, 3])
def test_fewer_than_four_sequences_are_cut_into_spans(rows):
    """With 1-3 sequences the units are spans of tokens (trainprobes.drift.units): a bf16 MLP
    is still found beyond noise, the identical stages stay exact."""
    def bf16_mlp(m):
        faults.in_dtype(m.model.layers[1].mlp, torch.bfloat16)
    t, e = _pair("llama", bf16_mlp)
    loc = localize_layers(t, e, IDS[:rows])
    assert (loc.first_layer, loc.op) == ("model.layers.1", "mlp")
    assert {r.name: r.verdict for r in loc.stages}["model.layers.0"] == "exact"


def test_a_single_sequence_too_short_for_two_spans_is_refused():
    t, e = _pair("llama")
    with pytest.raises(InvalidArgument, match="L >= 5"):
        localize_layers(t, e, IDS[:1, :4])


def test_a_repeated_sequence_is_refused():
    """Copies of one rollout were the way to reach 4 sequences; they made identical units and
    zero-width intervals."""
    t, e = _pair("llama")
    with pytest.raises(InvalidArgument, match="rows 0 and 1 are the same sequence"):
        localize_layers(t, e, IDS[:1].repeat(4, 1))


def test_nonfinite_activation_named_by_layer():
    def poison(m):
        m.model.layers[1].mlp.down_proj.weight.data[0, 0] = float("inf")
    t, e = _pair("llama", poison)
    with pytest.raises(InvalidArgument, match=r"engine's 'model.layers.1.*non-finite"):
        localize_layers(t, e, IDS)


@pytest.mark.parametrize("name, role", [("model.layers.0.mlp.gate", "router"),
                                        ("model.layers.0.mlp.gate_proj", "mlp"),
                                        ("model.layers.0.self_attn", "attention"),
                                        ("model.norm", "norm"), ("lm_head", "lm_head")])
def test_roles(name, role):
    assert role_of(name) == role


def test_engine_wholly_in_bf16_blames_no_stage():
    """Every stage at the engine's nominal precision: bf16 rounding everywhere, no culprit."""
    a = tiny_model("llama", "eager", seed=4, num_hidden_layers=3)
    loc = localize_layers(Engine(a), Engine(copy.deepcopy(a).to(torch.bfloat16)), IDS)
    assert loc.first_layer is None and loc.u == 2.0 ** -8
    assert all(r.verdict == "noise" for r in loc.stages)


def test_padding_is_left_out_and_fault_still_found():
    am = torch.ones(IDS.shape, dtype=torch.long)
    am[0, 10:] = 0
    am[4, 6:] = 0
    t, e = _pair("llama", lambda m: faults.in_dtype(m.model.layers[2].mlp, torch.bfloat16))
    assert localize_layers(t, e, IDS, am).first_layer == "model.layers.2"
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    b = tiny_model("llama", "sdpa", seed=0, num_hidden_layers=3)
    assert localize_layers(Engine(a), Engine(b), IDS, am).first_layer is None


def test_tokenizer_mismatch_is_named():
    a = tiny_model("llama", num_hidden_layers=2)
    b = tiny_model("llama", num_hidden_layers=2, vocab_size=256)
    with pytest.raises(InvalidArgument, match="128 ids and the engine's 256"):
        localize_layers(Engine(a), Engine(b), IDS)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        localize_layers(Engine(a), Engine(copy.deepcopy(a)), IDS + 200)


def _hf(cfg_name, model_name, **extra):
    import transformers as tf
    cfg = getattr(tf, cfg_name)(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                max_position_embeddings=256, **extra)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = getattr(tf, model_name)(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30)  # tied in Gemma: the embedding grows too, the stream is large
    return m


@pytest.mark.parametrize("family, fault, block, op, module", [
    (("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
     lambda m: faults.norm_epsilon(m.model.layers[1].post_attention_layernorm, 1e-2), 1, "norm",
     ".post_attention_layernorm"),
    (("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
     lambda m: faults.in_dtype(m.model.layers[2].mlp, torch.bfloat16), 2, "mlp", ".mlp"),
    (("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
     lambda m: faults.norm_epsilon(m.model.layers[1].self_attn.q_norm, 1e-1), 1, "norm", ".self_attn.q_norm"),
    # an MoE block wholly in bf16 is the MLP (router and experts both beyond), not the router
    (("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 16, "num_experts_per_tok": 2}),
     lambda m: faults.in_dtype(m.model.layers[2].mlp, torch.bfloat16), 2, "mlp", ".mlp"),
])
def test_families_the_demo_does_not_use(family, fault, block, op, module):
    cfg, cls, extra = family
    a = _hf(cfg, cls, **extra)
    b = copy.deepcopy(a)
    fault(b)
    ids = torch.randint(0, 128, (6, 20), generator=torch.Generator().manual_seed(5))
    loc = localize_layers(Engine(a), Engine(b), ids)
    assert (loc.first_layer, loc.op, loc.op_module) == (f"model.layers.{block}", op,
                                                       f"model.layers.{block}{module}")


class _Autocast(torch.nn.Module):
    """A model whose forward enters bf16 autocast around the HF model (mixed-precision
    inference): the blocks' GEMMs run in bf16 only inside this forward."""

    def __init__(self, m, on):
        super().__init__()
        self.m, self.on = m, on

    def forward(self, input_ids, attention_mask=None):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.on):
            return self.m(input_ids, attention_mask=attention_mask, use_cache=False).logits.float()


def test_ops_rerun_under_the_autocast_the_engine_ran_them_in():
    """The op level calls the first block alone: outside the engine's forward, so without its
    autocast unless the recorded state is re-entered (else every op is exact and the op is
    blamed on "block")."""
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    loc = localize_layers(Engine(_Autocast(a, False)), Engine(_Autocast(copy.deepcopy(a), True)), IDS)
    assert loc.first_layer == "m.model.layers.0"
    assert loc.op in ("attention", "mlp") and loc.op_module.startswith("m.model.layers.0.")
    found = {r.name: r for r in loc.ops}
    assert found[loc.op_module].verdict == "beyond" and found[loc.op_module].own_error > 1e-4
    assert not torch.is_autocast_enabled("cpu")  # the context is left behind


def test_unknown_nominal_dtype_is_refused_not_guessed():
    a = tiny_model("llama", num_hidden_layers=2)
    b = copy.deepcopy(a).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidArgument, match=r"float8_e4m3fn.*pass u="):
        localize_layers(Engine(a), Engine(b), IDS)
    with pytest.raises(InvalidArgument, match="not a unit roundoff"):
        localize_layers(Engine(a), Engine(copy.deepcopy(a)), IDS, u=2.0)


def _gpt2():
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("fault", ["positions off by one", "position embedding in bf16"])
def test_fault_in_the_code_between_stages_is_found_at_the_hand_off(fault):
    """GPT-2 adds its position embedding (not a stage: one row for the batch) in the model's
    forward: every stage was exact and the engine 'noise' with a free error of 1.03."""
    from trainprobes.drift.decompose import localize
    a = _gpt2()
    b = copy.deepcopy(a)
    if fault == "positions off by one":
        b.transformer.wpe.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    else:
        faults.in_dtype(b.transformer.wpe, torch.bfloat16)
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), IDS)
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"], m["op_module"]) == (
        "numeric", "into transformer.drop", "hand_off", "transformer.drop")
    assert [s["name"] for s in r.evidence["stages"] if s["verdict"] == "beyond"] == ["into transformer.drop"]
    assert m["share_numerics[into transformer.drop]"] > 0.9


def test_identical_glue_leaves_every_hand_off_exact():
    t, e = _pair("llama", lambda m: faults.in_dtype(m.model.layers[1].mlp, torch.bfloat16))
    loc = localize_layers(t, e, IDS)
    hand = [r for r in loc.stages if r.role == "hand_off"]
    assert [r.name for r in hand] == ["into model.layers.0", "into model.layers.1", "into model.layers.2",
                                      "into model.norm", "into lm_head"]
    assert all(r.verdict == "exact" for r in hand) and loc.first_layer == "model.layers.1"


def test_two_faults_are_both_named_with_their_shares():
    """A small fault first, a large one later: the message named only the first, whose share is
    ~0, while the later stage carried the drift."""
    from trainprobes.drift.decompose import localize

    def two(m):
        faults.in_dtype(m.model.layers[0].mlp, torch.bfloat16)
        faults.norm_epsilon(m.model.layers[2].input_layernorm, 1e-3)
    t, e = _pair("llama", two)
    r = localize(t, e, IDS)
    assert r.metrics["first_layer"] == "model.layers.0"
    assert r.metrics["share_numerics[model.layers.2]"] > 0.9
    assert "also beyond noise: model.layers.2 (numerics " in r.message
