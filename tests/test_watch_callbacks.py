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


def test_lightning_callback_watches_routers_and_updates(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from test_watch_router import TinyMoe
    from trainprobes.watch.lightning import SentinelLightning

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyMoe()

        def training_step(self, batch, i):
            (ids,) = batch
            out = self.net(ids)
            return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    torch.manual_seed(0)
    module = Module().to(torch.bfloat16)
    ids = torch.randint(0, 32, (40, 12), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    s = Sentinel(interval=5)
    trainer = L.Trainer(max_steps=10, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[SentinelLightning(s, ddp=False, routers=True, updates=True,
                                                     router_every=5)])
    trainer.fit(module, loader)
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
