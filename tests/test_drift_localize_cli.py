"""`trainprobes drift localize`: the demo, a user's pair by import path, dumps, the plot,
and bad input (each a clear error, exit 2); `trainprobes drift` without the mode is unchanged."""
import copy
import json

import pytest
import torch
from trainprobes.cli import main
from trainprobes.drift import faults
from trainprobes.drift.dumps import compare_dumps, load_dump, save_dump
from trainprobes.drift.engines import Engine
from trainprobes.errors import DataFileError, InvalidArgument

pytest.importorskip("transformers")
from trainprobes.isolation.hf import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEMO = "trainprobes.drift.localize_demo"


@pytest.mark.slow
def test_demo_reproduces_every_control(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["drift", "localize", "--demo", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    from trainprobes.drift.localize_demo import CASES
    assert out.count(": yes") == len(CASES) == 15 and ": NO" not in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["drift", "localize", "--demo", "--plot", str(png)]) == 2  # never replaced silently


def test_user_pair_finding_and_noise(capsys):
    rc = main(["drift", "localize", "--target", f"{DEMO}:example_trainer", "--engine",
               f"{DEMO}:example_engine", "--json", "--sequences", "6", "--length", "16"])
    doc = json.loads(capsys.readouterr().out)
    m = doc["results"][0]["metrics"]
    assert rc == 1 and (m["kind"], m["first_layer"], m["op"]) == ("numeric", "model.layers.2", "mlp")
    for key in ("own_error[model.layers.2]", "free_error[model.layers.2]", "noise_floor[model.layers.2]",
                "share_numerics", "share_unexplained"):
        assert key in m
    rc = main(["drift", "localize", "--target", f"{DEMO}:example_trainer", "--engine",
               f"{DEMO}:example_engine_sdpa", "--json", "--sequences", "6", "--length", "16"])
    m = json.loads(capsys.readouterr().out)["results"][0]["metrics"]
    assert rc == 0 and m["kind"] == "noise" and m["first_layer"] == ""


@pytest.mark.parametrize("argv, words", [
    (["--target", f"{DEMO}:example_trainer"], "give --target"),
    (["--demo", "--target", f"{DEMO}:example_trainer"], "takes no"),
    (["--target", f"{DEMO}:nope", "--engine", f"{DEMO}:example_engine"], "nope"),
    (["--margin", "0.5", "--demo"], "margin"),
])
def test_bad_usage_exits_2(argv, words, capsys):
    assert main(["drift", "localize", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, error, words", [
    (["--target", f"{DEMO}:example_trainer"], "InvalidArgument", "give --target"),
    (["--target", f"{DEMO}:nope", "--engine", f"{DEMO}:example_engine"], "TargetError", "nope"),
    (["--dumps", "missing_a.safetensors", "missing_b.safetensors"], None, "missing_a"),
])
def test_refusal_under_json_is_a_document(argv, error, words, capsys):
    """--json prints one JSON document even when the command refuses (it printed nothing)."""
    assert main(["drift", "localize", "--json", *argv]) == 2
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["results"] == [] and doc["refused"]["exit_code"] == 2 and words in doc["refused"]["message"]
    assert error is None or doc["refused"]["error"] == error
    assert words in out.err and doc["options"]["drift_mode"] == "localize"


def test_plain_drift_command_unchanged(capsys):
    assert main(["drift", "--train", "x.npz"]) == 2
    assert "give --train FILE and --infer FILE" in capsys.readouterr().err


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("dumps")
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    b = tiny_model("llama", "sdpa", seed=0, num_hidden_layers=3)
    c = copy.deepcopy(a)
    faults.in_dtype(c.model.layers[1].mlp, torch.bfloat16)
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(0))
    paths = {}
    for name, m, t in (("a", a, ids), ("b", b, ids), ("c", c, ids), ("short", a, ids[:, :10]),
                       ("other", a, (ids + 1) % 128)):
        paths[name] = d / f"{name}.safetensors"
        save_dump(paths[name], Engine(m, name=name), t)
    return paths


def test_dumps_localise_the_first_divergent_stage(dumps, capsys):
    assert main(["drift", "localize", "--dumps", str(dumps["a"]), str(dumps["b"]), "--json"]) == 0
    capsys.readouterr()
    assert main(["drift", "localize", "--dumps", str(dumps["a"]), str(dumps["c"]), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)["results"][0]
    assert d["metrics"]["first_layer"] == "model.layers.1"
    from trainprobes.gate import check_judgeable
    from trainprobes.result import Result
    r = Result.from_dict(d)
    check_judgeable(r, "candidate")
    r.metrics["first_layer"] = "model.layers.2"
    with pytest.raises(Exception, match="first stage beyond noise"):
        check_judgeable(r, "candidate")


def test_dump_errors(dumps, tmp_path):
    import safetensors.torch as st
    with pytest.raises(InvalidArgument, match="different shapes"):
        compare_dumps(load_dump(dumps["a"]), load_dump(dumps["short"]))
    with pytest.raises(InvalidArgument, match="different tokens"):
        compare_dumps(load_dump(dumps["a"]), load_dump(dumps["other"]))
    tensors = st.load_file(str(dumps["a"]))
    from safetensors import safe_open
    with safe_open(str(dumps["a"]), framework="pt") as f:
        meta = f.metadata()
    del tensors["stage:model.layers.2"]
    st.save_file(tensors, str(tmp_path / "gap.safetensors"), metadata=meta)
    with pytest.raises(DataFileError, match="'model.layers.2'"):
        load_dump(tmp_path / "gap.safetensors")
    tensors = st.load_file(str(dumps["a"]))
    tensors["stage:model.layers.0"][0, 0, 0] = float("nan")
    st.save_file(tensors, str(tmp_path / "nan.safetensors"), metadata=meta)
    with pytest.raises(DataFileError, match="stage 'model.layers.0' holds 1 non-finite"):
        load_dump(tmp_path / "nan.safetensors")
    meta2 = dict(meta, stages=json.dumps(json.loads(meta["stages"])[:-1]))
    st.save_file(st.load_file(str(dumps["a"])), str(tmp_path / "fewer.safetensors"), metadata=meta2)
    with pytest.raises(InvalidArgument, match="only in"):
        compare_dumps(load_dump(dumps["a"]), load_dump(tmp_path / "fewer.safetensors"))
    assert main(["drift", "localize", "--dumps", str(dumps["a"]), str(tmp_path / "gap.safetensors")]) == 2


def test_tokens_file_and_its_errors(tmp_path, capsys):
    import safetensors.torch as st
    good, bad = tmp_path / "ids.safetensors", tmp_path / "bad.safetensors"
    st.save_file({"input_ids": torch.randint(0, 128, (5, 12), generator=torch.Generator().manual_seed(0))},
                 str(good))
    st.save_file({"ids": torch.zeros(2, 3, dtype=torch.int64)}, str(bad))
    pair = ["--target", f"{DEMO}:example_trainer", "--engine", f"{DEMO}:example_engine_sdpa"]
    assert main(["drift", "localize", *pair, "--tokens", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["metrics"]["n_sequences"] == 5
    assert main(["drift", "localize", *pair, "--tokens", str(bad)]) == 2
    assert "has no 'input_ids'" in capsys.readouterr().err


def test_measured_noise_dump(dumps, capsys):
    assert main(["drift", "localize", "--dumps", str(dumps["a"]), str(dumps["b"]), "--noise-dump",
                 str(dumps["b"]), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["results"][0]["metrics"]
    assert m["noise_floor[model.layers.2]"] > m["free_error[model.layers.2]"] / 2


# --- bad input through the CLI: each named, exit 2 (factories for --target/--engine) -----

def _llama(layers=2, **kw):
    return tiny_model("llama", "eager", seed=0, num_hidden_layers=layers, **kw)


def two_layers():
    return _llama(2)


def three_layers():
    return _llama(3)


def renamed():
    """Two blocks whose parent calls its final norm `final_norm` instead of `norm`."""
    m = _llama(2)
    m.model.final_norm = m.model.norm
    del m.model.norm
    m.model.forward = _renamed_forward(m.model)
    return m


def _renamed_forward(inner):
    def forward(input_ids=None, attention_mask=None, **kw):
        h = inner.embed_tokens(input_ids)
        pos = torch.arange(h.shape[1])[None]
        pe = inner.rotary_emb(h, pos)
        for layer in inner.layers:
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos)
        from transformers.modeling_outputs import BaseModelOutputWithPast
        return BaseModelOutputWithPast(last_hidden_state=inner.final_norm(h))
    return forward


def overflowing():
    m = _llama(2)
    m.model.layers[1].mlp.down_proj.weight.data[0, 0] = float("inf")
    return m


def wider_vocab():
    return _llama(2, vocab_size=256)


def fp8_weights():
    return _llama(2).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("engine, words", [
    ("three_layers", "the trainer has 2 blocks and the engine 3"),
    ("renamed", "only in the trainer: ['model.norm']; only in the engine: ['model.final_norm']"),
    ("overflowing", "engine's 'model.layers.1' output holds non-finite values"),
    ("wider_vocab", "128 ids and the engine's 256"),
    ("fp8_weights", "whose rounding floor is not known here"),
])
def test_bad_engine_pairs_exit_2_naming_what_differs(engine, words, capsys):
    here = "tests.test_drift_localize_cli"
    rc = main(["drift", "localize", "--target", f"{here}:two_layers", "--engine", f"{here}:{engine}",
               "--sequences", "4", "--length", "8"])
    assert rc == 2
    assert words in capsys.readouterr().err


def test_bad_dumps_exit_2(dumps, capsys):
    assert main(["drift", "localize", "--dumps", str(dumps["a"]), str(dumps["short"])]) == 2
    assert "tokens of different shapes" in capsys.readouterr().err
