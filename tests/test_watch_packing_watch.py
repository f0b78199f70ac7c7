"""trainprobes.watch.packing_watch: packed-document isolation on the run's real batches, at
the first batch and whenever the packing convention changes, through the Trainer and
Lightning callbacks (transformers 5.25, Lightning 2.6.6, torch 2.13 CPU; tiny Llama, sdpa,
random init, no download)."""
import re

import pytest
import torch
from trainprobes.watch import Sentinel, SentinelFinding
from trainprobes.watch.packing_watch import watch_packing

SWITCH = 3  # the step at which the collator switches from padded rows to packed documents


class SwitchingCollator:
    """Padded rows (attention_mask with zeros, no position ids) for the first `at` batches,
    then DataCollatorWithFlattening, with an all-ones mask beside it when mask=True (the
    trap). Batches are made in order, so batch i is step i's (one batch per step)."""

    def __init__(self, at: int, mask: bool):
        from transformers import DataCollatorWithFlattening
        self.calls, self.at, self.mask = 0, at, mask
        self.flatten = DataCollatorWithFlattening(return_tensors="pt")

    def __call__(self, features):
        i, self.calls = self.calls, self.calls + 1
        if i < self.at:
            L = max(len(f["input_ids"]) for f in features)
            ids = torch.zeros(len(features), L, dtype=torch.long)
            m = torch.zeros_like(ids)
            for r, f in enumerate(features):
                n = len(f["input_ids"])
                ids[r, :n], m[r, :n] = torch.tensor(f["input_ids"]), 1
            return {"input_ids": ids, "attention_mask": m, "labels": ids.masked_fill(m == 0, -100)}
        b = self.flatten(features)
        if self.mask:
            b["attention_mask"] = torch.ones_like(b["input_ids"])
        return b


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 128, (int(k),), generator=g).tolist()}
            for k in torch.randint(3, 9, (n,), generator=g)]


def _trainer_run(tmp_path, *, mask: bool, watch: bool, model_cls=None, steps=6, accumulation=1,
                 checkpointing=False, **sentinel_kw):
    from trainprobes.isolation.hf import tiny_model
    from trainprobes.watch import SentinelCallback
    from transformers import Trainer, TrainingArguments
    model = tiny_model("llama", "sdpa", seed=0, attention_dropout=0.1)  # the run draws
    if model_cls is not None:
        model.__class__ = model_cls
    model.config.use_cache = checkpointing  # Trainer sets it from TrainingArguments.use_cache
    model.train()
    args = TrainingArguments(output_dir=str(tmp_path / f"out{watch}"), use_cpu=True,
                             max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                             gradient_accumulation_steps=accumulation,
                             gradient_checkpointing=checkpointing, use_cache=checkpointing)
    trainer = Trainer(model=model, args=args, train_dataset=_data(),
                      data_collator=SwitchingCollator(SWITCH * accumulation, mask))
    s = Sentinel(**sentinel_kw)
    if watch:
        trainer.add_callback(SentinelCallback(s, trainer, ddp=False))
    error = None
    try:
        trainer.train()
    except SentinelFinding as e:
        error = e
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return s, trainer, losses, weights, error


@pytest.mark.slow
def test_a_collator_switching_to_the_trap_is_caught_at_the_step_it_switches(tmp_path):
    """Padded batches for 3 steps (not packed: nothing checked), then flattened documents
    beside an all-ones mask: leaky, TP-I1, at step 3, with the convention in the evidence;
    the run goes on, and trains bit for bit as without the watch (dropout on)."""
    s, trainer, losses, weights, _ = _trainer_run(tmp_path, mask=True, watch=True,
                                                  findings=tmp_path / "f.jsonl", rank=0)
    leaks = [r for r in s.results if r.probe == "isolation.documents"]
    assert len(leaks) == 1, [r.message for r in s.results]
    (r,) = leaks
    assert r.verdict == "fail" and r.codes == ["TP-I1"] and r.metrics["isolated"] is False
    assert r.evidence["step"] == SWITCH  # the finding first, then where it was seen
    assert re.match(r"\d+ of \d+ \(source, affected\) document pairs leak", r.message), r.message
    assert r.message.endswith(")") and f"(step {SWITCH}, batch convention mask=2d-ones" in r.message
    assert r.evidence["convention_fields"]["mask"] == "2d-ones"
    assert r.evidence["convention_fields"]["positions"] == "restart"
    assert "mask=2d-ones positions=restart" in r.evidence["convention"]
    assert trainer.state.global_step == 6 and s.error_count == 0
    assert s.summary()["sentinel/packing_conventions"] == 2  # padded, then the trap
    assert s.summary()["sentinel/packing_checks"] == 1  # the trap, once, not every batch
    assert "TP-I1" in (tmp_path / "f.jsonl").read_text()
    _, _, without, w0, _ = _trainer_run(tmp_path, mask=True, watch=False)
    assert len(losses) == 6 and losses == without
    assert all(torch.equal(w0[k], weights[k]) for k in w0)


@pytest.mark.slow
def test_a_run_that_stays_isolated_raises_nothing(tmp_path):
    """The same switch without the mask: checked once at step 3 (dropout is on in the run,
    off in the check), isolated, no finding, nothing of its own gone wrong."""
    s, trainer, _, _, error = _trainer_run(tmp_path, mask=False, watch=True, stop_on_finding=True)
    assert error is None and trainer.state.global_step == 6
    (r,) = [r for r in s.results if r.probe == "isolation.documents"]
    assert r.verdict == "pass" and r.metrics["isolated"] is True and r.evidence["step"] == SWITCH
    assert r.evidence["convention_fields"]["mask"] == "absent" and s.error_count == 0


@pytest.mark.slow
def test_under_gradient_accumulation_the_step_is_the_optimizer_step(tmp_path):
    """2 micro-batches a step, the switch at the 7th batch: caught at step 3 (the
    optimizer step both micro-batches belong to), checked once."""
    s, trainer, _, _, _ = _trainer_run(tmp_path, mask=True, watch=True, accumulation=2, steps=5)
    (r,) = [r for r in s.results if r.probe == "isolation.documents"]
    assert r.verdict == "fail" and r.evidence["step"] == SWITCH and s.error_count == 0
    assert s.watches[0].batches == 10 and s.watches[0].checks == 1


@pytest.mark.slow
def test_stop_on_finding_stops_before_the_leaky_update(tmp_path):
    """The check runs after step 3's backward, before its optimizer step: with
    stop_on_finding the run ends there, 3 updates made, the finding written first."""
    s, trainer, _, _, error = _trainer_run(tmp_path, mask=True, watch=True, stop_on_finding=True)
    assert isinstance(error, SentinelFinding) and error.exit_code == 1
    assert trainer.state.global_step == SWITCH
    assert any(r.codes == ["TP-I1"] for r in error.results)


def _eval_raises():
    from transformers import LlamaForCausalLM

    class EvalRaises(LlamaForCausalLM):
        """Trains as Llama does; raises in eval mode (where the check calls it)."""

        def forward(self, input_ids=None, **kw):  # named: the Trainer keeps that column
            if not self.training:
                raise RuntimeError("this model refuses eval-mode calls")
            return super().forward(input_ids=input_ids, **kw)
    return EvalRaises


@pytest.mark.slow
def test_the_checks_errors_are_its_own_and_never_stop_the_run(tmp_path):
    """A check that raises: counted and logged as the sentinel's own error, the run trains
    bit for bit as without the watch (stop_on_finding on), and the final Result says it
    cannot judge (never a pass)."""
    cls = _eval_raises()
    s, trainer, losses, weights, error = _trainer_run(tmp_path, mask=True, watch=True,
                                                      model_cls=cls, stop_on_finding=True)
    assert error is None and trainer.state.global_step == 6
    assert s.error_count == 1 and "refuses eval-mode calls" in s.errors[0]
    (r,) = [r for r in s.results if r.target == "watch:packing"]
    assert r.verdict == "error" and r.codes == ["TP-E1"] and "refuses eval-mode" in r.message
    _, _, without, w0, _ = _trainer_run(tmp_path, mask=True, watch=False, model_cls=cls)
    assert losses == without and all(torch.equal(w0[k], weights[k]) for k in w0)


class Noisy(torch.nn.Module):
    """Logits with noise from torch's global generator on every call, eval mode too:
    nondeterministic, though each token sees only itself."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        return (self.emb(input_ids) + torch.randn(*input_ids.shape, 4),)


def test_nondeterminism_is_cannot_judge_never_a_leak():
    s = Sentinel(stop_on_finding=True)
    model = Noisy().train()
    w = watch_packing(model, s)
    batch = {"input_ids": torch.arange(8)[None] % 16, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    model(**batch)
    after_forward = torch.random.get_rng_state()
    w.check_pending()  # no SentinelFinding: not a finding
    (r,) = s.results
    assert r.verdict == "error" and r.codes == ["TP-E1"] and r.metrics["isolated"] is None
    assert r.evidence["probe_codes"] == ["TP-C2"] and "cannot judge" in r.message
    assert w.leaks == 0 and model.training
    # the check's forwards drew from torch's generator; the run's stream is as it was
    assert torch.equal(torch.random.get_rng_state(), after_forward)


def test_each_convention_is_checked_once_and_the_bound_is_said():
    """max_checks=1: a second packed convention is not checked, and the final Result says
    so (cannot judge); the same convention again is not checked again; eval-mode forwards
    and no_grad ones are not the run's batches."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa")
    model.config.use_cache = False
    s = Sentinel()
    w = watch_packing(model, s, max_checks=1)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, position_ids=pos)  # eval mode: not seen
    model.train()
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)  # no autograd: not a training batch
    assert w.batches == 0
    for step in range(3):
        model(input_ids=(ids + step) % 128, position_ids=pos)
        s.step()
    model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids))
    s.step()
    assert w.checks == 1 and w.batches == 4 and s.results[0].verdict == "pass"
    (final,) = s.close()[1:]
    assert final.verdict == "error" and "max_checks=1" in final.message
    assert "first at step 3" in final.message
    assert w.handle is None  # the hook is gone after close


def test_the_copy_is_new_memory_within_the_budget():
    s = Sentinel(budget=4096, window=16)
    model = Noisy().train()
    w = watch_packing(model, s)
    ids = torch.zeros(1, 8, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    model(input_ids=ids, position_ids=pos)
    (_, _, copy), = w._pending
    assert copy["input_ids"].data_ptr() != ids.data_ptr() and torch.equal(copy["input_ids"], ids)
    big = torch.zeros(1, 1024, dtype=torch.long)  # 8 KiB of ids: over 4096 bytes
    # another convention (a mask beside it), so a new check, whose copy is over budget
    model(input_ids=big, position_ids=torch.arange(1024)[None] % 7, attention_mask=torch.ones_like(big))
    assert s.error_count == 1 and "budget=4096" in s.errors[0] and len(w._pending) == 1
    (final,) = [r for r in s.close() if r.target == "watch:packing"]
    assert final.verdict == "error" and "raise budget" in final.message


@pytest.mark.slow
def test_lightning_switching_collator_is_caught_and_the_run_unchanged(tmp_path):
    """Lightning: the batch on_train_batch_start hands over; the LightningModule's forward
    takes the batch's keys. Caught at the step the collator switches; losses and weights
    bitwise as without the watch; packing=False turns it off."""
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.isolation.hf import tiny_model
    from trainprobes.watch.lightning import SentinelLightning

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_model("llama", "sdpa", seed=0, attention_dropout=0.1).train()
            self.model.config.use_cache = False  # (tiny_model returns it in eval mode)
            self.losses = []

        def forward(self, **kw):
            return self.model(**kw)

        def training_step(self, batch, i):
            loss = self(**batch).loss
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def run(packing):
        torch.manual_seed(0)
        module = Module()
        loader = torch.utils.data.DataLoader(_data(), batch_size=4,
                                             collate_fn=SwitchingCollator(SWITCH, True))
        s = Sentinel()
        cb = [SentinelLightning(s, ddp=False, updates=True, packing=packing)]
        trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=cb)
        trainer.fit(module, loader)
        return s, module.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}

    s, losses, weights = run(True)
    (r,) = [r for r in s.results if r.probe == "isolation.documents"]
    assert r.verdict == "fail" and r.codes == ["TP-I1"] and r.evidence["step"] == SWITCH
    assert s.error_count == 0 and len(losses) == 6
    off, without, w0 = run(False)
    assert not [r for r in off.results if r.probe == "isolation.documents"]
    assert all(torch.equal(a, b) for a, b in zip(losses, without))
    assert all(torch.equal(w0[k], weights[k]) for k in w0)


def test_lightning_tuple_batches_cannot_be_judged_said_once(tmp_path):
    """A batch that is not a dict: one warning, one final cannot-judge Result naming it."""
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4)
    s = Sentinel()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[SentinelLightning(s, ddp=False)])
    trainer.fit(Module(), loader)
    (r,) = [r for r in s.results if r.target == "watch:packing"]
    assert r.verdict == "error" and "is a list, not a dict" in r.message


def test_a_cache_object_in_the_batch_is_not_shared_with_the_check():
    """A non-tensor, non-plain value (a KV cache) would be updated by the check's forwards
    under the run: cannot judge, said, never called."""
    class Cache:
        pass

    class Model(Noisy):
        def forward(self, input_ids, position_ids=None, past_key_values=None):
            return super().forward(input_ids, position_ids)

    s = Sentinel()
    model = Model().train()
    w = watch_packing(model, s)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), position_ids=torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]]),
          past_key_values=Cache())
    assert not w._pending and s.error_count == 1 and "past_key_values (Cache)" in s.errors[0]
    (final,) = s.close()
    assert final.verdict == "error" and "past_key_values" in final.message


def test_a_sharded_model_is_refused_up_front():
    """FSDP2 (fully_shard on a 1-rank gloo group): the check's forward would all-gather on
    one rank only; refused by name, never a hang."""
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from trainprobes.errors import InvalidArgument
    own = not dist.is_initialized()
    if own:
        with socket.socket() as sock:  # a free port: other runs share this machine
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        with pytest.raises(InvalidArgument, match="sharded .*FSDP.*packing=False"):
            watch_packing(model, Sentinel())
    finally:
        if own:
            dist.destroy_process_group()


def _flat_batch(lengths, seed=0):
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(seed)
    feats = [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_tensors="pt")(feats)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_check_judges_the_cache_the_training_forward_had(checkpointing):
    """config.use_cache=True (the default) and padding-free position ids: without a cache
    transformers 5.25 reads the packed position ids into the mask. Under gradient
    checkpointing the training forward turns the cache off (isolated); without it the
    training forward builds a cache (leaky). The check, in eval mode under no_grad, must
    judge the run's forward: isolated with checkpointing, leaky without."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa", seed=0)
    assert model.config.use_cache is True
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    b = _flat_batch([6, 6, 6])
    ids = b["input_ids"]
    other = ids.clone()
    other[0, :6] = (other[0, :6] + 1) % 128
    moved = (model(input_ids=ids, position_ids=b["position_ids"]).logits
             - model(input_ids=other, position_ids=b["position_ids"]).logits)[0, 6:].abs().max()
    assert (moved == 0) == checkpointing  # the run's own training forward, measured
    s = Sentinel()
    w = watch_packing(model, s)
    model(**b).loss.backward()
    w.check_pending()
    (r,) = s.results
    assert r.verdict == ("pass" if checkpointing else "fail"), r.message
    assert model.training and model.config.use_cache is True


def test_a_leaky_4d_mask_after_an_isolated_one_is_caught():
    """Documents declared by seq_idx beside monotone position ids (no restart): a
    block-diagonal 4-D mask at step 0, a full causal one at step 1 (same keys, dtypes,
    ranks): the second is another convention, checked, and leaks."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa", seed=0)
    model.config.use_cache = False
    model.train()
    L, lens = 12, [4, 5, 3]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    block = causal & (seq[0][:, None] == seq[0][None, :])
    s = Sentinel()
    w = watch_packing(model, s)
    g = torch.Generator().manual_seed(0)
    for m in (block, causal):
        ids = torch.randint(0, 128, (1, L), generator=g)
        model(input_ids=ids, attention_mask=m[None, None], position_ids=torch.arange(L)[None],
              seq_idx=seq, labels=ids).loss.backward()
        w.check_pending()
        s.step()
    assert [r.verdict for r in s.results] == ["pass", "fail"]
    assert s.results[1].evidence["step"] == 1 and "4d-crosses" in s.results[1].message


def test_position_ids_it_cannot_read_are_said_once_never_silent():
    """position_ids as [3, B, L] (multimodal RoPE): whether the batch is packed cannot be
    read; a final 'cannot judge' Result names it (not the silence of 'not packed')."""
    s = Sentinel()
    model = Noisy().train()
    w = watch_packing(model, s)
    for _ in range(2):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), position_ids=torch.arange(8).repeat(3, 1, 1))
        s.step()
    assert w.checks == 0
    (final,) = [r for r in s.close() if r.target == "watch:packing"]
    assert final.verdict == "error" and len(w.unjudged) == 1
    assert "step 0" in final.message and "position_ids" in final.message


def test_a_leak_on_a_rank_that_does_not_write_is_logged(tmp_path, caplog):
    """Each rank checks its own batches; only write_rank writes the findings file, so a
    leak found on another rank must at least reach that rank's log."""
    pytest.importorskip("transformers")
    import logging

    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa", seed=0)
    model.config.use_cache = False
    model.train()
    s = Sentinel(rank=1, findings=tmp_path / "f.jsonl")
    w = watch_packing(model, s)
    b = _flat_batch([5, 7])
    with caplog.at_level(logging.WARNING, logger="trainprobes.watch"):
        model(**b, attention_mask=torch.ones_like(b["input_ids"])).loss.backward()
        w.check_pending()
    assert s.results[0].verdict == "fail" and not (tmp_path / "f.jsonl").exists()
    assert any("rank 1" in m and "leak" in m for m in caplog.messages), caplog.messages


def test_a_batch_of_too_many_documents_is_not_checked_and_said():
    """The check costs d + 2 forwards of the batch (measured: 128 documents in 1 x 2048 took
    50 training steps' time on a tiny Llama), a stall on one rank that the other ranks wait
    out at their next all-reduce: past max_documents it is not run, and the final Result
    says cannot judge, naming the bound."""
    class Counting(Noisy):
        calls = 0

        def forward(self, input_ids, position_ids=None, attention_mask=None):
            Counting.calls += 1
            return super().forward(input_ids, position_ids, attention_mask)
    s = Sentinel()
    model = Counting().train()
    w = watch_packing(model, s, max_documents=4)
    model(input_ids=torch.zeros(1, 10, dtype=torch.long), position_ids=(torch.arange(10) % 2)[None])
    w.check_pending()
    assert Counting.calls == 1 and w.checks == 0 and s.error_count == 1
    (final,) = [r for r in s.close() if r.target == "watch:packing"]
    assert final.verdict == "error" and "5 documents" in final.message
    assert "max_documents=4" in final.message


@pytest.mark.slow
def test_under_gradient_checkpointing_an_isolated_run_is_isolated_and_unchanged(tmp_path):
    """TrainingArguments(gradient_checkpointing=True, use_cache=True) (the Trainer copies
    use_cache into the config; a plain or Lightning loop keeps the config's default True):
    the training forward runs without a cache, so the flattened documents are
    isolated; the check says so (no false finding stopping the run), restores the config,
    and the run trains bit for bit as without the watch."""
    s, trainer, losses, weights, error = _trainer_run(
        tmp_path, mask=False, watch=True, checkpointing=True, stop_on_finding=True)
    assert error is None and trainer.state.global_step == 6 and s.error_count == 0
    (r,) = [r for r in s.results if r.probe == "isolation.documents"]
    assert r.verdict == "pass" and r.evidence["step"] == SWITCH and "use_cache" in r.evidence
    assert trainer.model.config.use_cache is True
    _, _, without, w0, _ = _trainer_run(tmp_path, mask=False, watch=False, checkpointing=True)
    assert len(losses) == 6 and losses == without
    assert all(torch.equal(w0[k], weights[k]) for k in w0)


def test_generation_in_training_mode_is_not_a_training_batch():
    """RL trainers generate with the model still in training mode, under no_grad, with a
    left-padded prompt and a cache object: those calls are not the batches the run trains
    on (no autograd), so they are not read (and no cache object is called unjudgeable)."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa", seed=0)
    model.generation_config.pad_token_id = 0
    model.train()
    s = Sentinel()
    w = watch_packing(model, s)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=3,
                       do_sample=False)
    assert w.batches == 0
    s.step()
    assert [r for r in s.close() if r.target == "watch:packing"][0].message.startswith(
        "cannot judge the packing of every batch: no training forward")
    assert s.error_count == 0 and w.unjudged == []


class DictModel(torch.nn.Module):
    """forward(batch): the batch dict passed positionally, as custom loops do."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, batch):
        return (self.emb(batch["input_ids"]),)


def test_a_batch_dict_passed_positionally_is_never_taken_for_token_ids():
    """model(batch) with packed position ids inside: the dict is not input_ids (whose
    convention would say 'not packed' and check nothing, silently); its convention is read,
    and a check that cannot call the model so says cannot judge."""
    s = Sentinel()
    model = DictModel().train()
    w = watch_packing(model, s)
    model({"input_ids": torch.zeros(1, 8, dtype=torch.long),
           "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])})
    s.step()
    assert w.checks == 0 and len(w.seen) == 1 and next(iter(w.seen)).packed
    (final,) = [r for r in s.close() if r.target == "watch:packing"]
    assert final.verdict == "error" and "TypeError" in final.message


def test_positional_arguments_that_are_not_token_ids_cannot_be_read():
    s = Sentinel()
    model = Noisy().train()
    w = watch_packing(model, s)
    with pytest.raises(TypeError):  # the model's own error; the pre-hook has read the call
        model([[0, 1, 2]])  # a list where token ids were expected: not read, said
    (final,) = [r for r in s.close() if r.target == "watch:packing"]
    assert final.verdict == "error" and "not a dict" in final.message and not w.seen


def test_a_mask_of_document_numbers_under_sdpa_is_caught_leaky():
    """axolotl-style packing (document numbers in the 2-D mask, no position ids) on a tiny
    Llama under sdpa: transformers 5.25 reads the mask as 'attend', one sequence per row,
    so the documents leak; before, the batch counted as not packed and nothing was said."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa", seed=0)
    model.config.use_cache = False
    model.train()
    s = Sentinel()
    w = watch_packing(model, s)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 2, 2, 2, 3, 3, 3]])
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    w.check_pending()
    (r,) = s.results
    assert r.verdict == "fail" and r.metrics["n_documents"] == 3
    assert r.evidence["convention_fields"]["mask"] == "2d-ids"


def test_copies_pending_together_stay_within_the_budget():
    """Two new conventions in one optimizer step (gradient accumulation): both copies are
    held until the check, so together they must fit the budget, not each alone."""
    s = Sentinel(budget=4096, window=16)
    model = Noisy().train()
    w = watch_packing(model, s)
    ids = torch.zeros(1, 160, dtype=torch.long)  # 1280 bytes of ids, 1280 of position ids
    pos = (torch.arange(160) % 7)[None]
    model(input_ids=ids, position_ids=pos)
    model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids))  # 3840 more
    assert len(w._pending) == 1 and s.error_count == 1 and "budget=4096" in s.errors[0]


class WideLeaky(torch.nn.Module):
    """Logits over a 50000-token vocabulary from a running sum over the row: every token
    sees the tokens before it, across documents (leaky)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 50000)

    def forward(self, input_ids, position_ids=None):
        return (self.head(self.emb(input_ids).cumsum(1)),)


def test_a_wide_vocabulary_is_compared_at_a_few_columns_and_a_leak_still_shows():
    s = Sentinel()
    model = WideLeaky().train()
    w = watch_packing(model, s)
    model(input_ids=torch.arange(8)[None] % 16, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    w.check_pending()
    (r,) = s.results
    assert r.verdict == "fail" and r.metrics["n_leaks"] == 1  # document 0 -> 1
    assert r.evidence["outputs_compared"].startswith("32 of 50000 output columns")


@pytest.mark.slow
def test_the_checks_memory_does_not_grow_with_the_vocabulary(tmp_path):
    """A 32000-token vocabulary, 1 x 1024 tokens, 16 documents: the check's peak memory
    (this process's max RSS, in a fresh process) grows by less than 200 MiB; comparing full
    logits it grew by 14.6 GiB (d + 2 outputs and their float64 differences)."""
    pytest.importorskip("transformers")
    import subprocess
    import sys
    code = """
import resource, torch
from trainprobes.isolation.hf import tiny_model
from trainprobes.watch import Sentinel
from trainprobes.watch.packing_watch import watch_packing
model = tiny_model("llama", "sdpa", seed=0, vocab_size=32000, max_position_embeddings=2048)
model.config.use_cache = False
model.train()
pos = (torch.arange(1024) % 64)[None]
ids = torch.randint(0, 32000, (1, 1024), generator=torch.Generator().manual_seed(0))
model(input_ids=ids, position_ids=pos, labels=ids).loss.backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
s = Sentinel()
w = watch_packing(model, s)
model(input_ids=ids, position_ids=pos, labels=ids).loss.backward()
w.check_pending()
print(s.results[0].verdict, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    verdict, grew = out.stdout.split()[-2:]
    assert verdict == "pass" and int(grew) < 200, out.stdout + out.stderr[-2000:]


def test_checkpointing_only_some_layers_keeps_the_cache_the_run_has():
    """Gradient checkpointing set on a decoder layer only (LlamaModel's own flag off): the
    training forward still builds its mask with a cache (leaky); the check must not drop
    the cache for it."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    model = tiny_model("llama", "sdpa", seed=0)
    model.gradient_checkpointing_enable()
    model.model.gradient_checkpointing = False
    model.train()
    b = _flat_batch([6, 6, 6])
    other = b["input_ids"].clone()
    other[0, :6] = (other[0, :6] + 1) % 128
    moved = (model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
             - model(input_ids=other, position_ids=b["position_ids"]).logits)[0, 6:].abs().max()
    assert moved > 0  # the run's own training forward leaks
    s = Sentinel()
    w = watch_packing(model, s)
    model(**b).loss.backward()
    w.check_pending()
    assert [r.verdict for r in s.results] == ["fail"]


def test_the_callbacks_pass_max_documents_on():
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    from trainprobes.errors import InvalidArgument
    from trainprobes.watch import SentinelCallback
    from trainprobes.watch.lightning import SentinelLightning

    class Trainerish:
        model_wrapped = model = Noisy()

        def log(self, _):
            pass
    cb = SentinelCallback(Sentinel(), Trainerish(), ddp=False, packing_max_documents=500)
    cb.on_train_begin(None, None, None)
    assert cb._packing.max_documents == 500
    with pytest.raises(InvalidArgument, match="packing_max_documents"):
        SentinelLightning(Sentinel(), ddp=False, packing_max_documents=1)
