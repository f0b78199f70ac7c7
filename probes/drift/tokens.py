"""The token pass: every per-token sum of the drift statistics from one read of the inputs.

The [G, T] pair is read in blocks of whole rows (at most BLOCK_ELEMENTS tokens) and every
statistic of a block is computed into four reused buffers (Work): no other temporary, no
float64 copy of the tokens. Per-block float32 reductions are accumulated in float64. The loop
is over blocks of rows, never over sequences or tokens.

Block size. With one intra-op thread, blocks of CACHE_BLOCK_ELEMENTS keep the buffers in cache
(measured, one thread: update 1.9x and compare 3.7x a bare abs-max pass, against 2.5x and 6.0x
in one 10M block). With more threads they are large (BLOCK_ELEMENTS): every elementwise op is
one OpenMP parallel region, and on a shared machine each region's barrier waits for a
descheduled thread (measured on 2 cores at load average ~15: update 20x in 1M blocks, 4x in
one block). Fresh buffer memory costs its page faults (~0.4 ms/MB here) once per buffer, so
the buffers are few (three floats and a bool per token) and a monitor keeps its Work.

Histograms are torch.histc's, bin for bin (`Bins`); order statistics are exact, by counting
per bin and selecting inside the few bins that hold the ranks (`order_statistics`).

Notation of trainprobes.drift.stats: x = infer - train, a = -x = log rho, e = expm1(a) = rho - 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from trainprobes.drift.inputs import Layout, column_counts
from trainprobes.errors import InvalidArgument

BLOCK_ELEMENTS = 1 << 24
CACHE_BLOCK_ELEMENTS = 1 << 20
# below this max |a| the k3 sums come from power series: expm1(a) - a cancels in float32
KL_SERIES_MAX = 1e-3
PROB_BUCKETS = 10  # half-decades of p_infer, the last one open-ended
LN10 = math.log(10.0)


@dataclass(frozen=True)
class Bins:
    """The bins of torch.histc(v, count, lo, hi), reproduced exactly and about 3x faster.

    ATen's histc (aten/src/ATen/native/cpu/HistogramKernel.cpp, LINEAR_INTERPOLATION) computes,
    in float32 with lo and hi rounded to float32, pos = (v - lo) * count / (hi - lo), keeps
    trunc(pos) (the last bin closed: count -> count - 1) and skips v outside [lo, hi]. Here:
    clamp to [lo, hi], the same three float32 operations, truncation by the int conversion and
    one bincount; the out-of-range values, clamped into the end bins, are counted apart.
    """

    lo: float
    hi: float
    count: int

    def __post_init__(self):
        if not (self.count >= 1 and np.float32(self.hi) > np.float32(self.lo)):
            raise InvalidArgument(f"Bins(lo={self.lo!r}, hi={self.hi!r}, count={self.count!r}) needs "
                                  f"count >= 1 and hi > lo in float32")

    @property
    def lo32(self) -> float:
        return float(np.float32(self.lo))

    @property
    def hi32(self) -> float:
        return float(np.float32(self.hi))

    @property
    def width32(self) -> float:
        return float(np.float32(self.hi) - np.float32(self.lo))

    def index(self, v: torch.Tensor, out_f: torch.Tensor, out_i: torch.Tensor) -> torch.Tensor:
        """int32 bin of each v in [0, count] (count means count - 1; values outside [lo, hi]
        land in the end bins). out_f, out_i: float32 / int32 buffers shaped like v."""
        # clamping v - lo to [0, hi - lo] is clamping v to [lo, hi] first: float subtraction
        # is monotone and v - lo rounds to hi - lo at v = hi
        torch.sub(v, self.lo32, out=out_f).clamp_(0.0, self.width32)
        out_f.mul_(float(self.count)).div_(self.width32)
        return out_i.copy_(out_f)  # truncation toward zero, as histc's static_cast

    def bin_of(self, value: float) -> int:
        """The bin of one value: -1 below lo, count above hi."""
        if not value >= self.lo32:
            return -1
        if not value <= self.hi32:
            return self.count
        v = torch.tensor([value], dtype=torch.float32)
        return min(int(self.index(v, torch.empty(1), torch.empty(1, dtype=torch.int32))), self.count - 1)


@dataclass
class Histogram:
    """Counts per bin of Bins, plus the values below lo and above hi (which histc drops)."""

    bins: Bins
    counts: torch.Tensor = None
    below: int = 0
    above: int = 0

    def __post_init__(self):
        if self.counts is None:
            self.counts = torch.zeros(self.bins.count, dtype=torch.int64)

    def add(self, v: torch.Tensor, work: Work, *, n_pad: int = 0, vmin=None, vmax=None) -> None:
        """Count a block v (contiguous; its n_pad padding entries exactly 0), using work's
        buffers "e" and "p" (v must be neither). vmin, vmax: the block's extremes if known."""
        b = self.bins
        flat = v.reshape(-1)
        k = flat.numel()
        c = torch.bincount(b.index(flat, work.get("e", k), work.ints("p", k)), minlength=b.count + 1)
        c[-2] += c[-1]
        c = c[:-1]
        if vmin is None:
            vmin, vmax = (t.item() for t in torch.aminmax(flat))
        flags = work.get("b", k, torch.bool)
        below = int(torch.count_nonzero(torch.lt(flat, b.lo32, out=flags))) if vmin < b.lo32 else 0
        above = int(torch.count_nonzero(torch.gt(flat, b.hi32, out=flags))) if vmax > b.hi32 else 0
        self.fold(c, below, above, n_pad)

    def fold(self, c: torch.Tensor, below: int, above: int, n_pad: int) -> None:
        """Add one block's counts c to the totals; c still holds the `below` values in its
        first bin and the `above` ones in its last (index() clamps them there)."""
        b = self.bins
        c[0] -= below
        c[-1] -= above
        if n_pad:  # the padding zeros all sit in the bin of 0
            z = b.bin_of(0.0)
            if z < 0:
                below -= n_pad
            elif z == b.count:
                above -= n_pad
            else:
                c[z] -= n_pad
        self.counts += c
        self.below += below
        self.above += above

    def cumulative(self) -> torch.Tensor:
        """Running count over [below, bin 0, ..., bin count - 1, above]."""
        ext = torch.cat([torch.tensor([self.below]), self.counts, torch.tensor([self.above])])
        return ext.cumsum(0)


def count_both(h1: Histogram, h2: Histogram, v: torch.Tensor, work: Work, *, n_pad: int, vmin: float,
               vmax: float) -> None:
    """h1.add and h2.add of one block at once; v is overwritten.

    The elementwise steps of Bins.index run once over the [2, k] stack of both (one parallel
    region per step, not one per histogram), clamped after the division instead of before
    (the same bins in range; out-of-range values land in the end bins either way and are
    counted apart), and the int16 bin indices are written over v's memory.
    """
    flat = v.reshape(-1)
    k = flat.numel()
    bins = (h1.bins, h2.bins)
    flags = work.get("b", k, torch.bool)
    outside = [(int(torch.count_nonzero(torch.lt(flat, b.lo32, out=flags))) if vmin < b.lo32 else 0,
                int(torch.count_nonzero(torch.gt(flat, b.hi32, out=flags))) if vmax > b.hi32 else 0)
               for b in bins]

    def col(values):
        return torch.tensor(values, dtype=torch.float32).view(2, 1)
    pos = torch.sub(flat.expand(2, k), col([b.lo32 for b in bins]), out=work.rows(k))
    pos.mul_(col([float(b.count) for b in bins])).div_(col([b.width32 for b in bins]))
    pos.clamp_(0.0, float(max(b.count for b in bins)))
    idx = flat.view(torch.int16).view(2, k).copy_(pos)  # truncation toward zero, as histc
    for h, row, (below, above) in zip((h1, h2), idx, outside):
        c = torch.bincount(row, minlength=h.bins.count + 1)
        c[h.bins.count - 1] += c[h.bins.count:].sum()  # the closed last bin, and values above hi
        h.fold(c[:h.bins.count], below, above, n_pad)


class Work:
    """Block-sized buffers by name, allocated on first use and reused by every block (and by
    every call that is handed the same Work: first touches of fresh memory cost more than the
    arithmetic here)."""

    def __init__(self, size: int = 0):
        self.size = size
        self._bufs: dict = {}

    def fit(self, size: int) -> Work:
        if size > self.size:
            self.size, self._bufs = size, {}
        return self

    def get(self, name: str, k: int, dtype=torch.float32) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            if name in ("e", "p"):  # one [2, size] storage: rows() stacks them
                self._bufs["e"], self._bufs["p"] = torch.empty(2, self.size)
                buf = self._bufs[name]
            else:
                buf = self._bufs[name] = torch.empty(self.size, dtype=dtype)
        return buf[:k]

    def rows(self, k: int) -> torch.Tensor:
        """Buffers "e" and "p" as the rows of one [2, k] tensor."""
        return self.get("e", k).as_strided((2, k), (self.size, 1))

    def ints(self, name: str, k: int) -> torch.Tensor:
        """A float buffer's memory as int32 (bin indices need no buffer of their own)."""
        return self.get(name, k).view(torch.int32)


@dataclass
class Moments:
    """n, mean and central sums M2, M3, M4 (M_k = sum (v - mean)^k), merged exactly across
    blocks (Pebay 2008, "Formulas for robust, one-pass parallel computation of covariances and
    arbitrary-order statistical moments", eq. 3.1 and 2.1)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    m3: float = 0.0
    m4: float = 0.0

    def merge(self, o: Moments) -> None:
        na, nb = self.n, o.n
        if nb == 0:
            return
        if na == 0:
            self.n, self.mean, self.m2, self.m3, self.m4 = o.n, o.mean, o.m2, o.m3, o.m4
            return
        n = na + nb
        d = o.mean - self.mean
        self.m4 += (o.m4 + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
                    + 6 * d * d * (na * na * o.m2 + nb * nb * self.m2) / n ** 2
                    + 4 * d * (na * o.m3 - nb * self.m3) / n)
        self.m3 += o.m3 + d ** 3 * na * nb * (na - nb) / n ** 2 + 3 * d * (na * o.m2 - nb * self.m2) / n
        self.m2 += o.m2 + d * d * na * nb / n
        self.mean += d * nb / n
        self.n = n


@dataclass
class Shape:
    """What compare reports beyond the monitor: the shape of x, probabilities, and tables."""

    moments: Moments = field(default_factory=Moments)  # of x
    abs_sum: float = 0.0                                # sum |x|
    p: dict = field(default_factory=lambda: dict.fromkeys(("t", "i", "tt", "ii", "ti"), 0.0))
    bucket_n: torch.Tensor = None                       # by p_infer half-decade
    bucket_s1: torch.Tensor = None
    bucket_s2: torch.Tensor = None
    col_sum: torch.Tensor | None = None                 # by position (sequence units)
    col_sq: torch.Tensor | None = None
    col_n: torch.Tensor | None = None


@dataclass
class TokenSums:
    """Sums over the real tokens (x = infer - train), and per row of the layout."""

    n: int
    x_min: float = math.inf
    x_max: float = -math.inf
    s1: float = 0.0          # sum x
    s2: float = 0.0          # sum x^2
    se: float = 0.0          # sum e
    see: float = 0.0         # sum e^2
    k3: float = 0.0          # sum (e - a), forward k3
    rev: float = 0.0         # sum (1 - rho + rho log rho), reverse k3
    n_out: int = 0           # tokens with |x| > log C
    tail_sq: float = 0.0     # their sum x^2
    adp: float = 0.0         # sum |p_infer - p_train|
    adp_max: float = 0.0
    row_sum: torch.Tensor = None   # [G] float64, sum x per row
    row_sq: torch.Tensor = None    # [G] float64, sum x^2 per row
    row_n: torch.Tensor = None     # [G] int64, real tokens per row
    shape: Shape | None = None
    histograms: list = field(default_factory=list)  # Histogram of a = -x per Bins asked for


def kl_block(a: torch.Tensor, e: torch.Tensor, max_abs: float, powers: tuple, work: Work) -> tuple:
    """(sum k3, sum reverse k3, sum e, sum e^2) of one block from a = log rho, e = expm1(a) and
    powers = (sum a, sum a^2, sum a^3, sum a^4) (the last two may be None when max |a| >= 1e-3).

    k3 = e - a elementwise, reverse = 1 - rho + rho log rho = -(e - a) + e a. Near rho = 1 these
    cancel in float32 (expm1(a) - a loses every digit for |a| ~ 1e-7), so for max |a| < 1e-3
    use their series from raw power sums instead (errors O(a^5), below float32 rounding):
      k3 = a^2/2 + a^3/6 + a^4/24,  reverse = a^2/2 + a^3/3 + a^4/8,
      e = a + a^2/2 + a^3/6 + a^4/24,  e^2 = a^2 + a^3 + 7 a^4 / 12.
    Elsewhere sum e = sum (e - a) + sum a: one reduction fewer, no cancellation added.
    """
    s1, s2, s3, s4 = powers
    if max_abs < KL_SERIES_MAX:
        k3 = s2 / 2 + s3 / 6 + s4 / 24
        return k3, s2 / 2 + s3 / 3 + s4 / 8, s1 + k3, s2 + s3 + 7 * s4 / 12
    k3 = torch.sub(e, a, out=work.get("p", a.numel())).sum().item()  # elementwise: errors do not cancel
    return k3, -k3 + torch.dot(e, a).item(), k3 + s1, torch.dot(e, e).item()


def _moments_from_powers(n: int, c: float, p1: float, p2: float, p3: float, p4: float) -> Moments:
    """Central moments of x = -a over n values from the power sums p_k = sum (a - c)^k, with
    c near enough to the mean that they do not cancel (t = mean - c is small)."""
    t = p1 / n
    m2 = p2 - n * t * t
    m3 = p3 - 3 * t * p2 + 2 * n * t ** 3
    m4 = p4 - 4 * t * p3 + 6 * t * t * p2 - 3 * n * t ** 4
    return Moments(n, -(c + t), max(m2, 0.0), -m3, max(m4, 0.0))


def _block_moments(a: torch.Tensor, m, n: int, powers: tuple, work: Work) -> Moments:
    """Central moments of x = -a over a block's n real tokens. Raw power sums (powers: sum a,
    a^2, a^3, a^4) when |mean| <= std, where they lose at most a digit; otherwise power sums
    of d = a - mean, corrected to the exact mean (a spread far smaller than the mean, e.g. a
    constant offset, would cancel to nothing in the raw sums)."""
    s1, s2, s3, s4 = powers
    c = s1 / n
    if c * c <= s2 / n - c * c:
        return _moments_from_powers(n, 0.0, s1, s2, s3, s4)
    k = a.numel()
    d = torch.sub(a, c, out=work.get("e", k))
    if m is not None:
        _zero_padding(d, m.reshape(-1))
    d2 = torch.mul(d, d, out=work.get("p", k))
    return _moments_from_powers(n, c, d.sum().item(), d2.sum().item(), torch.dot(d2, d).item(),
                                torch.dot(d2, d2).item())


def _zero_padding(t: torch.Tensor, real: torch.Tensor) -> None:
    """t = 0 where real is False, in place (a select: padding may hold NaN; a multiply by the
    bool mask would first copy it to float)."""
    torch.where(real, t, torch.zeros((), dtype=t.dtype), out=t)


def _rows_per_block(G: int, T: int) -> int:
    """Whole rows per block (see the module doc for the size), blocks of near-equal size."""
    size = CACHE_BLOCK_ELEMENTS if torch.get_num_threads() == 1 else BLOCK_ELEMENTS
    blocks = max(1, -(-G * T // size))
    return -(-G // blocks)


def token_sums(layout: Layout, clip: float, *, shape: bool = False, bins: tuple = (),
               work: Work | None = None) -> TokenSums:
    """Every sum the drift metrics need, in one pass over the layout's blocks of rows.

    shape: also the moments, probabilities and tables of `compare` (Shape).
    bins: Bins to histogram a = -x over (the monitor's; histc semantics).
    work: buffers to reuse (a monitor keeps one across steps); fitted to the block size.
    """
    train, infer, mask = layout.train, layout.infer, layout.mask
    G, T = train.shape
    R = _rows_per_block(G, T)
    work = (work or Work()).fit(R * T)
    log_c = math.log(clip)
    out = TokenSums(n=layout.n_tokens, row_sum=torch.empty(G, dtype=torch.float64),
                    row_sq=torch.empty(G, dtype=torch.float64), histograms=[Histogram(b) for b in bins])
    out.row_n = torch.full((G,), T, dtype=torch.int64) if mask is None else layout.row_n.long()
    sh = out.shape = _new_shape(T if layout.unit == "sequence" else None) if shape else None
    for r0 in range(0, G, R):  # loop over blocks of rows
        r1 = min(G, r0 + R)
        rows, k = r1 - r0, (r1 - r0) * T
        tr, inf = train[r0:r1], infer[r0:r1]
        m = None if mask is None else mask[r0:r1]
        a2d = torch.sub(tr, inf, out=work.get("a", k).view(rows, T))
        n_pad = 0
        if m is not None:
            _zero_padding(a2d, m)  # a = 0 adds nothing to any sum below
            n_pad = k - int(out.row_n[r0:r1].sum())
        n_b = k - n_pad
        if n_b == 0:
            out.row_sum[r0:r1] = 0.0
            out.row_sq[r0:r1] = 0.0
            continue
        a = a2d.view(-1)
        amin, amax = (v.item() for v in torch.aminmax(a))
        hmin, hmax = amin, amax  # extremes with the padding zeros, for the histograms
        if n_pad and (amin == 0.0 or amax == 0.0):  # the padding zeros may be posing as extremes
            first = a[int(m.reshape(-1).view(torch.uint8).argmax())]
            amin, amax = (v.item() for v in torch.aminmax(torch.where(m.reshape(-1), a, first)))
        out.x_min, out.x_max = min(out.x_min, -amax), max(out.x_max, -amin)
        max_abs = max(-amin, amax)
        row_a = a2d.sum(1)
        a2 = torch.mul(a, a, out=work.get("p", k))  # "p" is free until kl_block
        row_q = a2.view(rows, T).sum(1)
        out.row_sum[r0:r1] = row_a.neg()
        out.row_sq[r0:r1] = row_q
        s1_a, s2 = row_a.sum().item(), row_q.sum().item()
        out.s1 -= s1_a
        out.s2 += s2
        s3 = s4 = None
        if sh is not None or max_abs < KL_SERIES_MAX:
            s3, s4 = torch.dot(a2, a).item(), torch.dot(a2, a2).item()
        e = torch.expm1(a, out=work.get("e", k))
        k3, rev, se, see = kl_block(a, e, max_abs, (s1_a, s2, s3, s4), work)
        out.k3 += k3
        out.rev += rev
        out.se += se
        out.see += see
        if sh is not None or max_abs > log_c:
            w = torch.abs(a, out=work.get("p", k))
            if sh is not None:
                sh.abs_sum += w.sum().item()
            if max_abs > log_c:
                outside = torch.gt(w, log_c, out=work.get("b", k, torch.bool))
                out.n_out += int(torch.count_nonzero(outside))
                tail = a.masked_select(outside)
                out.tail_sq += torch.dot(tail, tail).item()
        # |p_infer - p_train| = p_infer |1 - rho| = p_infer |e|: one exp, no cancellation
        pi = torch.exp(inf.reshape(-1), out=work.get("p", k))
        if m is not None and (sh is not None or not layout.finite_pad):  # NaN padding, or pearson sums
            _zero_padding(pi, m.reshape(-1))
        adp = e.abs_().mul_(pi)  # e is not needed after this
        out.adp += adp.sum().item()
        out.adp_max = max(out.adp_max, adp.max().item())
        if sh is not None:
            _shape_block(sh, a, pi, inf, m, n_pad, (s1_a, s2, s3, s4), work)
        if len(out.histograms) == 2:  # last: it overwrites a
            count_both(*out.histograms, a, work, n_pad=n_pad, vmin=hmin, vmax=hmax)
        else:
            for h in out.histograms:
                h.add(a, work, n_pad=n_pad, vmin=hmin, vmax=hmax)
    return out


def _new_shape(T: int | None) -> Shape:
    sh = Shape(bucket_n=torch.zeros(PROB_BUCKETS, dtype=torch.int64),
               bucket_s1=torch.zeros(PROB_BUCKETS, dtype=torch.float64),
               bucket_s2=torch.zeros(PROB_BUCKETS, dtype=torch.float64))
    if T is not None:
        sh.col_sum, sh.col_sq = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
        sh.col_n = torch.zeros(T, dtype=torch.int64)
    return sh


def _shape_block(sh: Shape, a, pi, inf, m, n_pad: int, powers: tuple, work: Work) -> None:
    """compare's extras for one block. pi (work's "p") is p_infer, zero on padding; work's
    "e" is free."""
    k = a.numel()
    real = None if m is None else m.reshape(-1)
    pt = torch.exp(a, out=work.get("e", k)).mul_(pi)  # p_train = rho p_infer: 0 where pi is
    p = sh.p
    p["t"] += pt.sum().item()
    p["i"] += pi.sum().item()
    p["tt"] += torch.dot(pt, pt).item()
    p["ii"] += torch.dot(pi, pi).item()
    p["ti"] += torch.dot(pt, pi).item()
    # bucket b holds p_infer in (10^-(b+1)/2, 10^-b/2], the last one everything smaller
    bf = torch.mul(inf.reshape(-1), -2.0 / LN10, out=work.get("e", k)).floor_().clamp_(0, PROB_BUCKETS - 1)
    if real is not None:
        _zero_padding(bf, real)  # padding -> bucket 0, taken out of its count below
    idx = work.ints("p", k).copy_(bf)
    cnt = torch.bincount(idx, minlength=PROB_BUCKETS)
    cnt[0] -= n_pad
    sh.bucket_n += cnt
    a2 = torch.mul(a, a, out=work.get("e", k))  # again: cheaper than a buffer of its own
    sh.bucket_s1 -= torch.zeros(PROB_BUCKETS).index_add_(0, idx, a).double()  # x = -a
    sh.bucket_s2 += torch.zeros(PROB_BUCKETS).index_add_(0, idx, a2).double()
    if sh.col_sum is not None:
        T = sh.col_sum.numel()
        sh.col_sum -= a.view(-1, T).sum(0).double()
        sh.col_sq += a2.view(-1, T).sum(0).double()
        sh.col_n += k // T if m is None else column_counts(m)
    sh.moments.merge(_block_moments(a, m, k - n_pad, powers, work))


def x_blocks(layout: Layout, work: Work | None = None):
    """Iterate (x block, its mask or None, padding count) over blocks of rows, padding zeroed;
    the block is work's buffer "a", valid until the next one."""
    train, infer, mask = layout.train, layout.infer, layout.mask
    G, T = train.shape
    R = _rows_per_block(G, T)
    work = (work or Work()).fit(R * T)
    for r0 in range(0, G, R):  # loop over blocks of rows
        r1 = min(G, r0 + R)
        x = torch.sub(infer[r0:r1], train[r0:r1], out=work.get("a", (r1 - r0) * T).view(r1 - r0, T))
        if mask is None:
            yield x, None, 0
            continue
        m = mask[r0:r1]
        _zero_padding(x, m)
        yield x, m, x.numel() - int(torch.count_nonzero(m))


def histogram(blocks, bins: Bins, work: Work | None = None) -> Histogram:
    """Histogram of the real values of blocks (an iterable of (values, mask, n_pad))."""
    h = Histogram(bins)
    work = work or Work()
    for v, _, n_pad in blocks:
        h.add(v, work.fit(v.numel()), n_pad=n_pad)
    return h


def order_statistics(blocks, ranks: list, hist: Histogram, work: Work | None = None) -> list:
    """Exact order statistics v_(k) (1-based ranks over the real values) without a full sort.

    1. hist counts the values per bin (same blocks, same Bins)
    2. the running count gives the bin holding each rank, and the count below it
    3. one more pass gathers the values of those bins only; kthvalue selects inside them
    `blocks` is called again for step 3 (a callable returning the iterable of step 1). The
    same Bins.index decides counting and gathering, so rounding at bin edges cannot misplace
    a rank.
    """
    b = hist.bins
    C = b.count
    cum = hist.cumulative()
    where = torch.searchsorted(cum, torch.tensor(ranks, dtype=cum.dtype)).tolist()
    wanted = sorted(set(where))
    table = torch.zeros(C + 1, dtype=torch.bool)
    for j in wanted:
        if 1 <= j <= C:
            table[j - 1] = True
    table[C] = table[C - 1]
    got = {j: [] for j in wanted}
    work = work or Work()
    for v, m, n_pad in blocks():
        flat = v.reshape(-1)
        k = flat.numel()
        work.fit(k)
        real = None if m is None else m.reshape(-1)
        idx = b.index(flat, work.get("e", k), work.ints("p", k))
        sel = table.index_select(0, idx)
        if real is not None and n_pad:
            sel &= real
        at = sel.nonzero().squeeze(1)
        vals, vb = flat.index_select(0, at), idx.index_select(0, at).clamp_(max=C - 1)
        keep = (vals >= b.lo32) & (vals <= b.hi32)  # values clamped into the end bins are not in them
        vals, vb = vals[keep], vb[keep]
        for j in wanted:
            if j == 0:
                out = flat < b.lo32
            elif j == C + 1:
                out = flat > b.hi32
            else:
                got[j].append(vals[vb == j - 1])
                continue
            if real is not None:
                out &= real
            got[j].append(flat[out])
    pools = {j: torch.cat(v) if v else torch.empty(0) for j, v in got.items()}
    result = []
    for k, j in zip(ranks, where):
        below = int(cum[j - 1]) if j > 0 else 0
        result.append(torch.kthvalue(pools[j], k - below).values.item())
    return result
