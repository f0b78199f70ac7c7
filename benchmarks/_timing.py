"""Side-by-side timing for the benchmarks: two callables run alternately, medians compared,
so both see the same machine load (the machine is shared: read ratios, not seconds)."""
from __future__ import annotations

import statistics
import time


def timed(fn) -> float:
    """Wall seconds of one call of fn()."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(a, b, repeat: int) -> tuple[float, float]:
    """Median wall seconds of a() and b() over `repeat` rounds, a then b in each round."""
    ta, tb = [], []
    for _ in range(repeat):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)
