"""trainprobes.watch: the sentinel's statistics, its promises (no bit of the run changed, no
aliasing, its own generator, a fixed budget, its errors its own) and its verdicts on real
gloo ranks (torch 2.13 CPU)."""
import pytest
import torch
from trainprobes.distributed.launcher import launch
from trainprobes.errors import InvalidArgument
from trainprobes.result import Result
from trainprobes.watch import Sentinel
from trainprobes.watch.collective import window_copy as _window_copy
from trainprobes.watch.demo import lightning_task, plan_task, refusal_task, runs_task, trainer_task
from trainprobes.watch.hooks import truncate_to_bf16
from trainprobes.watch.stream import Streams, look_alpha


def test_alpha_spent_over_looks_and_buckets_sums_to_alpha():
    total = sum(look_alpha(0.01, k, 3) * 3 for k in range(1, 200_001))
    assert 0.00999 < total <= 0.01


def test_null_streams_keep_the_run_wide_false_positive_rate():
    """Errors with no bias, looked at 8 times: any false 'biased' in a run must stay within
    alpha. Judged at alpha at every look (no correction) the rate would be about 3 alpha."""
    g = torch.Generator().manual_seed(5)
    runs, alpha, hits = 150, 0.1, 0
    for _ in range(runs):
        st = Streams(alpha=alpha, min_effect=0.0, keep=1000)
        s = st.stream("b0", 10)
        found = False
        for look in range(8):
            for e in torch.randn(4, generator=g, dtype=torch.float64).tolist():
                s.add(look, e)
            found |= any(j.biased for j in st.look(look))
        hits += found
    # binomial(150, 0.1): mean 15, sd 3.7; uncorrected looks give ~45
    assert hits <= 26, hits


def test_a_consistent_bias_is_called_at_the_first_look_with_three_samples():
    st = Streams(alpha=0.01, min_effect=2.0 ** -12, keep=100)
    s = st.stream("b0", 10)
    for e in (-4.7e-3, -4.8e-3, -4.75e-3):
        s.add(1, e)
    (j,) = st.look(10)
    assert j.biased and s.found_at == 10


def test_truncation_rounds_toward_zero():
    x = torch.tensor([1.0 + 2.0 ** -8, -(1.0 + 2.0 ** -8), 3.0])
    assert truncate_to_bf16(x).tolist() == [1.0, -1.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_copies_never_alias_the_runs_buffer(dtype):
    buf = torch.arange(100, dtype=dtype)
    c = _window_copy(buf, 10, 20)
    assert c.dtype == torch.float64 and c.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    c.add_(1)  # the all-reduce works on the copy in place
    assert torch.equal(buf, torch.arange(100, dtype=dtype))
    t = Sentinel()._take(buf, 10, 20)  # what is reduced: the window and its 'taken' flag
    assert t.dtype == torch.float64 and t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert t[:20].tolist() == list(range(10, 30)) and t[20] == 0
    t.add_(1)
    assert torch.equal(buf, torch.arange(100, dtype=dtype))


def test_budget_is_a_fixed_bound_and_bad_arguments_are_named():
    with pytest.raises(InvalidArgument, match="window=1048576 .* over budget=1048576"):
        Sentinel(window=1 << 20, budget=1 << 20)
    # 5 fp64 windows per sample at its peak (benchmarks/bench_watch.py --memory): 10 MiB here
    with pytest.raises(InvalidArgument, match="need 10485760 bytes .5 fp64 windows"):
        Sentinel(window=1 << 16, max_per_step=4, budget=8 << 20)
    Sentinel(window=1 << 16, max_per_step=4, budget=10 << 20)
    with pytest.raises(InvalidArgument, match="sample=0"):
        Sentinel(sample=0)
    with pytest.raises(InvalidArgument, match="interval"):
        Sentinel(interval=0)


def test_a_sentinel_that_checked_nothing_cannot_judge():
    s = Sentinel()
    for _ in range(20):
        s.step()
    (r,) = s.close()
    assert r.verdict == "error" and r.metrics["biased"] is None and "checked no reduction" in r.message


def _same(a, b) -> bool:
    return (torch.equal(a["losses"], b["losses"]) and torch.equal(a["rng"], b["rng"])
            and a["weights"].keys() == b["weights"].keys()
            and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]))


@pytest.mark.slow
def test_attaching_changes_no_bit_of_the_run():
    """2 gloo ranks, 12 steps with dropout drawn from the global generator, every bucket
    checked: losses, weights and the global generator's state bit for bit as without it,
    with no hook (the sentinel's wrapped allreduce_hook against DDP's built-in reduction)
    and with a custom one."""
    kw = {"sample": 1.0, "interval": 4, "max_per_step": 4, "window": 4096, "budget": 1 << 20}
    runs = [{"hook": h, "steps": 12, "watch": w, "sentinel_kwargs": kw}
            for h in ("none", "truncating_bf16") for w in (False, True)]
    out = launch(runs_task, 2, args=(runs,), timeout=300)
    for r, rank in enumerate(out):
        for i in (0, 2):
            assert _same(rank[i], rank[i + 1]), f"rank {r}, {runs[i]['hook']}"
    assert any(Result.from_json(x).metrics.get("trials", 0) >= 3 for x in out[0][1]["results"])


@pytest.mark.slow
def test_its_own_errors_are_counted_never_raised_into_the_step():
    runs = [{"hook": "none", "steps": 8, "watch": w, "sentinel_kwargs": {"sample": 1.0},
             "break_sentinel": w} for w in (False, True)]
    out = launch(runs_task, 2, args=(runs,), timeout=300)
    for r, (plain, broken) in enumerate(out):
        assert _same(plain, broken), f"rank {r}"
        assert broken["own_errors"] == 8
    (res,) = [Result.from_json(x) for x in out[0][1]["results"]]
    assert res.verdict == "error" and "8 errors of its own" in res.message
    assert res.evidence["own_errors"] == 8


def _verdicts(out) -> dict:
    """bucket -> final Result (the last Result per target)."""
    return {Result.from_json(x).target: Result.from_json(x) for x in out[0]["results"]}


@pytest.mark.slow
def test_verdicts_fp32_clean_rounding_noise_truncation_biased(tmp_path):
    """At the defaults (sample 0.25, a look every 10 steps): the truncating hook is called
    biased by step 30, stops the run when asked (findings written first); the bf16
    round-to-nearest hook (bf16_compress_hook's arithmetic) is noise; fp32 is clean.
    The hook named is the one DDP registered."""
    found = tmp_path / "findings.jsonl"
    runs = [{"hook": "truncating_bf16", "steps": 60, "watch": True,
             "sentinel_kwargs": {"findings": str(found), "stop_on_finding": True}},
            {"hook": "rounding_bf16", "steps": 60, "watch": True},
            {"hook": "allreduce", "steps": 60, "watch": True}]
    out = launch(runs_task, 2, args=(runs,), timeout=300)
    trunc = [rank[0] for rank in out]
    assert trunc[0]["stopped_at"] == trunc[1]["stopped_at"] and trunc[0]["stopped_at"] <= 30
    lines = [Result.from_json(x) for x in found.read_text().splitlines()]
    first = lines[0]
    assert first.verdict == "fail" and first.codes == ["TP-B1"] and first.metrics["bias"] < -1e-3
    assert first.evidence["hook_registered_in_ddp"] == "truncating_bf16_hook"
    for i, hook in ((1, "rounding_bf16"), (2, "allreduce")):
        v = _verdicts([out[0][i]])
        assert v and all(r.verdict == "pass" and r.metrics["biased"] is False for r in v.values()), \
            [r.message for r in v.values()]
        pooled = [r for t, r in v.items() if t.endswith(".all_buckets")]
        assert len(pooled) == 1 and pooled[0].metrics["trials"] >= 8 and len(v) >= 3
        if hook == "rounding_bf16":  # a large error, and symmetric
            assert all(r.metrics["std"] > 1e-6 and abs(r.metrics["bias"]) < 2.0 ** -12 for r in v.values())
        assert {r.evidence["hook_registered_in_ddp"] for r in v.values()} == {
            "bf16_allreduce_hook" if hook == "rounding_bf16" else "allreduce_hook"}


@pytest.mark.slow
def test_a_hook_ddp_refuses_by_name_is_still_refused():
    """torch 2.13 CPU: DDP refuses bf16_compress_hook by name (CUDA and NCCL required). The
    sentinel's wrapper carries the name, so the run fails as it would without it, and does
    not train with a hook DDP would not have run."""
    refused, ok = launch(refusal_task, 1, args=(["bf16_compress_hook", "rounding_bf16"],), timeout=120)[0]
    if not torch.cuda.is_available():
        assert refused.startswith("TypeError") and "NCCL" in refused, refused
    assert ok == ""


@pytest.mark.slow
def test_trainer_callback_sends_the_verdict_to_trainer_log():
    """transformers 5.25 Trainer, DDP on 2 gloo ranks: a truncating hook is biased by step
    30 and Trainer.log carries the sentinel's numbers at every look."""
    out = launch(trainer_task, 2, args=("truncating_bf16", 30), timeout=600)
    fails = [Result.from_json(x) for x in out[0]["results"]]
    fails = [r for r in fails if r.verdict == "fail"]
    assert fails and fails[0].codes == ["TP-B1"] and fails[0].metrics["bias"] < -1e-3
    logged = out[0]["logged"]
    assert [h["sentinel/step"] for h in logged[:3]] == [10, 20, 30]
    assert logged[-1]["sentinel/biased_buckets"] >= 1 and logged[-1]["sentinel/biased"] == 1
    # logged after close too: the final judgements do not count the same findings again
    assert logged[-1]["sentinel/findings"] == logged[-2]["sentinel/findings"] >= 1


@pytest.mark.slow
def test_trainer_not_under_ddp_is_refused_up_front(tmp_path):
    from trainprobes.watch import SentinelCallback
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True)
    net = torch.nn.Linear(2, 1)
    trainer = Trainer(model=net, args=args, train_dataset=[{"x": torch.zeros(2)}])
    cb = SentinelCallback(Sentinel(), trainer)
    with pytest.raises(InvalidArgument, match="not DistributedDataParallel: the sentinel watches"):
        cb.on_train_begin(args, None, None)


@pytest.mark.slow
def test_lightning_callback_names_the_hook_ddp_ran():
    """Lightning 2.6.6, torch 2.13 CPU: DDPStrategy(ddp_comm_hook=truncating) is dropped on
    CPU without a word; the sentinel (hook left to its default) says DDP ran allreduce_hook,
    finds the run clean, and the logger gets its numbers at every look."""
    pytest.importorskip("lightning")
    out = launch(lightning_task, 2, args=("none", 30, None, "truncating_bf16"), timeout=300)
    final = _verdicts([out[0]])
    assert {r.evidence["hook_registered_in_ddp"] for r in final.values()} == {"allreduce_hook"}
    assert all(r.verdict == "pass" for r in final.values()), [r.message for r in final.values()]
    assert out[0]["logged"]["sentinel/step"] == 30 and out[0]["logged"]["sentinel/biased_buckets"] == 0


def _fed(tmp_path, errors, **kw) -> Sentinel:
    """A sentinel whose bucket stream is fed by hand (no ranks): what step() and close() do."""
    s = Sentinel(findings=tmp_path / "f.jsonl", rank=0, **kw)
    stream = s.streams.stream("bucket0", 1000)
    for i, e in enumerate(errors):
        stream.add(i, e)
    return s


def test_a_finding_is_a_bias_result_written_as_it_happens_and_can_stop_the_run(tmp_path):
    from trainprobes.result import PROBES
    from trainprobes.watch import SentinelFinding
    s = _fed(tmp_path, [-4.7e-3, -4.8e-3, -4.6e-3, -4.75e-3], stop_on_finding=True)
    for _ in range(9):
        assert s.step() == []
    with pytest.raises(SentinelFinding) as e:
        s.step()
    assert e.value.exit_code == 1
    lines = [Result.from_json(x) for x in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert [r.verdict for r in lines] == ["fail", "fail"]  # the finding, then the final judgement
    r = lines[0]
    assert r.probe == "numerics.bias" and r.codes == ["TP-B1"] and r.evidence["found_at_step"] == 10
    assert all(PROBES["numerics.bias"].documents(k) for k in r.metrics)
    assert "biased since step 10" in r.message and r.metrics["ci_high"] < 0


def test_symmetric_noise_passes_and_an_existing_findings_file_is_refused(tmp_path):
    from trainprobes.errors import OutputExists
    g = torch.Generator().manual_seed(0)
    s = _fed(tmp_path, (torch.randn(40, generator=g, dtype=torch.float64) * 1e-3).tolist())
    for _ in range(30):
        s.step()
    (r,) = s.close()
    assert r.verdict == "pass" and r.metrics["biased"] is False and "noise" in r.message
    with pytest.raises(OutputExists, match="append=True"):
        Sentinel(findings=tmp_path / "f.jsonl", rank=0)
    Sentinel(findings=tmp_path / "f.jsonl", rank=0, append=True)


def _packed_trainer(tmp_path, ones_mask: bool, use_cache: bool):
    from trainprobes.isolation.hf import tiny_model
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    flatten = DataCollatorWithFlattening(return_tensors="pt")

    def collate(features):
        b = flatten(features)
        if ones_mask:  # the trap: a padding mask of a row without padding
            b["attention_mask"] = torch.ones_like(b["input_ids"])
        return b
    model = tiny_model("llama", "sdpa")
    model.config.use_cache = use_cache
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in (5, 7, 4, 6)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collate)


@pytest.mark.slow
def test_packing_check_on_the_runs_collator_catches_the_all_ones_mask(tmp_path):
    """transformers 5.25, tiny Llama, sdpa: DataCollatorWithFlattening's restarting position
    ids beside an all-ones mask are read as one sequence (leaky, TP-I1); without the mask and
    with use_cache=False the documents are isolated. The check leaves the model's mode, its
    weights and the global generator as they were."""
    from trainprobes.watch import SentinelCallback
    leaky = _packed_trainer(tmp_path, ones_mask=True, use_cache=False)
    before = (torch.random.get_rng_state(), {k: v.clone() for k, v in leaky.model.state_dict().items()})
    leaky.model.train()
    s = Sentinel(findings=tmp_path / "p.jsonl", rank=0)
    r = SentinelCallback(s, leaky).check_packing()
    assert r.probe == "isolation.documents" and r.verdict == "fail" and r.codes == ["TP-I1"]
    assert r.metrics["isolated"] is False and "attention_mask" in r.target
    assert Result.from_json((tmp_path / "p.jsonl").read_text().splitlines()[0]) == r
    assert leaky.model.training and torch.equal(before[0], torch.random.get_rng_state())
    assert all(torch.equal(v, before[1][k]) for k, v in leaky.model.state_dict().items())
    clean = _packed_trainer(tmp_path, ones_mask=False, use_cache=False)
    r = SentinelCallback(Sentinel(), clean).check_packing()
    assert r.verdict == "pass" and r.metrics["isolated"] is True, r.message


def test_buckets_are_checked_alike_at_a_bounded_cost_and_every_rank_chooses_the_same():
    """4 buckets a step, sample 0.25, max_per_step 1: each bucket is checked in about 1/16
    of the steps (the last as often as the first), never two in one step, and two
    sentinels with one seed (two ranks) choose the same windows."""
    a, b = Sentinel(seed=3), Sentinel(seed=3)
    counts, per_step = [0] * 4, []
    for _ in range(800):
        picks = [a._choose(100_000) for _ in range(4)]
        assert picks == [b._choose(100_000) for _ in range(4)]
        per_step.append(sum(p is not None for p in picks))
        for i, p in enumerate(picks):
            counts[i] += p is not None
        a.step(), b.step()
    assert max(per_step) == 1
    assert all(25 <= c <= 80 for c in counts), counts  # binomial(800, 1/16): 50 +- 7


def test_the_quick_look_gives_the_full_tests_verdict():
    """A look clears a stream on the t-test alone when it plainly passes; on streams near
    and far from the boundary the verdicts equal those of error_stats at the same level."""
    from trainprobes.numerics.bias import error_stats
    g = torch.Generator().manual_seed(1)
    for shift in (0.0, 0.3, 0.6, 1.0, 3.0):
        for _ in range(20):
            e = (torch.randn(12, generator=g, dtype=torch.float64) + shift).mul(1e-3).tolist()
            quick, full = Streams(alpha=0.05, min_effect=0.0, keep=100), None
            s = quick.stream("b", 1)
            for x in e:
                s.add(0, x)
            (j,) = quick.look(1)
            full = error_stats(e, alpha=j.alpha, min_effect=0.0)["biased"]
            assert j.biased == full, (shift, e)


@pytest.mark.slow
def test_a_failure_on_one_rank_skips_that_sample_on_every_rank():
    """Rank 1's copy of its 2nd and 5th samples raises. Every rank still issues the same fp64
    reductions (rank 1 sends its 'could not' flag), so both ranks leave exactly those samples
    out and pair every other one right: an fp32 run stays clean, bit for bit as without the
    sentinel. (A rank that skipped its reduction paired its next one with the other rank's
    current one: an fp32 run was called biased.)"""
    kw = {"sample": 1.0, "interval": 5}
    runs = [{"hook": "allreduce", "steps": 30, "watch": w, "sentinel_kwargs": kw,
             "break_takes": {1: [1, 4]}} for w in (False, True)]
    out = launch(runs_task, 2, args=(runs,), timeout=180)
    for r, (plain, watched) in enumerate(out):
        assert _same(plain, watched), f"rank {r}"
        assert watched["skipped"] == 2, f"rank {r}: {watched['skipped']}"
    assert out[0][1]["own_errors"] == 0 and out[1][1]["own_errors"] == 2
    v = _verdicts([out[0][1]])
    assert all(r.verdict == "pass" for r in v.values()), [r.message for r in v.values()]
    pooled = v["watch:ddp[allreduce_hook].all_buckets"]
    assert pooled.metrics["trials"] == 28 and pooled.evidence["skipped_samples"] == 2
    assert "2 samples skipped" in pooled.message
    assert abs(pooled.metrics["bias"]) < 1e-6


@pytest.mark.slow
def test_a_sampling_plan_that_differs_between_ranks_is_refused_on_every_rank():
    out = launch(plan_task, 2, args=([{"seed": 0}, {"seed": 1}],), timeout=120)
    for msg in out:
        assert msg.startswith("InvalidArgument: the sentinel's seed differs between ranks"), msg
        assert "same arguments" in msg
    assert "seed=1 here, on rank 1" in out[1]
    assert launch(plan_task, 2, args=([{"seed": 0}, {"seed": 0}],), timeout=120) == ["", ""]


@pytest.mark.slow
def test_error_feedback_is_not_called_a_compounding_bias():
    """torch's powerSGD_hook (rank 1, error feedback, compressing from step 2) on 2 gloo
    ranks: each step's error is carried to the next, so the per-step test does not apply:
    cannot judge, with the reason, and nothing sampled (the run bit for bit as without).
    Before, its per-step errors (about -50%) were called biased. One bucket: torch 2.13's
    PowerSGD waits on a nested all_reduce inside a future callback, which deadlocks gloo
    (CPU) once buckets outnumber gloo's worker threads, with or without the sentinel."""
    runs = [{"hook": "powerSGD", "steps": 30, "watch": w, "sentinel_kwargs": {"sample": 1.0},
             "bucket_cap_mb": 25.0} for w in (False, True)]
    out = launch(runs_task, 2, args=(runs,), timeout=180)
    for r, (plain, watched) in enumerate(out):
        assert _same(plain, watched), f"rank {r}"
    results = [Result.from_json(x) for x in out[0][1]["results"]]
    assert not [r.message for r in results if r.verdict == "fail"]
    (res,) = results
    assert res.verdict == "error" and res.metrics["biased"] is None and res.codes == ["TP-E1"]
    assert "error feedback" in res.message and "PowerSGDState.use_error_feedback=True" in res.message
    assert res.evidence["hook_registered_in_ddp"] == "powerSGD_hook"


@pytest.mark.slow
def test_a_ddp_on_a_subgroup_is_watched_on_that_subgroup():
    """3 gloo ranks, DDP on the subgroup {0, 1}, rank 2 idle: the sentinel's group holds
    ranks 0 and 1 (rank 2 need not take part), the default hook (no state given) reduces
    over DDP's group, not the default group, and the run is bit for bit as DDP's built-in
    reduction on that group."""
    kw = {"sample": 1.0, "interval": 5}
    runs = [{"hook": "none", "steps": 12, "watch": w, "sentinel_kwargs": kw, "group_ranks": [0, 1]}
            for w in (False, True)]
    out = launch(runs_task, 3, args=(runs,), timeout=180)
    assert out[2] == [{}, {}]
    for r in (0, 1):
        plain, watched = out[r]
        assert _same(plain, watched), f"rank {r}"
        assert watched["sentinel_group"] == [0, 1]
    v = _verdicts([out[0][1]])
    assert v and all(r.verdict == "pass" for r in v.values()), [r.message for r in v.values()]


def test_the_rank_that_writes_is_read_when_writing(tmp_path, monkeypatch):
    """A callback built before the process group exists (Lightning): the rank is read when a
    Result is written, so only rank 0 writes the findings file."""
    monkeypatch.delenv("RANK", raising=False)
    found = tmp_path / "f.jsonl"
    s = Sentinel(findings=found)
    r = Result(probe="numerics.bias", target="watch:ddp", verdict="error", seed=0,
               metrics={"biased": None, "trials": 0}, codes=["TP-E1"], message="x")
    monkeypatch.setenv("RANK", "1")
    s.report(r)
    assert not found.exists() and s.rank == 1
    monkeypatch.setenv("RANK", "0")
    s.report(r)
    assert len(found.read_text().splitlines()) == 1


def test_a_findings_file_that_exists_is_refused_at_the_first_write_when_the_rank_was_unknown(
        tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    found = tmp_path / "f.jsonl"
    s = Sentinel(findings=found)  # rank unknown yet: not refused here
    found.write_text("someone else's\n")
    r = Result(probe="numerics.bias", target="watch:ddp", verdict="error", seed=0,
               metrics={"biased": None, "trials": 0}, codes=["TP-E1"], message="x")
    s.report(r)
    s.report(r)
    assert found.read_text() == "someone else's\n"
    assert s.error_count == 1 and "append=True" in s.errors[0]  # refused once, then silent


class _DrawingCollator:
    """DataCollatorWithFlattening, then labels masked at random from its own generator and
    from python's, numpy's and torch's global ones (as MLM masking collators draw)."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening
        self.flatten = DataCollatorWithFlattening(return_tensors="pt")
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, features):
        import random

        import numpy as np
        b = self.flatten(features)
        labels = b["labels"]
        keep = (torch.rand(labels.shape, generator=self.generator) < 0.8) & (torch.rand(labels.shape) < 0.9)
        labels = labels.where(keep, torch.full_like(labels, -100))
        labels.view(-1)[random.randrange(labels.numel())] = -100
        labels.view(-1)[int(np.random.randint(labels.numel()))] = -100
        b["labels"] = labels
        return b


def _drawing_run(tmp_path, check: bool):
    from trainprobes.isolation.hf import tiny_model
    from trainprobes.watch import SentinelCallback
    from transformers import Trainer, TrainingArguments
    model = tiny_model("llama", "sdpa", seed=0)
    model.config.use_cache = False
    model.train()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()}
            for n in (5, 7, 4, 6, 5, 8, 3, 6, 7, 4, 5, 6)]
    args = TrainingArguments(output_dir=str(tmp_path / f"out{check}"), use_cpu=True, max_steps=3,
                             per_device_train_batch_size=4, logging_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=_DrawingCollator())
    r = None
    if check:  # what on_train_begin does first (the rest of it needs DDP)
        r = SentinelCallback(Sentinel(), trainer).check_packing()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return r, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_the_packing_check_leaves_a_drawing_collator_and_the_run_as_they_were(tmp_path):
    """transformers 5.25: a collator that draws from its own generator and from python's,
    numpy's and torch's: a run with the packing check is bit for bit the run without it."""
    r, with_check, w1 = _drawing_run(tmp_path, True)
    assert r is not None and r.probe == "isolation.documents", r  # the check did run
    _, without, w0 = _drawing_run(tmp_path, False)
    assert len(with_check) == 3 and with_check == without
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
