"""trainprobes.watch.grpo: the drift monitor inside TRL 1.16's GRPOTrainer, on a tiny random
Llama with an in-memory word-level tokenizer and a rollout_func sampler (grpo_demo), CPU only.

Measured figures these tests hold (16 completions x 6 tokens per generation batch, one look
per batch, alpha 0.01 over the run): temperature applied twice (T = 0.8) is called biased at
the 3rd batch (mean +0.064 nats/token); a bf16 sampler against an fp32 trainer is noisy
(sd 0.04 nats/token, k3 9e-4, no significant bias in 10 batches); the clean pair is clean.
localize= on the first biased look names temperature (slope 1.25, share 100%, 0.36 s) and the
top-p renormalisation (share 100%, 0.15 s); at a chosen step, block 1's bf16 MLP
(model.layers.1.mlp, numerics 100%, 1.6 s); 8 sequences x 10 tokens, 48 completion tokens.
"""
import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from trainprobes.errors import InvalidArgument, InvalidType, OutputExists  # noqa: E402
from trainprobes.gate.judgeable import check_judgeable  # noqa: E402
from trainprobes.result import load_results  # noqa: E402
from trainprobes.watch.grpo import GRPODriftMonitor, truncation_of  # noqa: E402
from trainprobes.watch.grpo_demo import Sampler, run, tiny_llama, word_tokenizer  # noqa: E402
from trainprobes.watch.sentinel import SentinelFinding  # noqa: E402

BATCH = 16
TEMPERATURE_TWICE_BY = 6  # generation batches; measured: 3


def _run(kind, steps, tmp_path, **kw):
    mon_kw = {k: kw.pop(k) for k in ("stop_on_finding", "interval", "max_sequences") if k in kw}
    mon = GRPODriftMonitor(every=1, interval=mon_kw.pop("interval", 1), report=tmp_path / "drift.json", **mon_kw)
    trainer = run(kind, steps=steps, monitor=mon, output_dir=str(tmp_path / "out"), batch=BATCH, **kw)
    return mon, trainer


@pytest.mark.slow
def test_clean_pair_is_never_called_biased_and_reaches_logs_and_report(tmp_path):
    mon, trainer = _run("clean", 5, tmp_path)
    assert mon.error_count == 0, mon.errors
    assert len(mon.rows) == 5
    assert all(r[f"drift/{n}/verdict"] == "clean" for r in mon.rows for n in ("interval", "run"))
    assert mon.found_at == {}
    final = mon.results[-1]
    assert final.verdict == "pass" and final.metrics["drift_verdict"] == "clean"
    assert final.metrics["trl_is_changed_share"] == 0.0
    # the trainer's logger got the numbers (log_history is what every reporter is handed)
    logged = [h for h in trainer.state.log_history if "drift/run/verdict" in h]
    assert len(logged) >= 4 and logged[0]["drift/run/verdict"] == "clean"
    results, meta = load_results(tmp_path / "drift.json")
    assert meta["command"] == "watch.grpo" and meta["options"]["interval"] == 1
    assert [r.verdict for r in results] == ["pass"]
    for r in results:
        check_judgeable(r, "candidate")  # the gate can read it
    doc = json.loads((tmp_path / "drift.json").read_text())
    assert doc["schema_version"] and len(doc["looks"]) == 5


@pytest.mark.slow
def test_temperature_applied_twice_is_called_biased_and_stops_when_asked(tmp_path):
    with pytest.raises(SentinelFinding) as info:
        _run("temperature_twice", TEMPERATURE_TWICE_BY, tmp_path, stop_on_finding=True)
    mon_results = info.value.results
    found = [r for r in mon_results if r.verdict == "fail"]
    assert found and "TP-D1" in found[0].codes
    m = found[0].metrics
    assert m["biased"] and m["mean_log_ratio"] > 0 and m["ci_low"] > 0  # the sampler is sharper
    assert found[0].evidence["found_at_batch"] <= TEMPERATURE_TWICE_BY
    results, _ = load_results(tmp_path / "drift.json")  # written before the run stopped
    assert any(r.verdict == "fail" for r in results)
    assert len({r.key for r in results}) == len(results)  # the gate matches Results by key
    for r in results:
        check_judgeable(r, "candidate")


@pytest.mark.slow
def test_bf16_sampler_against_fp32_trainer_is_noise_not_bias(tmp_path):
    mon, _ = _run("bf16", 6, tmp_path)
    final = mon.results[-1].metrics
    assert mon.found_at == {}
    assert final["drift_verdict"] == "noisy"
    assert 0.01 < final["std_log_ratio"] < 0.1  # bf16 rounding of a peaked softmax, per token


@pytest.mark.slow
def test_top_p_raw_logprobs_agree_but_sampling_is_off_policy(tmp_path):
    mon, _ = _run("top_p_raw", 3, tmp_path)
    final = mon.results[-1]
    assert final.metrics["drift_verdict"] == "clean"  # raw log-probs: the trainer's own
    assert final.metrics["sampling_differs"] is True
    assert final.verdict == "warn" and "top_p=0.9" in final.message and "off-policy" in final.message
    check_judgeable(final, "candidate")


def test_truncation_is_read_from_the_sampling_parameters():
    assert truncation_of({"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": None,
                          "repetition_penalty": 1.0}) == []
    assert truncation_of({"top_p": 0.95, "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.1}) == [
        "top_p=0.95", "top_k=50", "min_p=0.1", "repetition_penalty=1.1"]


# --- bad input: named, counted, never raised into the run (unless stop_on_finding) -----------

class _Accel:
    def autocast(self):
        return torch.autocast("cpu", enabled=False)


def _trainer():
    args = SimpleNamespace(temperature=0.8, per_device_train_batch_size=4, top_p=1.0, top_k=0, min_p=None,
                           repetition_penalty=1.0, vllm_importance_sampling_mode="token_truncate",
                           vllm_importance_sampling_clip_max=2.0, vllm_importance_sampling_clip_min=None,
                           use_vllm=False, vllm_importance_sampling_correction=True, bf16=False)
    return SimpleNamespace(model=tiny_llama(0), args=args, accelerator=_Accel(),
                           state=SimpleNamespace(global_step=0))


def _sampled(kind="clean", n=4):
    tr = _trainer()
    s = Sampler(kind, word_tokenizer(), temperature=0.8)
    return tr, s([f"w{i} w{i + 1} w{i + 2} w{i + 3}" for i in range(n)], tr)


def test_logits_path_matches_the_sampler_and_counts_trl_clipping():
    tr, out = _sampled("clean")
    mon = GRPODriftMonitor(every=1, interval=1)
    mon.observe(out, tr)
    assert mon.error_count == 0, mon.errors
    row = mon.rows[0]
    assert abs(row["drift/run/mean_log_ratio"]) < 1e-5 and row["drift/run/trl_is_changed_share"] == 0
    tr, out = _sampled("temperature_twice", n=8)
    mon = GRPODriftMonitor(every=1, interval=1)
    mon.observe(out, tr)
    train = torch.tensor(out["logprobs"])  # the sampler's; the trainer's differ by the temperature
    assert mon.rows[0]["drift/run/mean_log_ratio"] > 0
    assert 0 <= mon.rows[0]["drift/run/trl_is_changed_share"] <= 1 and train.shape == (8, 6)


@pytest.mark.parametrize("change, error, words", [
    (lambda o: o.update(logprobs=[[[-0.1, -2.0]] * len(c) for c in o["completion_ids"]]), InvalidType,
     "logprobs[0][0] is a list"),
    (lambda o: o["logprobs"][1].__setitem__(2, 0.7), InvalidArgument,
     "rollout_func's logprobs (the sampler)[1, 2] = 0.69"),
    (lambda o: o["logprobs"][0].__setitem__(0, math.nan), InvalidArgument, "is not a log-probability"),
    (lambda o: o["logprobs"][3].__setitem__(1, None), InvalidArgument, "(the sampler)[3, 1] = nan"),
    (lambda o: o.update(env_mask=[[1] * 3 for _ in o["completion_ids"]]), InvalidArgument,
     "env_mask[0] has 3 entries"),
    (lambda o: o["logprobs"][2].pop(), InvalidArgument, "logprobs[2] has 5 entries, completion_ids[2] 6"),
    (lambda o: o.pop("logprobs"), InvalidArgument, "returned no ['logprobs']"),
])
def test_bad_rollout_output_is_named_counted_and_the_run_goes_on(change, error, words):
    tr, out = _sampled()
    change(out)
    mon = GRPODriftMonitor(every=1, interval=1)
    mon.observe(out, tr)  # never raises into the training step
    assert mon.error_count == 1 and words in mon.errors[0], mon.errors
    final = mon.close()[-1]
    assert final.verdict == "error" and "TP-E1" in final.codes and "nothing judged" in final.message
    strict = GRPODriftMonitor(every=1, interval=1, stop_on_finding=True)
    with pytest.raises(error, match="rollout_func|log-prob"):
        strict.observe(out, tr)


def test_wrap_and_attach_refuse_what_they_cannot_watch(tmp_path):
    mon = GRPODriftMonitor()
    with pytest.raises(InvalidType, match="not callable"):
        mon.wrap(None)
    tr, out = _sampled()
    wrapped = mon.wrap(lambda prompts, trainer: out)
    assert wrapped(["w1"], object()) is out  # the output passes through untouched
    assert "has no ['model', 'args', 'accelerator', 'state']" in mon.errors[0]
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(OutputExists, match="exists"):
        GRPODriftMonitor(report=tmp_path / "r.json")
    with pytest.raises(InvalidArgument, match="sampling names"):
        GRPODriftMonitor(sampling={"top_q": 0.9})


class _FixedModel(torch.nn.Module):
    """A 'trainer' whose fused head returns fixed log-probs. The sampler's differ by noise
    that is on-policy: x = infer - train = e + s^2/2, e ~ N(0, s^2), so E[exp(-x)] = 1 (the
    trainer's probabilities average to the sampler's under the sampler's draws; drift.compare's
    null). Every biased call is a false one."""

    def __init__(self, logprobs):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.lp = logprobs

    def forward(self, input_ids, attention_mask, labels=None, fused_lm_head=False):
        return SimpleNamespace(log_probs=self.lp[input_ids[:, 3]])  # the prompt's last id is the row


def _fixed_runs(seeds, offset, alpha=0.05, looks=8, B=8, C=12):
    """First batch called biased per seed (None: never), on-policy noise sd 0.02 plus offset."""
    first = []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        base = -torch.rand(B, C, generator=g) * 3 - 0.05
        tr = _trainer()
        tr.model = _FixedModel(torch.cat([torch.zeros(B, 4), base], 1))
        mon = GRPODriftMonitor(every=1, interval=1, alpha=alpha)
        for _ in range(looks):
            noisy = (base + torch.randn(B, C, generator=g) * 0.02 + 0.02 ** 2 / 2 + offset).clamp(max=0)
            mon.observe({"prompt_ids": [[5, 6, 7, b] for b in range(B)], "completion_ids": [[9] * C] * B,
                         "logprobs": noisy.tolist()}, tr)
        assert mon.error_count == 0, mon.errors
        first.append(mon.found_at.get("run", mon.found_at.get("interval")))
    return first


def test_false_biased_rate_over_seeds_and_looks_stays_under_alpha():
    # measured: 0 of 60 runs of 8 looks called biased at alpha 0.05; binomial(60, 0.05):
    # P(X > 8) < 0.01, and the union bound over looks makes the true rate lower still
    false_runs = sum(f is not None for f in _fixed_runs(60, 0.0))
    assert false_runs <= 8, false_runs
    # the same test is not blind: +0.01 nats/token is called at the first look (measured: 60/60)
    assert all(f is not None and f <= 2 for f in _fixed_runs(10, 0.01))


def test_every_scores_one_batch_in_every_without_drawing():
    tr, out = _sampled()
    mon = GRPODriftMonitor(interval=2, every=3)
    state = torch.random.get_rng_state()
    for _ in range(7):
        mon.observe(out, tr)
    assert torch.equal(state, torch.random.get_rng_state())  # the run's generator did not move
    assert (mon.seen, mon.batches, mon.looks) == (7, 3, 1)  # batches 1, 4, 7 scored; a look at 2


def test_a_declared_sampler_temperature_other_than_the_trainers_is_said():
    tr, out = _sampled()
    mon = GRPODriftMonitor(every=1, interval=1, sampling={"temperature": 0.7})
    mon.observe(out, tr)
    final = mon.close()[-1]
    assert "temperature=0.7 (the trainer scores with 0.8)" in final.message
    assert final.metrics["sampling_differs"] is True and final.verdict != "pass"


@pytest.mark.slow
def test_the_monitor_changes_no_bit_of_the_run(tmp_path):
    bare = run("clean", steps=3, output_dir=str(tmp_path / "a"), batch=BATCH, learning_rate=1e-3)
    mon = GRPODriftMonitor(every=1, interval=1)
    watched = run("clean", steps=3, monitor=mon, output_dir=str(tmp_path / "b"), batch=BATCH, learning_rate=1e-3)
    assert mon.batches == 3 and mon.error_count == 0
    a, b = bare.model.state_dict(), watched.model.state_dict()
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert not changed, changed[:3]
    assert not torch.equal(a["lm_head.weight"], tiny_llama(0).state_dict()["lm_head.weight"])  # it trained
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (bare, watched)]
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_the_example_runs_and_prints_each_case(capsys):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "grpo_drift.py"
    spec = importlib.util.spec_from_file_location("grpo_drift_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "2", "--kinds", "clean,top_p_raw"])
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out[1:] if line.strip()}
    assert rows["clean"].split()[1] == "clean" and "pass" in rows["clean"]
    assert "warn; sampling differs" in rows["top_p_raw"]


@pytest.mark.slow
def test_bf16_moe_sampler_is_heavy_tailed_from_routing_flips(tmp_path):
    # measured (12 batches, 1152 tokens): 0.61% of tokens outside [1/2, 2] carry 77% of the
    # squared log-ratio, max |log-ratio| 1.93; a dense bf16 sampler stays noisy (test above)
    mon, _ = _run("bf16", 12, tmp_path, arch="qwen2_moe")
    final = mon.results[-1]
    assert final.metrics["drift_verdict"] == "heavy-tailed" and "TP-D2" in final.codes
    assert not final.metrics["biased"] and final.metrics["max_abs_log_ratio"] > 0.69  # a ratio beyond 2
    assert 0 < final.metrics["frac_ratio_outside"] <= 0.01


@pytest.mark.slow
def test_the_gate_blocks_a_biased_run_against_a_clean_baseline(tmp_path):
    from trainprobes.cli import main
    reports = {}
    for kind in ("clean", "temperature_twice"):
        reports[kind] = tmp_path / f"{kind}.json"
        mon = GRPODriftMonitor(every=1, interval=1, report=reports[kind])
        run(kind, steps=4, monitor=mon, output_dir=str(tmp_path / kind), batch=BATCH)
    assert main(["gate", "--baseline", str(reports["clean"]), "--candidate", str(reports["clean"])]) == 0
    assert main(["gate", "--baseline", str(reports["clean"]),
                 "--candidate", str(reports["temperature_twice"])]) == 1


# --- localize= : drift localize on a biased look's tokens (trainprobes.watch.grpo_localize) ---

def _localized(mon):
    return [r for r in mon.results if r.probe == "drift.localize"]


def test_localize_at_a_chosen_step_names_temperature_and_moves_no_bit():
    tr, out = _sampled("temperature_twice", n=8)
    s = Sampler("temperature_twice", word_tokenizer(), temperature=0.8)
    mon = GRPODriftMonitor(every=1, interval=1, localize=s.engine, localize_at=0, localize_sequences=4,
                           localize_length=8)
    tr.model.train()
    state = torch.random.get_rng_state()
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    mon.observe(out, tr)
    assert mon.error_count == 0, mon.errors
    assert torch.equal(state, torch.random.get_rng_state())
    assert tr.model.training and all(m.training for m in tr.model.modules())  # train mode restored
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    (r,) = _localized(mon)
    assert r.metrics["kind"] == "temperature" and r.metrics["share_temperature"] > 0.9
    # the caps: 4 of 8 completions, prompt (4) + completion cut to 8 tokens: 4 scored each
    assert r.metrics["n_sequences"] == 4 and r.evidence["completion_tokens_scored"] == 16
    assert r.evidence["sequences_in_batch"] == 8 and "4 of 8 completions" in r.message
    assert mon.rows[-1]["drift/localize/kind"] == "temperature"
    mon.observe(out, tr)  # localize_max=1: not again
    assert len(_localized(mon)) == 1


def test_localize_errors_are_the_monitors_own_and_the_run_goes_on():
    tr, out = _sampled("temperature_twice", n=8)

    def broken(trainer):
        raise RuntimeError("engine gone")

    for bad, words in ((broken, "RuntimeError: engine gone"), (lambda t: "not a module", "localize returned a str")):
        mon = GRPODriftMonitor(every=1, interval=1, localize=bad, localize_at=0)
        mon.observe(out, tr)  # never raises into the training step
        assert mon.error_count == 1 and "localizing" in mon.errors[0] and words in mon.errors[0], mon.errors
        assert mon.batches == 1 and not _localized(mon)
    strict = GRPODriftMonitor(every=1, interval=1, localize=broken, localize_at=0, stop_on_finding=True)
    with pytest.raises(RuntimeError, match="engine gone"):
        strict.observe(out, tr)
    with pytest.raises(InvalidType, match="localize=3 is not callable"):
        GRPODriftMonitor(localize=3)
    with pytest.raises(InvalidArgument, match="localize_at needs localize="):
        GRPODriftMonitor(localize_at=2)


def _localize_run(kind, steps, tmp_path, **kw):
    s = Sampler(kind, word_tokenizer(), temperature=0.8)
    mon = GRPODriftMonitor(every=1, interval=1, report=tmp_path / "drift.json", localize=s.engine, **kw)
    trainer = run(kind, steps=steps, monitor=mon, output_dir=str(tmp_path / "out"), batch=BATCH, sampler=s)
    assert mon.error_count == 0, mon.errors
    (r,) = _localized(mon)
    results, _ = load_results(tmp_path / "drift.json")
    assert r.key in {x.key for x in results}  # in the report the gate reads
    check_judgeable(r, "candidate")
    logged = [h for h in trainer.state.log_history if "drift/localize/kind" in h]
    assert logged and logged[0]["drift/localize/kind"] == r.metrics["kind"]
    return r


@pytest.mark.slow
def test_localize_on_the_first_biased_look_names_temperature_applied_twice(tmp_path):
    r = _localize_run("temperature_twice", TEMPERATURE_TWICE_BY, tmp_path)
    assert r.metrics["kind"] == "temperature" and r.metrics["share_temperature"] > 0.9
    assert r.metrics["temperature_slope"] == pytest.approx(1.25, rel=0.05)  # 1 / 0.8


@pytest.mark.slow
def test_localize_names_top_p_renormalisation(tmp_path):
    r = _localize_run("top_p_renormalised", 2, tmp_path)
    assert r.metrics["kind"] == "renormalisation" and r.metrics["share_renormalisation"] > 0.9


@pytest.mark.slow
def test_localize_at_a_step_names_the_bf16_mlp_block(tmp_path):
    # one bf16 MLP is noise to the sequence test (never biased), so localize runs at step 1
    r = _localize_run("bf16_mlp", 3, tmp_path, localize_at=1)
    m = r.metrics
    assert m["kind"] == "numeric" and m["share_numerics"] > 0.5
    assert (m["explained_by"], m["explained_by_op"], m["explained_by_module"]) == (
        "model.layers.1", "mlp", "model.layers.1.mlp")


@pytest.mark.slow
def test_localize_changes_no_bit_of_the_run(tmp_path):
    bare = run("temperature_twice", steps=3, output_dir=str(tmp_path / "a"), batch=BATCH, learning_rate=1e-3)
    s = Sampler("temperature_twice", word_tokenizer(), temperature=0.8)
    mon = GRPODriftMonitor(every=1, interval=1, localize=s.engine, localize_at=0, localize_max=3)
    watched = run("temperature_twice", steps=3, monitor=mon, output_dir=str(tmp_path / "b"), batch=BATCH,
                  learning_rate=1e-3, sampler=s)
    assert mon.error_count == 0 and len(_localized(mon)) >= 1, mon.errors
    a, b = bare.model.state_dict(), watched.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (bare, watched)]
    assert losses[0] == losses[1]
