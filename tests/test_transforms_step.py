"""trainprobes.transforms.step: what a single-device step must be, checked before any rank
starts, and the fp64 truth."""
import functools

import pytest
import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.reference.bugs import data
from trainprobes.transforms.step import TrainingStep, check_step, count_tokens, single_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH = functools.partial(data.documents, data.full(4, 4))


def good() -> TrainingStep:
    return TrainingStep(model=functools.partial(data.mlp, seed=3), batch=BATCH, loss=data.loss)


def fresh_model():
    return torch.nn.Linear(data.D, data.O)  # new random weights on every call


class Projected(torch.nn.Sequential):
    """Seeded weights, an unseeded fixed projection buffer: every rank would hold another."""

    def __init__(self):
        super().__init__(*data.mlp(seed=3))
        self.register_buffer("projection", torch.randn(data.D, data.D))

    def forward(self, x):
        return super().forward(x @ self.projection)


def dropout_model():
    return torch.nn.Sequential(torch.nn.Dropout(0.1), *data.mlp(seed=3))


def vector_loss(output, batch):
    return (output - batch["target"]).pow(2).mean(-1)


def detached_loss(output, batch):
    return data.loss(output.detach(), batch)


def drifting_batch(generator):
    b = BATCH(generator)
    b["input"] = b["input"] + torch.randn(1)  # ignores the generator
    return b


def ragged_batch(generator):
    b = BATCH(generator)
    b["mask"] = b["mask"][:2]
    return b


_SHARED = data.mlp(seed=3)


def shared_model():
    """One module for every call: the truth's .double() would convert the rank's own model."""
    return _SHARED


def wrapped_shared_model():
    return torch.nn.Sequential(_SHARED)  # a new container around the same parameters


def test_a_good_step_passes_and_returns_trial_0s_batch():
    b = check_step(good(), 7)
    assert torch.equal(b["input"], BATCH(torch.Generator().manual_seed(7))["input"])


@pytest.mark.parametrize("change, match", [
    ({"model": fresh_model}, "different initial weights on two calls"),
    ({"model": Projected}, "buffer 'projection' holds different values"),
    ({"model": shared_model}, r"the same parameter objects on two calls \(e.g. '0.weight'\)"),
    ({"model": wrapped_shared_model}, r"the same parameter objects on two calls \(e.g. '0.0.weight'\)"),
    ({"model": dropout_model}, r"not deterministic.*dropout"),
    ({"loss": vector_loss}, r"must return a scalar \(0-dim\) tensor"),
    ({"loss": detached_loss}, "does not depend on the model's parameters"),
    ({"batch": drifting_batch}, "different batches for one seed"),
    ({"batch": ragged_batch}, "different sample counts"),
    ({"input_key": "x"}, r"called on batch\['x'\]"),
])
def test_bad_steps_are_refused_naming_what_to_fix(change, match):
    step = TrainingStep(**{**dict(model=good().model, batch=BATCH, loss=data.loss), **change})
    with pytest.raises(InvalidArgument, match=match):
        check_step(step, 0)


def test_a_step_needs_callables():
    with pytest.raises(InvalidType, match="model=3 must be callable"):
        TrainingStep(model=3, batch=BATCH, loss=data.loss)


def test_the_truth_is_the_fp64_step_and_rounds_weights_to_the_contract():
    step = good()
    truth = single_device(step, [1, 2])
    m = data.mlp(seed=3).double()
    b = {k: (v.double() if v.is_floating_point() else v) for k, v in BATCH(torch.Generator().manual_seed(2)).items()}
    data.loss(m(b["input"]), b).backward()
    assert truth.loss.dtype == torch.float64
    assert torch.equal(truth.grads["2.weight"][1], m[2].weight.grad)
    rounded = single_device(step, [2], param_dtype=torch.bfloat16)
    assert not torch.equal(rounded.grads["2.weight"][0], m[2].weight.grad)
    same = single_device(step, [2], fp64=False)
    assert same.loss.dtype == torch.float32


def test_tokens_default_to_the_mask_then_the_samples():
    b = data.documents(data.Layout((1, 3), (1.0, 1.0), 4), torch.Generator())
    assert count_tokens(b) == 4.0
    assert count_tokens({"input": torch.zeros(5, 2)}) == 5.0
    assert count_tokens(b, lambda x: 11) == 11.0


def test_the_single_device_base_computes_with_the_weights_the_truth_rounds_to():
    # the paired tests subtract the base: a base on unrounded weights charged bf16 weight
    # rounding to a transform that computes exactly in fp32 with bf16 weights ("biased")
    step = good()
    truth = single_device(step, [1, 2], param_dtype=torch.bfloat16)
    base = single_device(step, [1, 2], fp64=False, param_dtype=torch.bfloat16)
    assert base.loss.dtype == torch.float32
    for n, r in truth.grads.items():
        assert torch.allclose(base.grads[n].double(), r, rtol=1e-5, atol=1e-7), n


class Quantised(torch.nn.Module):
    """A frozen fp8 weight and an int8 buffer (1-byte dtypes), dequantised in the forward,
    beside a trainable head; `fresh` draws the fp8 weight anew on every call."""

    def __init__(self, fresh: bool = False):
        super().__init__()
        g = None if fresh else torch.Generator().manual_seed(0)
        w = torch.randn(data.D, data.D, generator=g).to(torch.float8_e4m3fn)
        self.frozen = torch.nn.Parameter(w, requires_grad=False)
        self.register_buffer("codes", torch.arange(data.D, dtype=torch.int8))
        self.head = data.mlp(seed=3)

    def forward(self, x):
        return self.head(x @ self.frozen.to(x.dtype) + self.codes.to(x.dtype) / 64)


def test_one_byte_parameters_and_buffers_are_compared_by_their_bits():
    check_step(TrainingStep(model=Quantised, batch=BATCH, loss=data.loss), 0)
    with pytest.raises(InvalidArgument, match=r"parameter 'frozen' holds different values"):
        check_step(TrainingStep(model=functools.partial(Quantised, fresh=True), batch=BATCH, loss=data.loss), 0)
    truth = single_device(TrainingStep(model=Quantised, batch=BATCH, loss=data.loss), [0, 1])
    assert set(truth.grads) == {n for n, p in Quantised().named_parameters() if p.requires_grad}


_CACHED = [{**data.documents(data.full(4, 4), torch.Generator().manual_seed(k)),
            "scale": torch.full((4,), 0.5).to(torch.float8_e4m3fn)} for k in range(4)]


def cached_batches():
    """A dataset that hands out the same tensors on every pass (a cached TensorDataset),
    an fp8 entry among them: torch.equal(x, x) has no fp8 kernel on the CPU."""
    return iter(_CACHED)


def test_a_cached_dataset_with_one_byte_tensors_is_checked_by_bits():
    check_step(TrainingStep(model=functools.partial(data.mlp, seed=3), data=cached_batches, loss=data.loss), 0)
