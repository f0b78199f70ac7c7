"""Per-stage dumps (trainprobes.drift.dumps): the metadata a dump needs is stated, never
guessed (residual convention, dtype, mask), and real vLLM dumps (vLLM 0.32 CPU build,
scripts/vllm_dumps.py, tests/data/vllm_dumps/) localise against HF transformers run here from
the same saved weights, with vLLM's residual convention handled."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from trainprobes.cli import main
from trainprobes.drift.dumps import compare_dumps, dump_routing, dump_tensors, load_dump
from trainprobes.drift.engines import Engine
from trainprobes.errors import DataFileError

tf = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DATA = Path(__file__).parent / "data"
VLLM = DATA / "vllm_dumps"


def _hf(model: str) -> torch.nn.Module:
    """The HF model vLLM served, from the saved config and weights (fp32, eager attention)."""
    if model.startswith("llama"):
        z = np.load(DATA / "vllm_tiny_llama.npz")
        cfg, cls = tf.LlamaConfig(**json.loads(str(z["config_json"]))), tf.LlamaForCausalLM
        sd = {k[3:]: torch.from_numpy(z[k]) for k in z.files if k.startswith("w__")}
    else:  # bf16 bits, exact in fp32
        z = np.load(DATA / "vllm_tiny_qwen2_moe.npz")
        cfg, cls = tf.Qwen2MoeConfig(**json.loads(str(z["config_json"]))), tf.Qwen2MoeForCausalLM
        sd = {k[3:]: torch.from_numpy(z[k].view(np.int16)).view(torch.bfloat16).float()
              for k in z.files if k.startswith("w__")}
    cfg._attn_implementation = "eager"
    m = cls(cfg).eval()
    m.load_state_dict(sd, strict=True)
    return m


def _write(path, tensors, meta):
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


@pytest.fixture(scope="module")
def hf_dumps(tmp_path_factory):
    """HF's dump of each model on the tokens vLLM ran."""
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for model in ("llama", "qwen2_moe"):
        ids = load_dump(VLLM / f"{model}_float32.safetensors").input_ids
        out[model] = _write(d / f"{model}.safetensors", *dump_tensors(Engine(_hf(model), name="hf"), ids))
    return out


@pytest.mark.parametrize("model", ["llama", "qwen2_moe"])
def test_vllm_fp32_agrees_with_hf_at_every_stage(model, hf_dumps):
    hf, v = load_dump(hf_dumps[model]), load_dump(VLLM / f"{model}_float32.safetensors")
    assert v.convention == "vllm" and hf.convention == "stream"
    rows = compare_dumps(hf, v)
    assert [r.name for r in rows] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                      "lm_head"]
    assert not any(r.divergent for r in rows), [(r.name, r.free_error, r.noise_floor) for r in rows]
    assert rows[0].free_error == 0  # the embedding lookup is exact
    assert 0 < rows[1].free_error < 1e-6  # reduction-order noise, not the residual (~1)
    assert (v.logprobs - hf.logprobs).abs().max() < 1e-5  # vLLM's prompt log-probs
    if model == "qwen2_moe":
        assert dump_routing(hf, v) == {"model.layers.0.mlp.gate": 0.0, "model.layers.1.mlp.gate": 0.0}


def test_reading_vllm_hidden_states_as_the_stream_diverges_at_the_first_layer(hf_dumps, tmp_path):
    """The naive per-layer diff (nnsight #630): hidden_states alone, called the stream."""
    tensors, meta = _read(VLLM / "llama_float32.safetensors")
    naive = _write(tmp_path / "naive.safetensors", {k: v for k, v in tensors.items() if ":residual" not in k},
                   dict(meta, residual_convention="stream"))
    rows = compare_dumps(load_dump(hf_dumps["llama"]), load_dump(naive))
    first = next(r for r in rows if r.divergent)
    assert first.name == "model.layers.0" and first.free_error > 0.1


def test_vllm_norm_epsilon_fault_is_found_at_its_layer(hf_dumps):
    """vLLM served with rms_norm_eps 1e-2 against the model's 1e-6: a real engine with a known
    answer; every layer's input norm changes, the first is in model.layers.0."""
    v = load_dump(VLLM / "llama_eps_float32.safetensors")
    rows = compare_dumps(load_dump(hf_dumps["llama"]), v)
    assert not rows[0].divergent
    assert next(r.name for r in rows if r.divergent) == "model.layers.0"


def test_vllm_bf16_moe_is_noise_and_its_routing_is_reported(hf_dumps):
    """vLLM in bf16 against the fp32 HF model: every stage within the bf16 floor; the routers'
    top-k sets as the data has them (layer 0 agrees everywhere; layer 1 flips a few tokens)."""
    hf, v = load_dump(hf_dumps["qwen2_moe"]), load_dump(VLLM / "qwen2_moe_bfloat16.safetensors")
    rows = compare_dumps(hf, v)
    assert not any(r.divergent for r in rows)
    assert rows[1].noise_floor == pytest.approx(2.0 ** -8 / 3 ** 0.5)
    flips = dump_routing(hf, v)
    assert flips["model.layers.0.mlp.gate"] == 0.0 and 0 < flips["model.layers.1.mlp.gate"] <= 0.05


def test_cli_on_vllm_dumps(hf_dumps, capsys):
    from trainprobes.gate import check_judgeable
    from trainprobes.result import Result

    moe = ["drift", "localize", "--dumps", str(hf_dumps["qwen2_moe"]), str(VLLM / "qwen2_moe_bfloat16.safetensors")]
    assert main([*moe, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["results"][0]
    assert d["metrics"]["routing_mismatch[model.layers.1.mlp.gate]"] > 0
    assert d["evidence"]["residual_convention"] == {"trainer": "stream", "engine": "vllm"}
    check_judgeable(Result.from_dict(d), "candidate")
    assert main(["drift", "localize", "--dumps", str(hf_dumps["llama"]),
                 str(VLLM / "llama_eps_float32.safetensors"), "--json"]) == 1
    m = json.loads(capsys.readouterr().out)["results"][0]["metrics"]
    assert (m["kind"], m["first_layer"]) == ("numeric", "model.layers.0")


@pytest.mark.parametrize("edit, words", [
    (lambda t, m: m.pop("residual_convention"), "state it"),
    (lambda t, m: t.pop("stage:model.layers.1:residual"), "block 'model.layers.1' has no 'stage:model.layers.1:residual'"),
    (lambda t, m: m.update(residual_convention="stream"), "says residual_convention 'vllm'"),
    (lambda t, m: m.pop("dtype"), "dtype=None; state the engine's nominal dtype"),
    (lambda t, m: m.update(dtype="float8_e4m3fn"), "dtype='float8_e4m3fn'"),
    (lambda t, m: t.pop("attention_mask"), "no 'attention_mask'.*not guessed"),
    (lambda t, m: t.update({"router:model.layers.0.mlp.gate": t["router:model.layers.0.mlp.gate"][:, :3]}),
     "expected \\[4, 12, k\\]"),
])
def test_metadata_is_stated_not_guessed(edit, words, tmp_path, capsys, hf_dumps):
    tensors, meta = _read(VLLM / "qwen2_moe_float32.safetensors")
    edit(tensors, meta)
    bad = _write(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(DataFileError, match=words):
        load_dump(bad)
    assert main(["drift", "localize", "--dumps", str(hf_dumps["qwen2_moe"]), str(bad)]) == 2
    assert "bad.safetensors" in capsys.readouterr().err


def _edited(tmp_path, name, edit):
    t, meta = _read(VLLM / "llama_float32.safetensors")
    edit(t, meta)
    return _write(tmp_path / f"{name}.safetensors", t, meta)


def _set(t, key, i, value):
    t[key] = t[key].clone()
    t[key][i] = value


@pytest.mark.parametrize("edit, match", [
    (lambda t, m: m.update(stages="[]"), "must be a JSON list of distinct stage names"),
    (lambda t, m: m.update(stages='"model.norm"'), "must be a JSON list"),   # not read letter by letter
    (lambda t, m: m.update(stages=json.dumps(json.loads(m["stages"]) * 2)), "distinct"),
    (lambda t, m: t.update({"stage:model.norm": t["stage:model.norm"].round().int()}), "expected a float stream"),
    (lambda t, m: _set(t, "logprobs", (0, 3), float("nan")), "'logprobs' .* holds NaN or \\+inf"),
])
def test_a_hand_edited_dump_is_refused(tmp_path, edit, match):
    with pytest.raises(DataFileError, match=match):
        load_dump(_edited(tmp_path, "edited", edit))


@pytest.mark.parametrize("edit, match", [
    # the noise dump must be the same tokens re-run: other tokens give a floor of ~1 that passed
    # vLLM's served epsilon fault (free error 0.29) as noise; fewer rows crashed (exit 3)
    (lambda t, m: t.update(input_ids=(t["input_ids"] + 7) % 128), "holds other tokens"),
    (lambda t, m: t.update({k: v[:2] for k, v in t.items()}), "holds other tokens"),  # 2 of 4 rows
])
def test_a_noise_dump_of_other_tokens_is_refused(tmp_path, edit, match):
    noise = _edited(tmp_path, "noise", edit)
    assert main(["drift", "localize", "--dumps", str(VLLM / "llama_float32.safetensors"),
                 str(VLLM / "llama_eps_float32.safetensors"), "--noise-dump", str(noise)]) == 2
    with pytest.raises(Exception, match=match):
        compare_dumps(load_dump(VLLM / "llama_float32.safetensors"),
                      load_dump(VLLM / "llama_eps_float32.safetensors"), load_dump(noise))


def test_masks_must_match_and_hold_a_real_token(tmp_path):
    half = _edited(tmp_path, "half", lambda t, m: _set(t, "attention_mask", (slice(None), slice(6, None)), 0))
    with pytest.raises(Exception, match="attention masks .* differ at 24 of 48"):
        compare_dumps(load_dump(VLLM / "llama_float32.safetensors"), load_dump(half))
    none = _edited(tmp_path, "none", lambda t, m: t.update(attention_mask=torch.zeros_like(t["attention_mask"])))
    with pytest.raises(Exception, match="no real token"):  # was 'noise' on zero tokens
        compare_dumps(load_dump(none), load_dump(none))
    assert main(["drift", "localize", "--dumps", str(none), str(none)]) == 2


class InParts(torch.nn.Module):
    """A sampler that runs the batch in parts of `rows` sequences, last part first (as a
    scheduler might), with the HF model's own modules under the same names."""

    def __init__(self, lm, rows: int):
        super().__init__()
        self.model, self.lm_head, self.config, self.rows = lm.model, lm.lm_head, lm.config, rows

    def forward(self, input_ids, attention_mask=None):
        parts = list(torch.arange(input_ids.shape[0]).split(self.rows))[::-1]
        out = torch.empty(*input_ids.shape, self.config.vocab_size)
        for r in parts:  # loop over the engine's parts
            am = None if attention_mask is None else attention_mask[r]
            out[r] = self.lm_head(self.model(input_ids=input_ids[r], attention_mask=am).last_hidden_state)
        return out


def test_dump_of_an_engine_that_batches_internally_is_cut_per_row(tmp_path):
    """Every stage is called once per part; the dump puts each part back at its rows (told
    from the token ids its first stage was called with), so it matches the whole-batch run."""
    from trainprobes.drift.dumps import save_dump
    from trainprobes.drift.localize_demo import base_model, sample
    lm = base_model("llama", layers=2)
    ids = sample(Engine(lm), 5, 12, 1)
    whole, parts = tmp_path / "whole.safetensors", tmp_path / "parts.safetensors"
    save_dump(whole, Engine(lm, name="whole"), ids)
    save_dump(parts, Engine(InParts(lm, 2), name="parts"), ids)
    a, b = load_dump(whole), load_dump(parts)
    assert a.stages == b.stages == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    for name in a.stages:
        torch.testing.assert_close(b.streams[name], a.streams[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)
    assert not any(r.divergent for r in compare_dumps(a, b))
