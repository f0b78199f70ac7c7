"""trainprobes.watch.gemm: a sampled Linear call's GEMMs judged on the run's own operands."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.watch import Sentinel
from trainprobes.watch.gemm import watch_gemms


def _mlp(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    # an in-place ReLU after a Linear on a 3-D input: the output is a view that the ReLU
    # rebases, the case where a tensor hook on the output would never fire
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(inplace=True),
                               torch.nn.Dropout(dropout), torch.nn.Linear(64, 16))


def _train(watch: bool, steps=4, **kw):
    m = _mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    s = Sentinel(budget=16 << 20)
    w = watch_gemms(m, s, every=1, gemms=("fprop", "dgrad", "wgrad"), samples=64, **kw) if watch else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 64, 32, generator=g), torch.randn(4, 64, 16, generator=g)
        loss = ((m(x) - y) ** 2).mean()  # dropout draws from the global generator
        opt.zero_grad()
        loss.backward()
        opt.step()
        s.step()
        losses.append(loss.detach().clone())
    return losses, m.state_dict(), torch.get_rng_state(), s, w


def test_training_is_bitwise_unchanged():
    la, wa, ra, _, _ = _train(False)
    lb, wb, rb, s, w = _train(True)
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert torch.equal(ra, rb)  # the watch drew nothing from the global generator
    # and it did check: every step one Linear, all three GEMMs, no error of its own
    assert s.errors == [] and sum(st["checks"] for st in w.stats.values()) == 4 * 3
    finals = s.close()
    assert finals and all(r.metrics["checks"] >= 1 for r in finals)


def test_truncating_accumulator_is_biased_on_a_runs_wgrad():
    # regression toward targets offset by 3: dY keeps one sign early on and X is a ReLU's
    # output, so dW's terms share a sign and the h200 model's truncation (13-bit aligned terms
    # toward zero, the GEMM probe's own biased case) loses magnitude as K grows
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(inplace=True),
                            torch.nn.Linear(64, 16))
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    s = Sentinel(budget=96 << 20)
    watch_gemms(m, s, every=1, recipe="fp8-tensor", preset="h200-scaled-mm",
                modules={"2": m[2]}, rows=4096, samples=512)
    g = torch.Generator().manual_seed(1)
    found = []
    for _ in range(2):
        x, y = torch.randn(8, 512, 32, generator=g), torch.randn(8, 512, 16, generator=g) + 3
        loss = ((m(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        found += s.step()
    assert len(found) == 1, [r.message for r in found]  # reported once, at the first check
    r = found[0]
    assert r.verdict == "fail" and r.codes == ["TP-B1"] and r.evidence["step"] == 0, r.message
    assert r.metrics["k"] > 2048 and r.metrics["ci_high"] < 0, r.message  # K = the rows kept
    assert r.evidence["accumulator_bias"] < 0  # the accumulator's share, not only the recipe's
    # close() returns every Result kept: the finding above and the final one (with checks)
    final = [x for x in s.close() if x.target == "watch:gemm[2].wgrad" and "checks" in x.metrics]
    assert len(final) == 1 and final[0].verdict == "fail" and final[0].metrics["biased"] is True
    assert final[0].metrics["checks"] == 2 and final[0].metrics["first_biased_step"] == 0


def test_fp32_accumulator_is_not_biased():
    _, _, _, s, _ = _train(True, steps=3, recipe="exact", preset="fp32")
    finals = [r for r in s.close() if "checks" in r.metrics]
    assert len(finals) >= 1 and {r.metrics["gemm"] for r in finals} <= {"fprop", "dgrad", "wgrad"}
    for r in finals:
        assert r.verdict == "pass" and r.metrics["biased"] is False, r.message
        assert abs(r.metrics["relative_bias"]) < 1e-5


def test_nothing_sampled_is_cannot_judge():
    m = _mlp()
    s = Sentinel()
    watch_gemms(m, s, every=1)
    m.eval()  # evaluation forwards are not the run's training calls
    with torch.no_grad():
        m(torch.randn(2, 8, 32))
    s.step()
    (r,) = s.close()
    assert r.verdict == "error" and r.codes == ["TP-E1"] and r.metrics["biased"] is None


@pytest.mark.parametrize("kw, words", [
    ({"recipe": "fp8-tensr"}, "recipe"),
    ({"preset": "h100-magic"}, "preset"),
    ({"every": 0}, "every"),
    ({"gemms": ("xgrad",)}, "gemms"),
    ({"samples": 2, "trials": 16}, "samples"),
    ({"recipe": "exact", "preset": "h200-scaled-mm"}, "what_if=True"),
])
def test_bad_arguments_are_refused_naming_the_field(kw, words):
    with pytest.raises(InvalidArgument, match=words):
        watch_gemms(_mlp(), Sentinel(), **kw)


def test_no_linear_or_no_sentinel_is_refused():
    with pytest.raises(InvalidArgument, match="no torch.nn.Linear"):
        watch_gemms(torch.nn.ReLU(), Sentinel())
    with pytest.raises(InvalidArgument, match="Sentinel"):
        watch_gemms(_mlp(), object())
    with pytest.raises(InvalidArgument, match="not a torch.nn.Linear"):
        watch_gemms(_mlp(), Sentinel(), modules={"relu": torch.nn.ReLU()})


def test_tiny_llama_is_bitwise_unchanged():
    transformers = pytest.importorskip("transformers")

    def run(watch):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, attention_dropout=0.1)
        model = transformers.LlamaForCausalLM(cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        s = Sentinel(budget=16 << 20)
        w = watch_gemms(model, s, every=1, samples=64) if watch else None
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 128, (2, 64), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.step()
            losses.append(loss.detach().clone())
        return losses, model.state_dict(), torch.get_rng_state(), s, w

    la, wa, ra, _, _ = run(False)
    lb, wb, rb, s, w = run(True)
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and torch.equal(ra, rb)
    assert s.errors == [] and sum(st["checks"] for st in w.stats.values()) == 3


def test_copies_are_new_memory_within_the_budget():
    m = _mlp(dropout=0.0)
    budget = 3 << 20  # the sentinel's own windows need 2.6 MB
    s = Sentinel(budget=budget)
    w = watch_gemms(m, s, every=1, samples=64, modules={"0": m[0]})
    x = torch.randn(4, 512, 32)
    m(x).sum().backward()
    c = w._captured["0"]
    k = len(c["idx"])
    per_row = 64 * 64 + (32 + 64) * 4  # the judge's float64 working set and both copies
    assert 2 <= k < 4 * 512 and k * per_row <= budget
    assert c["x"].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(c["x"], x.reshape(-1, 32)[c["idx"]]) and c["dy"].shape == (k, 64)
    s.step()
    (r,) = [r for r in s.close() if "checks" in r.metrics]
    assert r.metrics["k"] == k


def test_each_check_spends_alpha_as_the_streams_do():
    """At alpha per check, 1 in 100 checks of a GEMM that is not biased would be a false
    finding, and a long run makes many: the k-th checked step's GEMMs are judged at
    alpha 6/(pi^2 k^2) / len(gemms), so the run-wide false-positive rate stays within alpha."""
    from trainprobes.watch.stream import look_alpha
    _, _, _, s, w = _train(True, steps=3, recipe="exact", preset="fp32")
    finals = [r for r in s.close() if "checks" in r.metrics]
    last = max((r.evidence["shown_check"] for r in finals), key=lambda c: c["step"])
    assert last["step"] == 2 and w._looks == 3
    assert last["metrics"]["alpha"] == pytest.approx(look_alpha(0.01, 3, 3))
    assert sum(look_alpha(0.01, k, 3) * 3 for k in range(1, 100_001)) <= 0.01
