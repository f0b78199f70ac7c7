"""trainprobes.reference.gemm against an independent scalar model in Python integers, and the
accumulator reveal run on the emulator."""
import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.errors import InvalidArgument
from trainprobes.reference.gemm import PRESETS, Accumulator, dot, get_preset, matmul

# --- the slow model: every value an integer count of 2^-UNIT ------------------------------
# e4m3/e5m2 products are multiples of 2^-36 (e5m2 subnormal 2^-16 squared is 2^-32; the
# all-equal and scaled cases stay above 2^-40), so integers in units of 2^-64 hold every
# product and every rounded sum exactly; Python integers do not overflow.
UNIT = 64


def _to_int(x: float) -> int:
    n, d = float(x).as_integer_ratio()
    v = n * (1 << UNIT)
    assert v % d == 0, x
    return v // d


def _floor_log2(v: int) -> int:  # in units: floor(log2 |v|) of the integer
    return abs(v).bit_length() - 1


def _round_int(v: int, m: int, mode: str) -> int:
    """v rounded to m mantissa bits (integer arithmetic, unbounded exponent)."""
    if v == 0:
        return 0
    k = _floor_log2(v) - m  # the grid is 2^k units
    if k <= 0:
        return v
    if mode == "down":  # Python's // floors: toward -inf for either sign
        return (v >> k) << k
    sign, a = (1 if v > 0 else -1), abs(v)
    q, r = divmod(a, 1 << k)
    if mode == "nearest":
        half = 1 << (k - 1)
        if r > half or (r == half and q % 2 == 1):
            q += 1
    return sign * (q << k)


def _cut_to(v: int, k: int, cut: str) -> int:
    """v truncated toward zero ("toward_zero") or floored ("down", an arithmetic right shift)
    to a multiple of 2^k units (k <= 0: unchanged)."""
    if k <= 0:
        return v
    if cut == "down":
        return (v >> k) << k
    return (1 if v >= 0 else -1) * ((abs(v) >> k) << k)


def slow_dot(products: list[int], acc: Accumulator) -> int:
    F, m = acc.fused_terms, acc.mantissa_bits
    narrow, wide, seen = 0, 0, 0
    for start in range(0, len(products), F):
        group = products[start:start + F]
        if acc.alignment == "sum":
            narrow = _round_int(narrow + sum(group), m, acc.rounding)
        else:
            terms = [narrow] + group
            nz = [t for t in terms if t]
            if nz:
                k = max(_floor_log2(t) for t in nz) - m
                narrow = _round_int(sum(_cut_to(t, k, acc.term_rounding) for t in terms), m,
                                    acc.rounding)
        seen += len(group)
        if acc.promote_every and seen % acc.promote_every == 0:
            wide, narrow = _round_int(wide + narrow, 23, "nearest"), 0
    return _round_int(wide + narrow, 23, "nearest") if acc.promote_every else narrow


# --- generated dot products (vectorised: one hypothesis example is a batch) ---------------
KINDS = ("random", "all_equal", "cancelling", "subnormal", "mixed", "positive")


def _batch(kind: str, seed: int, rows: int, K: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    finfo_max = 448.0 if fmt == "e4m3" else 57344.0
    tiny = 2.0 ** -9 if fmt == "e4m3" else 2.0 ** -16

    def cast(x):
        return x.clamp(-finfo_max, finfo_max).to(dtype).double()

    if kind == "random":
        a, b = torch.randn(rows, K, generator=g), torch.randn(rows, K, generator=g)
    elif kind == "positive":
        a, b = torch.rand(rows, K, generator=g) + 0.01, torch.rand(rows, K, generator=g) + 0.01
    elif kind == "all_equal":
        v = torch.randn(rows, 1, generator=g).expand(rows, K)
        a, b = v.clone(), torch.ones(rows, K)
    elif kind == "cancelling":  # x, then -x later: the exact sum is 0 or tiny
        half = torch.randn(rows, K // 2, generator=g) * 8
        a = torch.cat((half, -half.flip(-1)), -1)
        a = torch.cat((a, torch.randn(rows, K - a.shape[1], generator=g)), -1)
        b = torch.ones(rows, K)
    elif kind == "subnormal":
        a = torch.randint(-7, 8, (rows, K), generator=g).double() * tiny
        b = torch.randint(-7, 8, (rows, K), generator=g).double() * tiny
    else:  # mixed magnitudes: big terms beside small ones, the alignment's hard case
        scale = 2.0 ** torch.randint(-8, 8, (rows, K), generator=g).double()
        a, b = torch.randn(rows, K, generator=g) * scale, torch.randn(rows, K, generator=g)
    return cast(a.double()), cast(b.double())


def _check(preset: str, kind: str, seed: int, rows: int, K: int, fmt: str) -> int:
    acc = get_preset(preset)
    a, b = _batch(kind, seed, rows, K, fmt)
    got = dot(a, b, acc)
    prods = (a * b).numpy()
    for i in range(rows):
        want = slow_dot([_to_int(x) for x in prods[i]], acc)
        assert _to_int(got[i].item()) == want, (preset, kind, seed, i, got[i].item(),
                                                want / 2.0 ** UNIT)
    return rows


CASES = st.tuples(st.sampled_from(KINDS), st.integers(0, 2 ** 31), st.integers(1, 160),
                  st.sampled_from(("e4m3", "e5m2")))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=12, deadline=None, derandomize=True)
@given(case=CASES)
def test_emulator_matches_the_scalar_model_bit_for_bit(preset, case):
    kind, seed, K, fmt = case
    _check(preset, kind, seed, 20, K, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_ten_thousand_dot_products_per_preset_bit_for_bit(preset):
    # every kind, both fp8 formats, K from 1 to 300 (across fused groups and promotions)
    rng = np.random.default_rng(zlib.crc32(preset.encode()))
    done = 0
    while done < 10_000:
        for kind in KINDS:
            done += _check(preset, kind, int(rng.integers(2 ** 31)), 100,
                           int(rng.integers(1, 300)), ("e4m3", "e5m2")[done % 2])
    assert done >= 10_000


@pytest.mark.parametrize("variant", [dict(alignment="sum"), dict(rounding="nearest"),
                                     dict(fused_terms=1), dict(fused_terms=16, promote_every=64),
                                     dict(term_rounding="down"), dict(rounding="down"),
                                     dict(alignment="sum", rounding="down"),
                                     dict(term_rounding="down", rounding="down", promote_every=64)])
def test_the_variants_match_the_scalar_model(variant):
    acc = get_preset("h200-scaled-mm").with_(**variant)
    for kind in KINDS:
        a, b = _batch(kind, 7, 30, 200, "e4m3")
        got = dot(a, b, acc)
        prods = (a * b).numpy()
        for i in range(30):
            assert _to_int(got[i].item()) == slow_dot([_to_int(x) for x in prods[i]], acc)


def test_the_scalar_model_tells_the_presets_apart():
    # the agreement above means something: on mixed magnitudes the models differ
    a, b = _batch("mixed", 5, 50, 300, "e4m3")
    prods = [[_to_int(x) for x in row] for row in (a * b).numpy()]
    got = {p: [slow_dot(r, PRESETS[p]) for r in prods] for p in PRESETS}
    assert len({tuple(v) for v in got.values()}) == len(PRESETS)
    assert [_to_int(v) for v in dot(a, b, "h200-scaled-mm").tolist()] != got["h200-scaled-mm-sum"]


def test_matmul_is_the_dot_products_of_rows_and_columns():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 96, generator=g).to(torch.float8_e4m3fn).double()
    b = torch.randn(96, 7, generator=g).to(torch.float8_e4m3fn).double()
    c = matmul(a, b, "h200-scaled-mm", block_rows=2)
    for i in range(5):
        assert torch.equal(c[i], dot(a[i].expand(7, 96), b.t(), "h200-scaled-mm"))


def test_a_sum_that_truncation_stalls_and_promotion_rescues():
    # 2^20 then ones: each 1 is below the 2^(20-13) grid and truncated away; restarting the
    # narrow sum every 128 elements (DeepSeek-V3's fix) keeps all but the first interval's
    x = torch.ones(1, 4096, dtype=torch.float64)
    x[0, 0] = 2.0 ** 20
    one = torch.ones_like(x)
    assert dot(x, one, "h200-scaled-mm").item() == 2.0 ** 20
    assert dot(x, one, "deepseek-v3").item() == 2.0 ** 20 + 4095 - 127
    assert dot(x, one, "fp32").item() == 2.0 ** 20 + 4095


def test_checkpoints_are_the_partial_results():
    a, b = _batch("random", 1, 10, 256, "e4m3")
    full, parts = dot(a, b, "deepseek-v3", checkpoints=[64, 128, 256])
    assert torch.equal(parts[256], full)
    assert torch.equal(parts[64], dot(a[:, :64], b[:, :64], "deepseek-v3"))
    assert torch.equal(parts[128], dot(a[:, :128], b[:, :128], "deepseek-v3"))


def test_bad_input_is_named():
    with pytest.raises(InvalidArgument, match="h200-scaled-mm"):
        get_preset("h100")
    x = torch.ones(2, 8, dtype=torch.float64)
    y = x.clone()
    y[1, 3] = math.nan
    with pytest.raises(InvalidArgument, match=r"non-finite.*index \(1, 3\)"):
        dot(x, y, "fp32")
    with pytest.raises(InvalidArgument, match="not exact in float64"):
        dot(torch.rand(2, 8, dtype=torch.float64), torch.rand(2, 8, dtype=torch.float64), "fp32")
    with pytest.raises(InvalidArgument, match="multiple of fused_terms"):
        Accumulator("x", 13, 32, "toward_zero", "terms", promote_every=100)


# --- the reveal on the emulator returns each preset's own parameters ----------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_reveal_on_the_emulator_returns_the_preset(preset):
    from trainprobes.numerics.gemm_reveal import reveal_accumulator
    acc = PRESETS[preset]
    found = reveal_accumulator(lambda x: dot(x.double().reshape(1, -1),
                                             torch.ones(1, x.numel(), dtype=torch.float64), acc),
                               n=64 if acc.fused_terms > 1 else 12)
    assert found.mantissa_bits == acc.mantissa_bits
    assert found.fused_terms == acc.fused_terms
    assert found.rounding == acc.rounding
    assert found.alignment == acc.alignment
    assert found.term_rounding == acc.term_rounding


# --- the fp32 preset's vectorised path is the general path -------------------------------

def test_the_fp32_fast_path_is_the_general_model(monkeypatch):
    import trainprobes.reference.gemm as gemm_module
    acc = PRESETS["fp32"]
    cases = [_batch(kind, 11, 20, 300, fmt) for kind in KINDS for fmt in ("e4m3", "e5m2")]
    # fp32 subnormal products and sums (2^-140 is a float32 subnormal), and a sum past fp32's
    # range (the fast path must step aside: the model's exponent is unbounded)
    tiny = torch.tensor([[2.0 ** -70, -(2.0 ** -71), 2.0 ** -70, 3 * 2.0 ** -72]], dtype=torch.float64)
    cases.append((tiny, tiny.abs()))
    huge = torch.full((1, 4), 2.0 ** 100, dtype=torch.float64)
    cases.append((huge, torch.full((1, 4), 2.0 ** 27, dtype=torch.float64)))
    fast = []
    for a, b in cases:
        tr = {}
        fast.append((dot(a, b, acc, checkpoints=[1, a.shape[1]], trace=tr), tr))
    assert fast[-1][0][0].item() == 2.0 ** 129  # 4 x 2^127, beyond fp32: the general path
    taken = [gemm_module._fp32_sequential(a * b, acc, [], None) is not None for a, b in cases]
    assert all(taken[:-1]) and not taken[-1]  # the comparison below tests the fast path
    monkeypatch.setattr(gemm_module, "_fp32_sequential", lambda *args: None)
    for (a, b), ((got, parts), tr) in zip(cases, fast):
        tr2 = {}
        want, parts2 = dot(a, b, acc, checkpoints=[1, a.shape[1]], trace=tr2)
        assert torch.equal(got, want) and all(torch.equal(parts[k], parts2[k]) for k in parts2)
        assert torch.equal(tr["first_absorbed"], tr2["first_absorbed"])
        assert torch.equal(tr["absorbed"], tr2["absorbed"])


# --- sums that need more than float64's 53 bits ---------------------------------------------

def test_a_sum_just_off_the_grid_is_rounded_as_the_exact_sum():
    # 745472 - 3 2^-35 (0.75 of float64's spacing there): fl() gives the float64 just below
    # 745472, which is not on the 14-bit grid (spacing 64 there), but its upper neighbour is;
    # the exact sum lies below 745472, so truncation gives 745408 and nearest 745472 (the sum
    # needs more than 53 bits: wide operands such as bf16 or fp32 products give such sums)
    for rounding, want in (("toward_zero", 745408.0), ("nearest", 745472.0)):
        acc = Accumulator("x", 13, 1, rounding, "sum")
        p = torch.tensor([[-3 * 2.0 ** -35, 745472.0]], dtype=torch.float64)
        got = dot(p, torch.ones_like(p), acc).item()
        assert got == want
        assert _to_int(got) == slow_dot([_to_int(x) for x in p[0].tolist()], acc)
    # the same through the lanes of a fused add of three terms
    acc = Accumulator("x", 13, 3, "toward_zero", "sum")
    p = torch.tensor([[-3 * 2.0 ** -35, 745472.0, 0.0]], dtype=torch.float64)
    assert dot(p, torch.ones_like(p), acc).item() == 745408.0


def test_aligned_terms_whose_sum_passes_53_bits_are_summed_exactly():
    # 45-bit grid, 256-term fused add of values in [1, 2): the aligned integers sum past 2^53
    # units of the grid, where a float64 sum rounds (here onto a 45-bit grid point above the
    # exact sum, which truncation must not reach)
    acc = Accumulator("x", 45, 256, "toward_zero", "terms")
    p = torch.full((1, 256), 2 - 2.0 ** -45, dtype=torch.float64)
    p[0, 0] = 2 - 2 * 2.0 ** -45
    want = slow_dot([_to_int(x) for x in p[0].tolist()], acc)
    assert _to_int(dot(p, torch.ones_like(p), acc).item()) == want


def test_operands_of_27_significant_bits_are_refused():
    # (2^27 - 1)^2 needs 54 bits: not exact in float64. Its float64 has 26 zero bits at the
    # bottom of the mantissa field, which must not read as "fp32 or narrower" (24 bits)
    a = torch.tensor([[2.0 ** 27 - 1]], dtype=torch.float64)
    with pytest.raises(InvalidArgument, match="not exact in float64"):
        dot(a, a, "b200-25bit")
    f = torch.tensor([[1 - 2.0 ** -24, 3.0]], dtype=torch.float64)  # fp32 values pass
    assert dot(f, f, "fp32").item() == 10.0  # accepted; (1 - 2^-24)^2 + 9 rounds to 24 bits


@pytest.mark.parametrize("preset,N", [("deepseek-v3", 128), ("b200-25bit", 64), ("h200-scaled-mm-signfill", 32)])
def test_promotion_in_chunks_is_the_loop(preset, N):
    # without checkpoints or a trace, a promoting accumulator runs each interval of N_C
    # products as a dot product of its own and sums the intervals in fp32 (25-bit intervals
    # are no fp32 values: the per-interval _exact_round path); with them, the loop over K
    acc = get_preset(preset).with_(promote_every=N)
    for kind in KINDS:
        for K in (N + 7, 3 * N, 5 * N - 32):
            a, b = _batch(kind, K, 25, K, "e5m2")
            chunked = dot(a, b, acc)
            looped, _ = dot(a, b, acc, checkpoints=[K])
            assert torch.equal(chunked, looped), (kind, K)


def test_promotion_runs_share_the_groups_and_agree_with_dot():
    from trainprobes.reference.gemm import promotion_runs
    a, b = _batch("mixed", 3, 20, 300, "e4m3")
    for preset in ("h200-scaled-mm", "h200-scaled-mm-sum", "b200-25bit"):
        run = promotion_runs(a * b, preset)
        for n in (32, 64, 256, 512):
            assert torch.equal(run(n), dot(a, b, get_preset(preset).with_(promote_every=n))), (preset, n)


def test_promotion_runs_largest_first_continue_the_halves_bit_for_bit():
    # the search's own order (largest N_C first): each interval continues from the narrow sum
    # of its first half, kept from the larger candidate; K not a multiple of the intervals
    # (zero-padded last interval) and one that is; against each interval run from 0
    # (test_promotion_in_chunks_is_the_loop pins that one to the loop over all of K)
    from trainprobes.reference.gemm import promotion_runs
    for K in (1000, 1024):
        a, b = _batch("mixed", 4, 8, K, "e4m3")
        for preset in ("h200-scaled-mm", "h200-scaled-mm-signfill", "h200-scaled-mm-sum"):
            run = promotion_runs(a * b, preset)
            for n in (512, 256, 128, 64, 32, 256, 96):
                alone = dot(a, b, get_preset(preset).with_(promote_every=n))
                assert torch.equal(run(n), alone), (K, preset, n)


@pytest.mark.parametrize("variant", [dict(rounding="nearest"), dict(rounding="nearest", term_rounding="down"),
                                     dict(alignment="sum", rounding="nearest")])
def test_reveal_tells_a_nearest_sum_from_truncation_under_aligned_terms(variant):
    # with "terms" alignment every term is cut to the grid before the sum, so the sum's own
    # rounding shows only where it carries into the next binade; the reveal read every such
    # model as toward zero (13 bits, 32 or 8 terms, round to nearest: 'toward_zero')
    from trainprobes.numerics.gemm_reveal import reveal_accumulator
    acc = PRESETS["h200-scaled-mm"].with_(**variant)
    found = reveal_accumulator(lambda x: dot(x.double().reshape(1, -1),
                                             torch.ones(1, x.numel(), dtype=torch.float64), acc), n=64)
    assert (found.rounding, found.alignment, found.term_rounding, found.fused_terms) == \
        (acc.rounding, acc.alignment, acc.term_rounding, acc.fused_terms)
