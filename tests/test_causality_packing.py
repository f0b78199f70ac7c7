"""trainprobes.causality.packing: copies per call chosen from measured time, on synthetic cost
profiles (a fake clock, so nothing here depends on the machine's load)."""
import math
import random
import types

import pytest
import torch
from trainprobes.causality import check, cuts
from trainprobes.causality.packing import START, Sizer

# seconds of one call on `rows` copies of the inputs
PROFILES = {
    "router": lambda rows: 1.0 + 0.01 * rows,             # per-call overhead dominates
    "superlinear": lambda rows: rows * (1 + 0.05 * rows),  # worse per copy the bigger the call
    "u_shaped": lambda rows: 1.0 + rows * (0.05 + 0.002 * rows),  # a best size in between
    "flat": lambda rows: 1.0 * rows,                      # packing neither helps nor hurts
}


def drive(sizer, cost, n_tasks, measure=None):
    """What Cuts does with a sizer: the first call carries START copies beside 2 check rows;
    then packed calls (one control each) or calls alone. The sizer sees measure(rows) (default:
    the true cost); returns the true seconds spent."""
    measure = measure or cost
    spent = cost(START + 2)
    sizer.packed(START, 2, measure(START + 2))
    done = START
    while done < n_tasks:
        n = min(sizer.next(), n_tasks - done) if n_tasks - done > 1 else 0
        rows = n + 1 if n else 1
        (sizer.packed(n, 1, measure(rows)) if n else sizer.alone(measure(rows)))
        spent, done = spent + cost(rows), done + max(n, 1)
    return spent


def noisy(cost, seed, sigma=0.3, cold=3.0):
    """Timings as a shared machine gives them: noise only adds time, and the first call at a
    new size (the baseline's size excepted) pays for warming up (measured on this CPU at 1.0x
    to 1.8x a warm call for the benchmark's router, attention router and MoE block; 3.0 here
    leaves a margin for other machines)."""
    rng, seen = random.Random(seed), {1}

    def measure(rows):
        t = cost(rows) * math.exp(abs(rng.gauss(0, sigma)))
        if rows not in seen:
            seen.add(rows)
            t *= cold
        return t
    return measure


@pytest.mark.parametrize("profile", list(PROFILES))
def test_certification_is_never_slower_than_one_call_per_cut(profile):
    cost = PROFILES[profile]
    loop = cost(1) * 512  # baseline + 511 cuts alone
    spent = cost(1) * 2 + drive(Sizer(127, baseline_s=cost(1)), cost, 511)  # + baseline (the repeat is folded)
    assert spent <= 1.05 * loop, (profile, spent / loop)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_noisy_timings_cost_little(profile):
    cost, loop = PROFILES[profile], PROFILES[profile](1) * 512
    ideal = min(1.0, min(cost(n + 1) / n for n in range(1, 128)) / cost(1))
    ratios = sorted((cost(1) * 2 + drive(Sizer(127, baseline_s=3 * cost(1)), cost, 511,
                                         noisy(cost, seed))) / loop for seed in range(20))
    assert ratios[10] <= max(1.05, 1.3 * ideal) and ratios[-1] <= max(1.2, 2.5 * ideal), ratios


def test_cheap_calls_grow_to_the_memory_budget():
    s = Sizer(31, baseline_s=PROFILES["router"](1))
    spent = drive(s, PROFILES["router"], 511)
    assert s.state == "pack" and s.want == 31 and max(s.sizes) == 31
    assert spent < 0.2 * PROFILES["router"](1) * 511


def test_a_superlinear_target_runs_alone_after_one_look():
    s = Sizer(127, baseline_s=PROFILES["superlinear"](1))
    drive(s, PROFILES["superlinear"], 511)
    assert s.state == "alone" and s.sizes == [START, START + 1]  # two calls of one size
    assert "does not pay" in s.evidence()["why"]


def test_a_best_size_between_is_found():
    s = Sizer(127, baseline_s=PROFILES["u_shaped"](1))
    drive(s, PROFILES["u_shaped"], 511)
    per_copy = {n: PROFILES["u_shaped"](n + 1) / n for n in range(1, 128)}
    best = min(per_copy, key=per_copy.get)
    assert s.state == "pack" and per_copy[s.want] <= 1.1 * per_copy[best]


def test_a_fixed_size_is_kept_and_capped():
    s = Sizer(10, baseline_s=1.0, fixed=16)
    drive(s, PROFILES["superlinear"], 100)
    assert set(s.sizes[1:-1]) == {10} and s.state == "pack" and "capped at 10" in s.why
    assert s.alone_s == []  # nothing run alone to measure


def test_out_of_memory_halves_and_refuses_below_two():
    s = Sizer(64, baseline_s=1.0)
    assert s.shrink(40) and s.cap == 20 and s.want <= 20
    assert not s.shrink(3)


@pytest.fixture
def fake_clock(monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(cuts, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    return clock


@pytest.mark.parametrize("profile, states", [("router", ("grow", "pack")), ("superlinear", ("alone",))])
def test_the_probe_measures_its_target(fake_clock, profile, states):
    """End to end: the probe's own calls, timed on a fake clock the target advances."""
    cost = PROFILES[profile]

    def fn(x):
        fake_clock.now += cost(x.shape[0] // 2)
        return x.argmax(-1)
    x = torch.randn(2, 256, 4, generator=torch.Generator().manual_seed(0))
    res = check(fn, x, cuts="all", near_ties=0)  # the cuts' packing alone (the search: test_causality_near_tie)
    packing = res.evidence["packing"]
    assert res.verdict == "pass" and packing["state"] in states
    if profile == "router":  # still growing when the cuts ran out: bigger was always better
        assert max(packing["sizes"]) >= 64
    assert fake_clock.now <= 1.05 * cost(1) * 256  # the loop: baseline + 255 cuts alone
    assert res.metrics["n_evaluations"] == 1 + len(packing["sizes"]) + 255 - sum(packing["sizes"])


def test_the_baseline_counts_as_a_call_alone():
    """Cuts timed alone right after a packed call run on cold caches: a size 10% dearer per
    copy than the baseline call must not look like a win against them."""
    s = Sizer(127, baseline_s=1.0)
    s.packed(START, 2, (START + 1) * 1.1)
    while s.next() == 0 and len(s.alone_s) < 5:
        s.alone(1.8)  # cold
    for _ in range(3):
        if s.state != "grow":
            break
        s.packed(s.next(), 1, s.next() * 1.1)
    assert s.state == "alone", s.evidence()


def test_a_size_clearly_worse_than_a_smaller_one_gets_no_second_call():
    s = Sizer(127, baseline_s=1.0)
    s.packed(START, 2, (START + 1) * 0.5)
    s.packed(START + 1, 1, (START + 1) * 0.5)
    s.alone(1.0)
    s.alone(1.0)
    assert s.next() == 2 * (START + 1)
    s.packed(s.next(), 1, 2 * (START + 1) * 1.5)  # 3x the smaller size per copy
    assert s.state == "pack" and s.want == START + 1 and s.sizes == [START, START + 1, 2 * (START + 1)]


def test_a_slow_first_call_that_still_pays_gets_a_second_look():
    """On a GPU the first call at a new shape can cost several warm ones; while it is still a
    clear win over a call alone it is called again before the size is judged."""
    s = Sizer(127, baseline_s=1.0)
    s.packed(START, 2, (START + 1) * 0.05)
    n = s.next()
    assert n == 2 * (START + 1)
    s.packed(n, 1, n * 0.15)  # cold: 3x the smaller size per copy, still < CLEAR_WIN
    assert s.state == "grow" and s.next() == n
    s.packed(n, 1, n * 0.025)  # warm
    assert s.state == "grow" and s.next() == 2 * n


@pytest.mark.parametrize("pack", [True, False])
def test_quick_equality_checks_leave_nan_and_atol_to_differs(pack):
    """Copies are screened by plain equality (packed: !=, alone: torch.equal); a NaN that stays
    a NaN, or a move within atol, fails that screen and must still be no flip, while a move
    beyond atol at position 12 from the last position is one, found at every cut from 12 on."""
    x = torch.randn(2, 40, 3, generator=torch.Generator().manual_seed(0))

    def fn(x):
        y = x.clone()
        y[:, :5] = float("nan")  # NaN at every call
        y[:, 5:10] = 1.0 + 1e-4 * x[:, -1:, :]  # moves within atol with the future
        y[:, 12] += x[:, -1]  # a leak beyond atol
        return y
    res = check(fn, x, cuts="all", atol=1e-2, pack=pack, fp64=False, max_leaks=10_000)
    assert res.metrics["packed"] is pack
    leaks = res.evidence["leaks"]
    assert {lk["position"] for lk in leaks} == {12} and len(leaks) == 2 * (40 - 1 - 12)


def test_a_gain_within_timing_noise_is_not_settled_on():
    """Every size measures 0.95 of a call alone per copy: cheaper, but by less than the noise
    of the few calls timed, and a loss there would be paid on every later cut."""
    cost = lambda rows: 1.0 if rows == 1 else 0.95 * (rows - 1)  # noqa: E731
    s = Sizer(31, baseline_s=cost(1))
    spent = drive(s, cost, 511)
    assert s.state == "alone" and "does not pay" in s.why, s.evidence()
    assert spent <= 1.0 * cost(1) * 511
