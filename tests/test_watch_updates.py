"""trainprobes.watch.updates: sampled weight updates against the same optimizer step in fp64,
in a plain training loop (torch 2.13 CPU)."""
import pytest
import torch
from torch import nn
from trainprobes.errors import InvalidArgument
from trainprobes.watch import Sentinel
from trainprobes.watch.updates import watch_updates


def make(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1)).to(dtype)


def train(dtype, steps, *, opt="adam", lr=1e-5, watch=True, seed=0, every=1):
    model = make(dtype, seed)
    o = {"adam": lambda p: torch.optim.Adam(p, lr=lr),
         "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1),
         "sgd": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True)}[opt](model.parameters())
    data = torch.Generator().manual_seed(seed + 1)
    s = Sentinel(seed=seed) if watch else None
    w = watch_updates(o, s, every=every) if watch else None
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=data).to(dtype)
        loss = model(x).float().square().mean()
        o.zero_grad()
        loss.backward()
        o.step()
        losses.append(loss.detach().clone())
        if s is not None:
            s.step()
    results = s.close() if s is not None else None
    return model, losses, results, w, torch.random.get_rng_state()


def pooled(results):
    """The final Result of all groups together (a finding made earlier comes before it)."""
    return [r for r in results if r.target.endswith("].all_groups")][-1]


@pytest.mark.parametrize("opt", ["adam", "adamw", "sgd"])
def test_the_fp64_replay_matches_an_fp64_run_exactly(opt):
    """Same class, same hyperparameters, same state: on fp64 parameters the realised update
    is the intended one to the bit, so any error measured elsewhere is the format's."""
    *_, w, _ = train(torch.float64, 12, opt=opt, lr=1e-2)
    s = w.streams.streams["all_groups"]
    assert len(s.errors) == 12 and all(e == 0.0 for e in s.errors), list(s.errors)


def test_bf16_weights_with_a_small_learning_rate_stall_and_are_called_biased():
    *_, results, w, _ = train(torch.bfloat16, 20, lr=1e-5)
    r = pooled(results)
    assert r.verdict == "fail" and "TP-B1" in r.codes
    assert r.metrics["bias"] < -0.9 and r.metrics["stalled_share"] > 0.9
    assert r.evidence["found_at_step"] == 10  # the first look (interval 10)
    found = [x for x in results if x.verdict == "fail" and x.evidence.get("look") == 1]
    assert found  # reported when found, not only at close


def test_fp32_weights_with_the_same_learning_rate_are_clean():
    *_, results, w, _ = train(torch.float32, 20, lr=1e-5)
    r = pooled(results)
    assert r.verdict == "pass" and abs(r.metrics["bias"]) < 1e-4
    # a few elements whose Adam update is tiny (its eps over a tiny gradient) do not move
    assert r.metrics["stalled_share"] < 0.01


@pytest.mark.parametrize("seed", range(5))
def test_fp32_adam_at_a_usual_learning_rate_is_never_called_biased(seed):
    *_, results, _, _ = train(torch.float32, 40, lr=1e-3, seed=seed)
    assert all(r.verdict == "pass" for r in results if r.probe == "numerics.bias"), \
        [r.message for r in results]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_watch_changes_no_bit_of_the_run(dtype):
    m0, l0, _, _, rng0 = train(dtype, 8, lr=1e-2, watch=False)
    m1, l1, _, w, rng1 = train(dtype, 8, lr=1e-2, watch=True)
    assert w.checked_steps == 8
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))
    assert torch.equal(rng0, rng1)


def test_optimizers_that_cannot_be_replayed_on_a_sample_are_refused():
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(InvalidArgument, match="element-wise"):
        watch_updates(torch.optim.LBFGS(p), Sentinel())
    with pytest.raises(InvalidArgument, match="not a torch.optim.Optimizer"):
        watch_updates(object(), Sentinel())


def test_no_checked_step_cannot_be_judged():
    s = Sentinel()
    watch_updates(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), s)
    (r,) = [r for r in s.close() if r.target.startswith("watch:updates")]
    assert r.verdict == "error" and r.metrics["biased"] is None


def accumulate(dtype, micro, *, watch=True, steps=3, clip=None):
    """A Linear whose weight gradient is the same sign in every micro-batch (about 4.2 per
    element): summed in bf16 the running sum stalls once its ulp passes twice that (16 at
    2048), so 512 micro-batches (about 2150 in fp64) lose several percent."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(dtype)
    o = torch.optim.SGD(model.parameters(), lr=1e-3)
    s = Sentinel(interval=steps) if watch else None
    w = watch_updates(o, s) if watch else None
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        o.zero_grad()
        for _ in range(micro):
            x = (1 + 0.1 * torch.rand(4, 8, generator=data)).to(dtype)
            model(x).sum().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        o.step()
        if s is not None:
            s.step()
    return model, (s.close() if s is not None else None), w


def accumulated(results):
    return [r for r in results if r.target.endswith("].accumulation.all_groups")][-1]


def test_bf16_gradient_accumulation_over_many_micro_batches_is_called_biased():
    _, results, w = accumulate(torch.bfloat16, 512)
    r = accumulated(results)
    assert r.verdict == "fail" and "TP-B1" in r.codes and r.metrics["bias"] < -0.05, r.message  # measured -0.096
    assert r.evidence["contributions"] == 512


@pytest.mark.parametrize("clip", [None, 1.0])
def test_fp32_gradient_accumulation_is_clean(clip):
    """Clipping before the step scales p.grad by ~1/1000 here: read after the last
    contribution, not at the step, it is not mistaken for lost gradient."""
    _, results, w = accumulate(torch.float32, 512, clip=clip)
    r = accumulated(results)
    assert r.verdict == "pass" and abs(r.metrics["bias"]) < 1e-5, r.message


def test_one_micro_batch_accumulates_exactly():
    _, results, w = accumulate(torch.bfloat16, 1)
    assert list(w.streams.streams["accumulation.all_groups"].errors) == [0.0, 0.0, 0.0]


def test_the_accumulation_hooks_change_no_bit():
    m0, *_ = accumulate(torch.bfloat16, 16, watch=False)
    m1, _, w = accumulate(torch.bfloat16, 16, watch=True)
    assert len(w.streams.streams["accumulation.all_groups"].errors) == 3
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))


def test_a_sample_over_the_budget_is_refused_up_front():
    o = torch.optim.Adam(nn.Linear(100, 100).parameters())
    with pytest.raises(InvalidArgument, match="budget"):
        watch_updates(o, Sentinel(budget=1 << 16), elements=4096)


@pytest.mark.parametrize("late_first", [True, False])
def test_a_parameter_without_momentum_yet_shares_a_group_with_one_that_has_it(late_first):
    """SGD keeps no scalar state, so a parameter that got its first gradient late (no
    momentum_buffer yet) and one with a buffer agree on every scalar: stepped as one fp64
    tensor, the shadow took the first one's state for both. On fp64 weights the replay must
    still be exact at every step, and no step may be lost to an error of the watch."""
    torch.manual_seed(0)
    late, always = nn.Linear(4, 4).double(), nn.Linear(4, 1).double()
    params = [late.weight, always.weight] if late_first else [always.weight, late.weight]
    o = torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)
    s = Sentinel(seed=0)
    w = watch_updates(o, s)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        x = torch.randn(16, 4, generator=g, dtype=torch.float64)
        h = late(x) if step >= 3 else x  # `late` gets no gradient for 3 steps
        loss = always(torch.tanh(h)).square().mean()
        o.zero_grad()
        loss.backward()
        o.step()
        s.step()
    errors = list(w.streams.streams["all_groups"].errors)
    assert s.error_count == 0 and len(errors) == 8
    assert all(e == 0.0 for e in errors), errors


def test_a_step_given_a_closure_is_not_checked_and_says_why():
    """step(closure) runs its backward after the step pre-hook: the gradients it uses cannot
    be read there, so a replay there would be of the previous step's. Not checked, said."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    o = torch.optim.Adam(model.parameters(), lr=1e-3)
    s = Sentinel(seed=0)
    w = watch_updates(o, s)
    x = torch.randn(8, 4)

    def closure():
        o.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss
    for _ in range(3):
        o.step(closure)
        s.step()
    assert "all_groups" not in w.streams.streams
    assert len(s.errors) == 3 and "closure" in str(s.errors[0]), s.errors
    (r,) = w.close()
    assert r.verdict == "error"


def test_accumulation_left_unwatched_on_several_ranks_is_said_as_a_warning(monkeypatch, caplog):
    """On several ranks the default leaves accumulation unwatched (p.grad becomes the reduced
    mean): that is a warning a user sees, not an INFO line, and accumulation=True is refused."""
    import logging

    import trainprobes.watch.updates as updates
    monkeypatch.setattr(updates, "_world", lambda: 2)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainprobes.watch"):
        w = watch_updates(opt, Sentinel())
    assert not w.accumulation
    assert any("accumulation not watched" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    with pytest.raises(InvalidArgument, match="accumulation=True on 2 ranks"):
        watch_updates(torch.optim.SGD(model.parameters(), lr=0.1), Sentinel(), accumulation=True)
