"""Per-family finishing of probe Results for reports: plot specs drawn from the evidence.

The probes keep their evidence plain; these functions only read it and append
`evidence["plots"]` (see probes.report.plots), tolerating a probe that left a field out.
"""
from __future__ import annotations


def _pos_cut(leak):
    if isinstance(leak, dict):
        return leak.get("position"), leak.get("cut")
    if isinstance(leak, (list, tuple)) and len(leak) >= 2:
        return leak[0], leak[1]
    return None, None


def leak_map(leaks, seq_len: int, bins: int = 64) -> dict | None:
    """Heatmap spec: how many leaks at (decision position, cut), binned to at most bins^2."""
    pairs = [_pos_cut(leak) for leak in leaks or []]
    pairs = [(int(p), int(c)) for p, c in pairs if p is not None and c is not None]
    if not pairs or seq_len < 1:
        return None
    width = max(1, -(-seq_len // bins))
    n = -(-seq_len // width)
    m = [[0] * n for _ in range(n)]
    for p, c in pairs:
        if 0 <= p < seq_len and 0 <= c < seq_len:
            m[p // width][c // width] += 1
    unit = "" if width == 1 else f" (bins of {width})"
    return {"kind": "heatmap", "title": f"leaks: decision position x cut{unit}", "matrix": m,
            "xlabel": f"cut (future changed after it){unit}", "ylabel": f"decision position{unit}"}


def causality_result(r, seq_len: int):
    spec = leak_map(r.evidence.get("leaks"), seq_len)
    if spec:
        r.evidence.setdefault("plots", []).append(spec)
    return r
