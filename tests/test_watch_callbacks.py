"""The router and update watches through the Trainer and Lightning callbacks, in a single
process (ddp=False): attached at train start, stepped per step, numbers in the trainer's log,
Results at the end (transformers 5.25, Lightning 2.6.6, torch 2.13 CPU)."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.watch import Sentinel


def test_trainer_callback_watches_routers_and_updates(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainprobes.watch.trainer import SentinelCallback
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=4,
                                     num_experts_per_tok=2, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (12, 10), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6,
                                          per_device_train_batch_size=2, report_to=[],
                                          use_cpu=True, logging_steps=100, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    s = Sentinel(interval=3, findings=tmp_path / "f.jsonl")
    trainer.add_callback(SentinelCallback(s, trainer, ddp=False, packing=False, routers=True,
                                          updates=True, router_every=2))
    trainer.train()
    by = {r.target: r for r in s.results}
    router = by["watch:router[model.layers.0.mlp.gate]"]
    assert router.verdict == "pass" and router.metrics["checks"] == 3  # steps 0, 2, 4
    upd = [r for t, r in by.items() if t.startswith("watch:updates") and t.endswith("].all_groups")]
    assert upd and upd[0].verdict == "pass" and upd[0].metrics["trials"] == 6
    logged = [h for h in trainer.state.log_history if "sentinel/router_checks" in h]
    assert logged and logged[-1]["sentinel/update_checks"] == 6
    assert "watch:ddp" not in by  # not attached to DDP: no claim about a reduction
    assert (tmp_path / "f.jsonl").read_text().count("watch:router") == 1


def _moe_module(L, optimizer, float_out=False):
    """A LightningModule training test_watch_router's MoE LM (ids -> next-token loss) with
    optimizer(params); float_out: the loss on fp32 logits (under autocast)."""
    from test_watch_router import TinyMoe

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyMoe()

        def training_step(self, batch, i):
            (ids,) = batch
            out = self.net(ids)  # dropout draws from the global generator
            out = out.float() if float_out else out
            return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return optimizer(self.parameters())

    return Module()


def _fit(L, module, callbacks, *, rows=40, max_steps=10, **trainer):
    """Fit module on `rows` fixed sequences of 12 token ids (batches of 4) with a quiet
    CPU Trainer: no logger, checkpoints, progress bar or model summary."""
    ids = torch.randint(0, 32, (rows, 12), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=callbacks, **trainer).fit(module, loader)


def test_lightning_callback_watches_routers_and_updates(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning

    torch.manual_seed(0)
    module = _moe_module(L, lambda params: torch.optim.Adam(params, lr=1e-5)).to(torch.bfloat16)
    s = Sentinel(interval=5)
    _fit(L, module, [SentinelLightning(s, ddp=False, routers=True, updates=True, router_every=5)])
    by = {r.target: r for r in s.results}
    assert by["watch:router[net.moe.router]"].verdict == "pass"
    assert by["watch:router[net.moe.router]"].metrics["checks"] == 2
    upd = [r for t, r in by.items() if t.startswith("watch:updates") and t.endswith("].all_groups")]
    assert upd[-1].verdict == "fail" and upd[-1].metrics["stalled_share"] > 0.5  # bf16, lr 1e-5


def test_a_callback_that_would_watch_nothing_is_refused():
    pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning
    with pytest.raises(InvalidArgument, match="watch nothing"):
        SentinelLightning(Sentinel(), ddp=False, packing=False)
    with pytest.raises(InvalidArgument, match="packing='yes'"):
        SentinelLightning(Sentinel(), ddp=False, packing="yes")


def _llama_trainer(tmp_path, name, callback_kwargs):
    """A tiny Llama (random init, attention dropout drawing from the global generator) under
    transformers.Trainer in one process; callback_kwargs None: no sentinel at all."""
    transformers = pytest.importorskip("transformers")
    from trainprobes.watch.trainer import SentinelCallback
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 32), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=4,
                                          per_device_train_batch_size=4, report_to=[], seed=0,
                                          use_cpu=True, logging_steps=1, save_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    s = None
    if callback_kwargs is not None:
        s = Sentinel(interval=2)
        trainer.add_callback(SentinelCallback(s, trainer, ddp=False, packing=False, **callback_kwargs))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, s, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_callback_watches_gemms_and_changes_no_bit(tmp_path):
    """gemms=True: watch_gemms' defaults (fp8-tensor on h200-scaled-mm, wgrad, every 50 steps)
    on the Trainer's model; a dict picks other arguments. Losses and weights after 4 steps
    are those of the same Trainer without the sentinel."""
    _, _, plain_losses, plain = _llama_trainer(tmp_path, "plain", None)
    trainer, s, losses, weights = _llama_trainer(tmp_path, "defaults", {"gemms": True})
    assert len(losses) == 4 and losses == plain_losses
    assert all(torch.equal(plain[k], weights[k]) for k in plain)
    (w,) = s.watches
    assert (w.recipe, w.preset, w.every, w.gemms) == ("fp8-tensor", "h200-scaled-mm", 50, ("wgrad",))
    checked = [r for r in s.results if r.target.startswith("watch:gemm[") and "checks" in r.metrics]
    assert len(checked) == 1 and checked[0].metrics["checks"] == 1  # step 0 only, one Linear
    assert checked[0].metrics["recipe"] == "fp8-tensor" and s.errors == []
    assert checked[0].metrics["gemm"] == "wgrad" and checked[0].metrics["k"] >= 2
    assert trainer.state.log_history[-1]["sentinel/gemm_checks"] == 1
    # a dict: exact operands on an fp32 accumulator every 2 steps: steps 0 and 2, noise
    _, s, losses, weights = _llama_trainer(tmp_path, "dict", {"gemms": {
        "recipe": "exact", "preset": "fp32", "every": 2, "samples": 64}})
    assert losses == plain_losses and all(torch.equal(plain[k], weights[k]) for k in plain)
    checked = [r for r in s.results if r.target.startswith("watch:gemm[") and "checks" in r.metrics]
    assert sum(r.metrics["checks"] for r in checked) == 2 and s.errors == []
    assert all(r.verdict == "pass" and r.metrics["biased"] is False for r in checked), \
        [r.message for r in checked]


@pytest.mark.parametrize("gemms, words", [
    ("yes", "pass True"),
    ({"recipie": "fp8-tensor"}, "'recipie', not an argument of watch_gemms"),
    ({"model": None}, "'model', not an argument"),
])
def test_a_bad_gemms_option_is_refused_naming_it(gemms, words):
    pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning
    with pytest.raises(InvalidArgument, match=words):
        SentinelLightning(Sentinel(), ddp=False, gemms=gemms)


def _lightning_fit(gemms):
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning

    torch.manual_seed(0)
    module = _moe_module(L, lambda params: torch.optim.Adam(params, lr=1e-3))
    s = Sentinel(interval=5)
    _fit(L, module, [SentinelLightning(s, ddp=False, packing=False, gemms=gemms)] if gemms is not None else [])
    return s, {k: v.detach().clone() for k, v in module.state_dict().items()}, torch.get_rng_state()


def test_lightning_callback_watches_gemms_and_changes_no_bit():
    """gemms={...}: every Linear of the LightningModule a candidate, one call's three GEMMs
    every 5 steps (steps 0 and 5) on an fp32 accumulator: noise; the weights and the global
    generator after 10 steps are those of the same fit without the callback."""
    _, plain, plain_rng = _lightning_fit(None)
    s, weights, rng = _lightning_fit({"recipe": "exact", "preset": "fp32", "every": 5,
                                      "samples": 64, "gemms": ("fprop", "dgrad", "wgrad")})
    assert all(torch.equal(plain[k], weights[k]) for k in plain) and torch.equal(plain_rng, rng)
    checked = [r for r in s.results if r.target.startswith("watch:gemm[") and "checks" in r.metrics]
    assert sum(r.metrics["checks"] for r in checked) == 2 * 3 and s.errors == []
    assert all(r.verdict == "pass" for r in checked), [r.message for r in checked]


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_lightning_update_watch_replays_the_steps_own_gradient(opt):
    """Lightning calls optimizer.step(closure) and runs forward and backward inside it, after
    torch's step pre-hooks: a replay made in the pre-hook used the previous step's gradient
    (fp32 AdamW off by -0.2 to -0.5, SGD by -1.0, called biased). The callback replays at
    on_before_optimizer_step, after the closure's backward: fp32 is rounding noise at every
    step, all 10 checked, none biased."""
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning

    torch.manual_seed(0)
    module = _moe_module(L, lambda params: torch.optim.AdamW(params, lr=1e-3) if opt == "adamw"
                           else torch.optim.SGD(params, lr=0.1, momentum=0.9))
    s = Sentinel(interval=5)
    _fit(L, module, [SentinelLightning(s, ddp=False, packing=False, updates=True)])
    (w,) = s.watches
    errors = list(w.streams.streams["all_groups"].errors)
    assert len(errors) == 10 and s.errors == [], (errors, s.errors)
    assert max(abs(e) for e in errors) < 1e-5, errors
    assert not any(r.verdict == "fail" for r in s.results), [r.message for r in s.results]


def test_lightning_steps_the_sentinel_once_per_optimizer_step():
    """accumulate_grad_batches=4: the sentinel's step is the optimizer's, as under the Trainer
    callback. Stepped per batch, each micro-batch was a step of its own: the accumulation
    watch restarted its fp64 sum at every micro-batch (it reported 'up to 1 micro-batches'
    and never judged an accumulation), and every= counted batches."""
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning

    torch.manual_seed(0)
    s = Sentinel(interval=3)
    _fit(L, _moe_module(L, lambda params: torch.optim.AdamW(params, lr=1e-3)),
         [SentinelLightning(s, ddp=False, packing=False, updates=True)], rows=48, max_steps=3,
         accumulate_grad_batches=4)
    (w,) = s.watches
    assert s.steps == 3 and w.checked_steps == 3 and s.errors == []
    assert w.contributions == 4
    acc = w.streams.streams["accumulation.all_groups"]
    assert len(acc.errors) == 3 and max(abs(e) for e in acc.errors) < 1e-5, list(acc.errors)


@pytest.mark.slow
def test_lightning_bf16_mixed_with_accumulation_changes_no_bit_with_gemms_and_updates():
    """precision='bf16-mixed' on CPU (autocast), accumulate_grad_batches=2, the GEMM watch on
    every step's three GEMMs and the update watch: weights and the global generator after 6
    optimizer steps are those of the same fit without the callback."""
    L = pytest.importorskip("lightning.pytorch")
    from trainprobes.watch.lightning import SentinelLightning

    def fit(on):
        torch.manual_seed(0)
        module = _moe_module(L, lambda params: torch.optim.AdamW(params, lr=1e-3), float_out=True)
        s = Sentinel(interval=3)
        cbs = [SentinelLightning(s, ddp=False, packing=False, updates=True, gemms={
            "every": 1, "gemms": ("fprop", "dgrad", "wgrad"), "samples": 64})] if on else []
        _fit(L, module, cbs, rows=48, max_steps=6, precision="bf16-mixed", accumulate_grad_batches=2)
        return s, {k: v.detach().clone() for k, v in module.state_dict().items()}, torch.get_rng_state()

    _, plain, plain_rng = fit(False)
    s, weights, rng = fit(True)
    assert all(torch.equal(plain[k], weights[k]) for k in plain) and torch.equal(plain_rng, rng)
    assert s.errors == [] and s.steps == 6
    checks = [r for r in s.results if r.target.startswith("watch:gemm[") and "checks" in r.metrics]
    assert sum(r.metrics["checks"] for r in checks) == 6 * 3
    upd = [r for r in s.results if r.target.endswith("].all_groups")][-1]
    assert upd.verdict == "pass", upd.message  # fp32 weights: noise
