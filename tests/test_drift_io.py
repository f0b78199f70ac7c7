"""trainprobes.drift.io: .npz / .safetensors / .jsonl readers, and errors that name file, record, field."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.drift import DriftFileError, compare, load_logprobs, load_rollouts


def _arrays(B=3, T=5, seed=0):
    rng = np.random.default_rng(seed)
    infer = -rng.random((B, T)).astype(np.float32) * 3
    train = infer + rng.normal(0, 0.01, (B, T)).astype(np.float32)
    mask = np.ones((B, T), dtype=bool)
    mask[1, 3:] = False
    return train.clip(max=0), infer, mask


def _save(path, arrays):
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    else:
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_logprob_files_round_trip(tmp_path, suffix):
    train, infer, mask = _arrays()
    _save(tmp_path / f"t{suffix}", {"logprobs": train, "mask": mask})
    _save(tmp_path / f"i{suffix}", {"only_array": infer})
    t, m = load_logprobs(tmp_path / f"t{suffix}")
    i, m2 = load_logprobs(tmp_path / f"i{suffix}")
    assert torch.equal(t, torch.from_numpy(train)) and torch.equal(m, torch.from_numpy(mask))
    assert torch.equal(i, torch.from_numpy(infer)) and m2 is None


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_rollout_arrays_round_trip(tmp_path, suffix):
    train, infer, mask = _arrays()
    ids = np.arange(15, dtype=np.int64).reshape(3, 5)
    _save(tmp_path / f"r{suffix}", {"infer_logprobs": infer, "train_logprobs": train, "mask": mask, "token_ids": ids})
    ro = load_rollouts(tmp_path / f"r{suffix}")
    assert torch.equal(ro.train_logprobs, torch.from_numpy(train))
    assert torch.equal(ro.token_ids, torch.from_numpy(ids)) and torch.equal(ro.mask, torch.from_numpy(mask))


def test_jsonl_rollouts_pad_rows(tmp_path):
    recs = [{"token_ids": [5, 6, 7], "infer_logprobs": [-1.0, -0.5, -2.0], "train_logprobs": [-1.0, -0.4, -2.0],
             "prompt_ids": [1, 2]},
            {"token_ids": [8], "infer_logprobs": [-0.1], "train_logprobs": [-0.2], "mask": [1], "prompt_ids": [3]}]
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    ro = load_rollouts(p)
    assert ro.infer_logprobs.shape == (2, 3)
    assert ro.mask.tolist() == [[True, True, True], [True, False, False]]
    assert ro.train_logprobs[1, 0].item() == pytest.approx(-0.2) and ro.prompt_ids == [[1, 2], [3]]
    r = compare(ro.train_logprobs, ro.infer_logprobs, mask=ro.mask)
    assert r.metrics["n_tokens"] == 4


@pytest.mark.parametrize("line, match", [
    ({"token_ids": [1, 2]}, r"line 2: missing field 'infer_logprobs'"),
    ({"token_ids": [1, 2], "infer_logprobs": [-1.0]}, r"line 2: field 'infer_logprobs' has 1 values, expected 2"),
    ({"token_ids": [1, 2], "infer_logprobs": [-1.0, 0.7]}, r"line 2: field 'infer_logprobs'\[1\] = 0.7 is not a log-probability"),
    ({"token_ids": [1, 2], "infer_logprobs": [-1.0, "x"]}, r"line 2: field 'infer_logprobs'\[1\] = 'x' is not a number"),
    ({"token_ids": [1, 2], "infer_logprobs": [-1.0, -1.0], "train_logprobs": [-1.0, -1.0], "mask": [1]},
     r"line 2: field 'mask' must be a list of 2"),
    ({"infer_logprobs": [-1.0]}, r"line 2: missing field 'token_ids'"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    good = {"token_ids": [1, 2], "infer_logprobs": [-1.0, -1.0], "train_logprobs": [-1.0, -1.0]}
    p.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DriftFileError, match=match) as info:
        load_rollouts(p)
    assert "bad.jsonl" in str(info.value)


def test_jsonl_nan_literal_is_rejected(tmp_path):
    p = tmp_path / "nan.jsonl"
    p.write_text('{"token_ids": [1], "infer_logprobs": [NaN]}\n')
    with pytest.raises(DriftFileError, match=r"nan.jsonl' line 1: field 'infer_logprobs'\[0\] = nan"):
        load_rollouts(p)


@pytest.mark.parametrize("arrays, match", [
    ({"logprobs": np.array([[-1.0, np.nan]])}, r"record 0, position 1, field 'logprobs' = nan"),
    ({"logprobs": np.array([-1.0, 2.0])}, r"record 1, field 'logprobs' = 2.0 is not a log-probability"),
    ({"a": np.zeros(2), "b": np.zeros(2)}, r"no field 'logprobs' and 2 other arrays"),
    ({"logprobs": -np.ones((2, 2)), "mask": np.ones(3)}, r"field 'mask' has shape \(3,\)"),
])
def test_npz_errors_name_file_record_and_field(tmp_path, arrays, match):
    p = tmp_path / "bad.npz"
    np.savez(p, **arrays)
    with pytest.raises(DriftFileError, match=match) as info:
        load_logprobs(p)
    assert "bad.npz" in str(info.value)


def test_pickled_npz_is_refused(tmp_path):
    p = tmp_path / "pickle.npz"
    np.savez(p, logprobs=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(DriftFileError, match="without unpickling"):
        load_logprobs(p)


@pytest.mark.parametrize("name, match", [("missing.npz", "does not exist"), ("x.pkl", "suffix '.pkl'")])
def test_missing_or_unknown_files(tmp_path, name, match):
    p = tmp_path / name
    if name.endswith(".pkl"):
        p.write_bytes(b"\x80\x04")
    with pytest.raises(DriftFileError, match=match):
        load_logprobs(p)


def test_rollouts_missing_infer_field(tmp_path):
    p = tmp_path / "r.npz"
    np.savez(p, train_logprobs=-np.ones((2, 2)))
    with pytest.raises(DriftFileError, match="missing field 'infer_logprobs'"):
        load_rollouts(p)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=5), st.integers(0, 2 ** 16))
def test_jsonl_round_trip_property(tmp_path_factory, rows, seed):
    rng = np.random.default_rng(seed)
    with_train = rng.random() < 0.5
    recs = []
    for n, masked in rows:
        rec = {"token_ids": rng.integers(0, 100, n).tolist(),
               "infer_logprobs": (-rng.random(n) * 5).tolist()}
        if with_train:
            rec["train_logprobs"] = (-rng.random(n) * 5).tolist()
        if masked:
            rec["mask"] = [int(v) for v in rng.random(n) < 0.7]
        recs.append(rec)
    p = tmp_path_factory.mktemp("j") / "r.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    ro = load_rollouts(p)
    T = max(n for n, _ in rows)
    assert ro.infer_logprobs.shape == (len(rows), T)
    assert (ro.train_logprobs is not None) == with_train
    for b, rec in enumerate(recs):
        n = len(rec["token_ids"])
        assert ro.token_ids[b, :n].tolist() == rec["token_ids"]
        assert np.allclose(ro.infer_logprobs[b, :n].numpy(), rec["infer_logprobs"], atol=1e-6)
        assert ro.mask[b].tolist() == [bool(v) for v in rec.get("mask", [1] * n)] + [False] * (T - n)
