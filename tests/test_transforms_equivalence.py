"""trainprobes.transforms.equivalence: bad inputs fail before any rank starts (naming the
argument), what can only be seen on the ranks fails naming it, and the Result's fields."""
import functools

import pytest
import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.reference.bugs import bug, data
from trainprobes.transforms import DDP, Accumulation, Custom, Pipeline, Probe, probe, run_probes
from trainprobes.transforms.demo import step
from trainprobes.transforms.step import TrainingStep
from trainprobes.transforms.zoo import step_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def no_ranks(monkeypatch):
    """Any launch fails the test: the refusal must come first."""
    def refuse(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr("trainprobes.distributed.launcher.launch", refuse)


def fresh_model():
    return torch.nn.Linear(data.D, data.O)


def vector_loss(output, batch):
    return (output - batch["target"]).pow(2).mean(-1)


def zero_loss(output, batch):
    return 0.0 * output.sum()


def raising_loss(output, batch):
    raise KeyError("labels")  # the user's own bug: bad usage (exit 2) as on a rank, not exit 3


@pytest.mark.parametrize("make, match", [
    (lambda: Probe(TrainingStep(fresh_model, step.batch, step.loss), DDP()), "different initial weights"),
    (lambda: Probe(step, Accumulation(micro_batches=3)), "not divisible by world=2 x micro_batches=3"),
    (lambda: Probe(TrainingStep(step.model, step.batch, vector_loss), DDP()), "must return a scalar"),
    (lambda: Probe(step, Pipeline(split=[["0", "1"], ["2", "3"]])), "does not cover the model's children"),
    (lambda: Probe(TrainingStep(step.model, step.batch, lambda o, b: o.mean()), DDP()), "cannot be sent to the ranks"),
    (lambda: Probe(TrainingStep(step.model, step.batch, zero_loss), DDP()), "exactly zero on"),
    (lambda: Probe(step, DDP(), trials=2), "trials=2 must be an int >= 4"),
    (lambda: Probe(TrainingStep(step.model, step.batch, raising_loss), DDP()),
     r"raised on the single device before any rank started \(KeyError"),
    (lambda: Probe(step, "ddp"), "must be a trainprobes.transforms transform"),
])
def test_bad_inputs_fail_before_any_rank_starts(no_ranks, make, match):
    with pytest.raises((InvalidArgument, InvalidType), match=match):
        run_probes([make()], world=2)


def test_world_and_backend_are_checked(no_ranks):
    with pytest.raises(InvalidArgument, match="world=0"):
        run_probes([Probe(step, DDP())], world=0)
    with pytest.raises(InvalidArgument, match="backend='mpi'"):
        run_probes([Probe(step, DDP())], backend="mpi")


def forgets_a_parameter(model, batch, ctx):
    out = model(batch["input"])
    data.loss(out, batch).backward()
    return {"loss": None, "grads": {"0.weight": model[0].weight.grad}}


def local_shard(model, batch, ctx):
    data.loss(model(batch["input"]), batch).backward()
    g = {n: p.grad for n, p in model.named_parameters()}
    g["0.weight"] = g["0.weight"][: 4]
    return {"loss": None, "grads": g}


MLP = TrainingStep(model=data.mlp, batch=functools.partial(data.documents, data.full(4, 4)), loss=data.loss,
                   tokens=data.tokens, name="mlp")


@pytest.mark.slow
@pytest.mark.parametrize("fn, error, match", [
    (forgets_a_parameter, InvalidArgument, r"returned no gradient for 3 parameter\(s\) on any rank, e.g. \['0.bias'"),
    (local_shard, InvalidArgument, r"gradient for '0.weight' of shape \(4, 4\) on rank \d, trial 0; the parameter is \(8, 4\)"),
])
def test_what_only_the_ranks_see_fails_naming_it(fn, error, match):
    with pytest.raises(error, match=match):
        probe(MLP, Custom(fn), world=2, trials=4)


@pytest.mark.slow
def test_the_result_carries_what_ran_and_a_control_its_known_verdict():
    b = bug("partial_window")
    r = probe(step_of(b), Custom(b.fixed, title="twin"), world=2, trials=4, seed=5, expected="pass",
              target="zoo twin")
    m = r.metrics
    assert r.probe == "transforms.equivalence" and r.target == "zoo twin" and r.seed == 5
    assert r.reproduced is True and m["equivalent"] is True and m["transform_verdict"] in ("exact", "noise")
    assert m["transform"] == "custom" and m["world"] == 2 and m["dtype"] == "fp32" and m["backend"] == "gloo"
    for k in ("scale", "scale_ci_low", "scale_ci_high", "worst_parameter", "signed_relative_error",
              "min_detectable_scale_error", "loss_scale"):
        assert k in m
    assert len(r.evidence["trial_seeds"]) == 4 and r.evidence["transform"] == "twin"
    assert r.to_dict()["metrics"]["equivalent"] is True


def test_a_step_that_is_not_a_training_step_is_refused(no_ranks):
    with pytest.raises(InvalidType, match="TrainingStep"):
        run_probes([Probe(object(), DDP())])


def nan_logged_loss(model, batch, ctx):
    """Right gradients (every rank the whole batch), a logged loss that is NaN every trial."""
    loss = data.loss(model(batch["input"]), batch)
    loss.backward()
    return {"loss": loss.detach() * float("nan"), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_a_loss_that_is_nan_on_every_trial_is_wrong_not_missing():
    r = probe(MLP, Custom(nan_logged_loss), world=2, trials=4)
    assert r.metrics["transform_verdict"] == "wrong" and r.metrics["loss_reported"] is True
    assert "<loss>" in r.message and "reports no loss" not in r.message


def test_the_single_device_base_runs_where_the_ranks_compute(monkeypatch):
    # GPU kernels round differently from CPU ones (tensor cores truncate partial sums): a
    # CPU base under NCCL charged that to the transform (FSDP2 bf16 on one H200 rank: biased)
    import trainprobes.transforms.step as step_module
    from trainprobes.transforms import DDP, equivalence
    from trainprobes.transforms.demo import step
    seen = []
    real = step_module.single_device

    def spy(*a, device="cpu", **kw):
        seen.append((kw.get("fp64", True), device))
        return real(*a, **kw)  # run on the CPU here; the device is what is checked
    monkeypatch.setattr(step_module, "single_device", spy)  # what references() calls
    equivalence.prepare(equivalence.Probe(step, DDP(), trials=4), 2, device=equivalence.base_device("nccl"))
    assert seen == [(True, "cpu"), (False, "cuda")]  # the fp64 truth stays on the CPU
    assert equivalence.base_device("gloo") == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_base_on_cuda_comes_back_on_the_cpu():
    from trainprobes.transforms.demo import step
    from trainprobes.transforms.step import single_device
    t = single_device(step, [1, 2], fp64=False, device="cuda")
    assert t.loss.device.type == "cpu" and all(g.device.type == "cpu" for g in t.grads.values())
