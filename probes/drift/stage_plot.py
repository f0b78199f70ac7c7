"""The per-stage picture of a localisation, as a plot spec (trainprobes.report.plots): the
free-running and own error per stage on a log axis, the noise floor to margin x floor shaded.
The probe puts it in evidence["plots"], so the HTML report, the audit and `--plot` draw the
same picture."""
from __future__ import annotations


def stage_plot(stages: list, margin: float, title: str) -> dict | None:
    """stages: the evidence's stage rows (name, free_error, noise_floor, own_error or None).
    A log axis cannot show zero: exact (zero) errors are drawn at the bottom edge, a tenth of
    the smallest positive value, and the note says so."""
    if not stages:
        return None
    floors = [s["noise_floor"] for s in stages]
    rows = {"free-running error": [s["free_error"] for s in stages]}
    if stages[0].get("own_error") is not None:  # from dumps there is no patched run
        rows["own error (patched)"] = [s["own_error"] for s in stages]
    values = [v for ys in rows.values() for v in ys] + floors
    positive = [v for v in values if isinstance(v, (int, float)) and v > 0]
    bottom = min(positive) / 10 if positive else 1e-12

    def pos(v):
        return v if isinstance(v, (int, float)) and v > 0 else bottom
    return {"kind": "line", "title": title if len(title) <= 64 else title[:63] + "\u2026", "x": list(range(len(stages))),
            "xticklabels": [s["name"].removeprefix("model.") for s in stages], "xrotation": 30,
            "series": {k: [pos(v) for v in ys] for k, ys in rows.items()}, "logy": True,
            "xlabel": "stage (call order)", "ylabel": "|B - A| / |A| per token",
            "band": {"label": f"noise floor .. x{margin:g}", "low": [pos(f) for f in floors],
                     "high": [pos(f * margin) for f in floors]},
            "note": "A stage whose own error rises above the band is beyond noise; the free-running "
                    f"error after it only carries the divergence. Exact (zero) errors sit at the bottom "
                    f"edge ({bottom:.1g})."}
