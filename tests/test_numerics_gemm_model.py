"""trainprobes.numerics.gemm_model: a model's Linear GEMMs from one fp32 step."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.gemm_model import capture_linears, judge_model


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (4, 128))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.slow
def test_tiny_llama_names_the_weight_gradient_gemms_riskiest():
    # the default: what an fp8 training step on Hopper multiplies (fp8-tensor: e4m3 forward,
    # e5m2 gradients) under the H200's accumulator. Rows a verdict calls biased come first
    # (here the recipe's own quantisation bias, named as the recipe's); below them the rows
    # rank by the accumulator's own share, and the weight gradients (K = the tokens) lead
    model, batch = _llama()
    rows = judge_model(model, batch, preset="h200-scaled-mm", samples=128, trials=16)
    assert {r.metrics["recipe"] for r in rows} == {"fp8-tensor"}
    assert not any(r.metrics["what_if"] for r in rows)
    gemms = [r.metrics["gemm"] for r in rows]
    assert set(gemms) == {"fprop", "dgrad", "wgrad"}
    biased = [r for r in rows if r.metrics["biased"]]
    assert rows[:len(biased)] == biased
    for r in biased:
        assert "the recipe's quantisation" in r.message, r.message
    rest = [r.metrics["gemm"] for r in rows[len(biased):]]
    assert rest[:3] == ["wgrad"] * 3, [r.target for r in rows[:8]]
    risk = {g: sum(abs(r.evidence["accumulator_bias"]) for r in rows if r.metrics["gemm"] == g)
            / gemms.count(g) for g in set(gemms)}
    assert risk["wgrad"] > 1.5 * max(risk["fprop"], risk["dgrad"]), risk
    top = rows[len(biased)]
    assert top.metrics["k"] == 4 * 128 and top.evidence["layer"] in top.target


def test_capture_matches_the_linear():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    (c,) = capture_linears(torch.nn.Sequential(lin), x)
    assert c.x.shape == (15, 8) and c.dy.shape == (15, 4)
    assert torch.allclose(c.x.float(), x.reshape(15, 8))


def test_a_model_with_no_linear_is_refused():
    with pytest.raises(InvalidArgument, match="no torch.nn.Linear"):
        judge_model(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(2, 3))


class _TwoHeads(torch.nn.Module):
    """One Linear on the loss's path, one off it, one fed all zeros."""

    def __init__(self):
        super().__init__()
        self.used, self.unused, self.dead = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        self.unused(x.detach())
        return self.used(x) + self.dead(torch.zeros_like(x))


def test_skipped_linears_and_zero_gemms_are_listed_with_the_reason():
    torch.manual_seed(0)
    rows = judge_model(_TwoHeads(), torch.randn(4, 16, 16), samples=64, trials=8)
    skipped = rows[0].evidence["skipped"]
    assert {"layer": "unused", "gemm": "all"}.items() <= skipped[0].items(), skipped
    assert any(s["layer"] == "dead" and "all-zero" in s["reason"] for s in skipped), skipped
    assert {r.evidence["layer"] for r in rows} >= {"used"}


def test_a_nan_weight_names_the_layer():
    lin = torch.nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    with pytest.raises(InvalidArgument, match="layer '0'"):
        judge_model(torch.nn.Sequential(lin), torch.randn(4, 16, 16), samples=64, trials=8)


class _Twice(torch.nn.Module):
    """One bias-free Linear called twice (weights shared across two calls), then another."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(16, 16, bias=False)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.out(self.shared(torch.relu(self.shared(x))))


def test_a_linear_called_twice_is_judged_on_its_real_weight_gradient():
    # its weight gradient sums both calls: dW = dy1^T x1 + dy2^T x2, one GEMM of K = twice the
    # tokens. Pairing one call's input with the other call's output gradient judges a GEMM the
    # step never runs
    torch.manual_seed(0)
    model, x = _Twice(), torch.randn(4, 6, 16)
    caught = {c.name: c for c in capture_linears(model, x)}
    model(x).pow(2).mean().backward()  # the capture leaves no gradient behind: the step's own
    for name in ("shared", "out"):
        c, mod = caught[name], getattr(model, name)
        assert torch.allclose(c.dy.t() @ c.x, mod.weight.grad.double(), rtol=1e-5, atol=1e-8), name
    assert caught["shared"].x.shape == (2 * 24, 16) and caught["out"].x.shape == (24, 16)


class _Custom(torch.nn.Module):
    """A Linear of its own (F.linear on its weight): a GEMM no hook can see."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def test_gpt2_conv1d_is_judged_and_unseen_gemms_are_listed():
    # GPT-2's attention and MLP projections are transformers' Conv1D (y = x W + b, W stored
    # (in, out)), not nn.Linear: a table of the lm_head alone would pass a model whose
    # block GEMMs were never looked at
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    model = torch.nn.Sequential(conv1d(16, 16), torch.nn.ReLU(), torch.nn.Sequential(_Custom()),
                                torch.nn.Linear(16, 8))
    skipped = []
    x = torch.randn(4, 6, 16)
    caught = {c.name: c for c in capture_linears(model, x, skipped=skipped)}
    model(x).pow(2).mean().backward()
    assert set(caught) == {"0", "3"}
    c = caught["0"]
    assert c.w.shape == (16, 16) and torch.equal(c.w, model[0].weight.detach().double().t())
    assert torch.allclose(c.dy.t() @ c.x, model[0].weight.grad.double().t(), rtol=1e-5, atol=1e-8)
    assert [s["layer"] for s in skipped] == ["2.0"] and "not seen" in skipped[0]["reason"]


class _Kept(torch.nn.Module):
    """A bf16 model with dropout and BatchNorm: everything the capture step could change."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.drop(self.norm(self.lin(x))))


def test_judging_leaves_the_callers_model_as_it_was():
    # the capture runs one fp32 step on the caller's model: model.float() converted a bf16
    # model for good, and the step's gradients were left on it
    torch.manual_seed(0)
    model = _Kept().to(torch.bfloat16)
    model.train()
    model.norm.eval()  # a mix of flags, each to be kept
    x = torch.randn(32, 16)
    model.lin.weight.grad = torch.full_like(model.lin.weight, 0.5)  # a gradient of the caller's
    grad = model.lin.weight.grad
    before = {n: t.clone() for n, t in model.state_dict().items()}
    model.norm.train()
    flags = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    rows = judge_model(model, x.to(torch.bfloat16), preset="fp32", recipe="bf16", samples=64, trials=8)
    assert rows
    after = model.state_dict()
    for n, t in before.items():
        assert after[n].dtype == t.dtype and torch.equal(after[n], t), n
    assert model.lin.weight.grad is grad and torch.equal(grad, torch.full_like(grad, 0.5))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lin.weight")
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert torch.equal(torch.get_rng_state(), rng)


class _Frozen(torch.nn.Module):
    """A trained Linear on the raw batch (no input gradient is computed for it), then a
    frozen Linear (LoRA-style fine-tuning: no weight gradient is computed for it) beside a
    trained adapter, then a trained head."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(32, 32)
        self.base = torch.nn.Linear(32, 32)
        self.base.requires_grad_(False)
        self.adapter = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.pre(x))
        return self.head(torch.relu(self.base(h) + self.adapter(h)))


def test_gemms_the_step_never_runs_are_not_judged():
    # autograd computes no weight gradient of a frozen weight and no input gradient of an
    # input that needs none (the batch): those GEMMs (base.wgrad, pre.dgrad) were judged and
    # could be called biased, exit 1, for a GEMM no training step runs
    torch.manual_seed(0)
    rows = judge_model(_Frozen(), torch.randn(4, 16, 32), samples=64, trials=8)
    judged = {r.target.split(":")[-1] for r in rows}
    assert judged == {"pre.fprop", "pre.wgrad", "base.fprop", "base.dgrad", "adapter.fprop",
                      "adapter.dgrad", "adapter.wgrad", "head.fprop", "head.dgrad",
                      "head.wgrad"}, judged
    skipped = {(s["layer"], s["gemm"]): s["reason"] for s in rows[0].evidence["skipped"]}
    assert "frozen" in skipped[("base", "wgrad")]
    assert "input needs no gradient" in skipped[("pre", "dgrad")]


class _FrozenFirst(torch.nn.Module):
    """A frozen Linear on the raw batch (a frozen embedding projection): no gradient reaches
    it, but its forward GEMM runs in every step; then a trained head."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32).requires_grad_(False)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)))


def test_a_frozen_linear_on_the_batch_has_its_forward_gemm_judged():
    # its fprop was listed as "not on the loss's path" and never judged, though every
    # training step runs it and its output feeds the loss
    torch.manual_seed(0)
    rows = judge_model(_FrozenFirst(), torch.randn(4, 16, 32), samples=64, trials=8)
    judged = {r.target.split(":")[-1] for r in rows}
    assert judged == {"proj.fprop", "head.fprop", "head.wgrad"}, judged  # head's input needs no gradient
    skipped = {(s["layer"], s["gemm"]): s["reason"] for s in rows[0].evidence["skipped"]}
    assert "forward GEMM only" in skipped[("proj", "dgrad")] == skipped[("proj", "wgrad")]
    assert "input needs no gradient" in skipped[("head", "dgrad")]
    assert ("proj", "all") not in skipped


def test_a_model_with_every_weight_frozen_has_its_forward_gemms_judged():
    # the capture step's backward raised "element 0 of tensors does not require grad" (exit 3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)).requires_grad_(False)
    rows = judge_model(model, torch.randn(64, 32), samples=64, trials=8)
    assert {r.target.split(":")[-1] for r in rows} == {"0.fprop", "1.fprop"}


class _NoGradForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 16)

    @torch.no_grad()
    def forward(self, x):
        return self.lin(x)


def test_a_trainable_model_whose_loss_needs_no_gradient_is_refused_naming_its_weights():
    # judged as "every weight frozen" (fprop only, exit 0 or 1) for a step that trains nothing
    with pytest.raises(InvalidArgument, match=r"1 Linear weight\(s\) are trainable \(e.g. \['lin'\]\)"):
        judge_model(_NoGradForward(), torch.randn(64, 32), samples=64, trials=8)


class _Logged(torch.nn.Module):
    """A trainable Linear called under torch.no_grad for logging, and one called both so and
    with gradient."""

    def __init__(self):
        super().__init__()
        self.probe = torch.nn.Linear(16, 16)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            self.probe(x)
            self.lin(x[:1] * 100)
        return self.lin(x)


def test_calls_of_a_trainable_weight_without_gradient_are_listed_not_judged():
    # the logging Linear was judged and called frozen; the no_grad call of `lin` was dropped unseen
    torch.manual_seed(0)
    skipped = []
    got = capture_linears(_Logged(), torch.randn(4, 8, 16), skipped=skipped)
    assert [(c.name, c.x.shape[0], c.x_forward) for c in got] == [("lin", 32, None)]
    said = {(s["layer"], s["gemm"]): s["reason"] for s in skipped}
    assert set(said) == {("probe", "all"), ("lin", "fprop")}
    assert all(r.startswith("1 call(s) that no gradient reaches") for r in said.values())


class _FrozenTwice(torch.nn.Module):
    """A frozen Linear called on the batch (no gradient reaches it) and on a trained
    Linear's output (its dgrad runs), inside a non-reentrant checkpoint (its forward runs
    again in the backward)."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.base = torch.nn.Linear(16, 16).requires_grad_(False)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(lambda t: self.base(t) + self.base(self.pre(t)), x, use_reentrant=False)


def test_a_frozen_weights_forward_rows_are_every_call_once():
    torch.manual_seed(0)
    base, pre = sorted(capture_linears(_FrozenTwice(), torch.randn(4, 16)), key=lambda c: c.name)
    assert base.name == "base" and base.x.shape[0] == 4 and base.dy.shape[0] == 4   # the call with gradient
    assert base.x_forward.shape[0] == 4  # the batch's call, once (not again in the recompute)
    rows = judge_model(_FrozenTwice(), torch.randn(64, 16), samples=64, trials=8, target="m")
    assert {r.target for r in rows} == {"m:pre.fprop", "m:pre.wgrad", "m:base.fprop", "m:base.dgrad"}


class _StopGradient(torch.nn.Module):
    """A head called on two halves, one output detached (a stop-gradient target)."""

    def __init__(self, frozen_head):
        super().__init__()
        self.enc = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 16).requires_grad_(not frozen_head)

    def forward(self, x):
        h = self.enc(x)
        return self.head(h[:2]) - self.head(h[2:]).detach()


@pytest.mark.parametrize("frozen", [False, True])
def test_a_call_whose_output_is_detached_is_said_or_judged_forward_only(frozen):
    # the detached call fell through every branch: neither judged nor listed
    skipped = []
    (enc, head) = sorted(capture_linears(_StopGradient(frozen), torch.randn(4, 16), skipped=skipped),
                         key=lambda c: c.name)
    assert head.x.shape[0] == 2
    if frozen:
        assert head.x_forward.shape[0] == 2 and not skipped
    else:
        assert head.x_forward is None and skipped[0]["layer"] == "head"
        assert skipped[0]["reason"].startswith("1 call(s) that no gradient reaches")


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant, frozen_first):
        super().__init__()
        self.a = torch.nn.Linear(16, 16).requires_grad_(not frozen_first)
        self.b = torch.nn.Linear(16, 16)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(lambda t: self.b(torch.relu(self.a(t))), x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("frozen_first", [False, True])
def test_a_checkpointed_step_is_captured_once_per_call(reentrant, frozen_first, monkeypatch):
    # a non-reentrant recompute was captured again (the budget charged about twice); a
    # reentrant one's first pass doubled a frozen weight's fprop rows, and was listed as
    # "not judged" for a trainable one that is judged on its recompute
    import warnings
    warnings.simplefilter("ignore")
    x = torch.randn(8, 16).requires_grad_(reentrant)  # a reentrant checkpoint trains only so
    skipped = []
    got = {c.name: c for c in capture_linears(_Checkpointed(reentrant, frozen_first), x, skipped=skipped)}
    assert {n: c.x.shape[0] for n, c in got.items()} == {"a": 8, "b": 8}
    assert all(c.x_forward is None for c in got.values()) and not skipped, skipped
    assert got["a"].wgrad == (not frozen_first)


class _ReentrantDetach(torch.nn.Module):
    """A Linear called twice inside a reentrant checkpoint, one output detached, and once
    under torch.no_grad outside it; a second segment whose output is detached is never
    recomputed."""

    def __init__(self, frozen):
        super().__init__()
        self.e = torch.nn.Linear(8, 8)
        self.l = torch.nn.Linear(8, 8).requires_grad_(not frozen)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = self.e(x)
        with torch.no_grad():
            self.l(h[:1])
        first = checkpoint(lambda t: self.l(t[:4]) - self.l(t[4:]).detach(), h, use_reentrant=True)
        never = checkpoint(self.l, h[:2], use_reentrant=True).detach()
        return first.sum() + never.sum()


@pytest.mark.parametrize("frozen", [False, True])
def test_a_reentrant_checkpoint_keeps_every_call_once(frozen):
    # a recompute that got a gradient made every other call of the Linear vanish: the
    # detached one inside, the no_grad one outside, the segment never recomputed
    import warnings
    warnings.simplefilter("ignore")
    skipped = []
    got = {c.name: c for c in capture_linears(_ReentrantDetach(frozen), torch.randn(8, 8), skipped=skipped)}
    assert got["l"].x.shape[0] == 4  # the call with gradient
    if frozen:  # the other three: 1 + 4 + 2 rows, forward only
        assert got["l"].x_forward.shape[0] == 7 and not skipped
    else:
        assert [s["reason"][:10] for s in skipped] == ["3 call(s) "], skipped


def test_the_users_forward_raising_is_bad_input_not_an_internal_error():
    # a batch of the wrong width raised RuntimeError out of the capture (exit 3)
    from trainprobes.errors import TargetError
    with pytest.raises(TargetError, match="the model's forward on the batch raised RuntimeError"):
        capture_linears(torch.nn.Linear(16, 16), torch.randn(4, 8))


def test_a_model_on_the_meta_device_is_refused():
    with pytest.raises(InvalidArgument, match="meta device"):
        capture_linears(torch.nn.Linear(16, 16, device="meta"), torch.randn(4, 16))


def test_a_linear_called_with_keywords_is_captured():
    got = capture_linears(torch.nn.Linear(8, 4), {"input": torch.randn(16, 8)})
    assert got[0].x.shape == (16, 8) and got[0].dy.shape == (16, 4)


@pytest.mark.parametrize("made, match", [
    ((lambda x: x), "not a torch.nn.Module"),
    (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Flatten(0, -1)).requires_grad_(False), None),
])
def test_what_the_factory_returns_is_checked(made, match):
    if match:
        with pytest.raises(InvalidArgument, match=match):
            capture_linears(made, torch.randn(4, 8))
    else:
        assert capture_linears(made, torch.randn(4, 8))[0].dy is None


class _Returns(torch.nn.Module):
    def __init__(self, what):
        super().__init__()
        self.lin, self.what = torch.nn.Linear(8, 8), what

    def forward(self, x):
        y = self.lin(x)
        return {"none": None, "dict": {"y": y}, "empty": [], "argmax": y.argmax(-1)}[self.what]


@pytest.mark.parametrize("what, match", [
    ("none", "returned a NoneType"), ("dict", "returned a dict"), ("empty", "returned a list"),
    ("argmax", r"not differentiable \(an argmax"),
])
def test_an_output_without_a_loss_is_refused_with_what_it_was(what, match):
    # AttributeError / IndexError before (exit 3)
    with pytest.raises(InvalidArgument, match=match):
        capture_linears(_Returns(what), torch.randn(4, 8))


def test_progress_counts_the_gemms_that_exist():
    seen = []
    judge_model(_FrozenFirst(), torch.randn(4, 16, 32), samples=64, trials=8,
                progress=lambda done, total, name: seen.append((done, total, name)))
    assert [d for d, _, _ in seen] == list(range(4)) and {t for _, t, _ in seen} == {4}


def test_a_bare_linear_is_named_as_the_model_itself():
    torch.manual_seed(0)
    rows = judge_model(torch.nn.Linear(32, 16), torch.randn(64, 32), samples=64, trials=8, target="m")
    assert {r.target for r in rows} == {"m:(the model itself).fprop", "m:(the model itself).wgrad"}


def test_a_capture_too_large_for_memory_is_refused_and_the_model_kept(monkeypatch):
    # every Linear's input and output gradient are kept in float64 for the judge: a large
    # model's step (estimated, a Llama-style 1B model on 8 x 2048 tokens: about 100 GiB) was
    # captured without an estimate, until memory ran out. The running total is checked as
    # each call is captured
    import trainprobes.budget as budget
    from trainprobes.budget import BASE_BYTES, SHARE, TooLarge
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(4096, 64)
    one_layer = 8 * 4096 * (64 + 64)  # x and dy of one Linear in float64 (the sample: 4 MiB)
    monkeypatch.setattr(budget, "available_bytes", lambda: int((BASE_BYTES + 1.5 * one_layer) / SHARE))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(TooLarge, match="smaller batch"):
        judge_model(model, x, preset="fp32", recipe="bf16", samples=16, trials=8)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())
    assert all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(budget, "available_bytes", lambda: int((BASE_BYTES + 2.5 * one_layer) / SHARE))
    assert judge_model(model, x, preset="fp32", recipe="bf16", samples=16, trials=8)
    # a frozen model's forward-only captures count too (they were kept without a check)
    frozen = model.requires_grad_(False)
    monkeypatch.setattr(budget, "available_bytes", lambda: int((BASE_BYTES + 0.75 * one_layer) / SHARE))
    with pytest.raises(TooLarge, match="up to '2'"):
        judge_model(frozen, x, preset="fp32", recipe="bf16", samples=16, trials=8)
