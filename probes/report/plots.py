"""Plots for reports, drawn from plot specs in a Result's evidence.

A probe (or the audit that runs it) puts `evidence["plots"] = [spec, ...]`; each spec is
plain JSON, so a report can be re-rendered later from report.json alone:
  {"kind": "line", "title", "x": [...], "series": {label: [...]}, "xlabel", "ylabel",
   "logx": bool, "logy": bool}                     stall curves, trends across nights
  {"kind": "hist", "title", "edges": [...], "counts": [...], "xlabel"}
                                                   error / log-ratio histograms
  {"kind": "ci", "title", "labels": [...], "estimate": [...], "low": [...], "high": [...],
   "ylabel"}                                       bias with its confidence interval
  {"kind": "heatmap", "title", "matrix": [[...]], "xlabel", "ylabel"}
                                                   causality leak map (position x cut)
matplotlib is imported only here, with the Agg backend; without it reports have no plots.
"""
from __future__ import annotations

import base64
import io

KINDS = ("line", "hist", "ci", "heatmap")


def _floats(v):
    return [float(x) if not isinstance(x, str) else float(x) for x in v]


def _draw(ax, spec: dict) -> None:
    kind = spec.get("kind")
    if kind == "line":
        x = _floats(spec["x"])
        for label, ys in spec["series"].items():
            ax.plot(x, _floats(ys), marker=".", label=str(label))
        if spec.get("logx"):
            ax.set_xscale("log")
        if spec.get("logy"):
            ax.set_yscale("log")
        if len(spec["series"]) > 1:
            ax.legend(fontsize=7)
    elif kind == "hist":
        edges, counts = _floats(spec["edges"]), _floats(spec["counts"])
        if len(edges) != len(counts) + 1:
            raise ValueError(f"hist spec has {len(edges)} edges for {len(counts)} counts; "
                             "expected one more edge than counts")
        widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
        ax.bar(edges[:-1], counts, width=widths, align="edge", edgecolor="none")
        if spec.get("logy"):
            ax.set_yscale("log")
    elif kind == "ci":
        est, lo, hi = _floats(spec["estimate"]), _floats(spec["low"]), _floats(spec["high"])
        pos = list(range(len(est)))
        err = [[e - l for e, l in zip(est, lo)], [h - e for e, h in zip(est, hi)]]
        ax.errorbar(pos, est, yerr=err, fmt="o", capsize=3)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xticks(pos)
        ax.set_xticklabels([str(s) for s in spec.get("labels", pos)], rotation=45,
                           ha="right", fontsize=7)
    elif kind == "heatmap":
        m = [_floats(row) for row in spec["matrix"]]
        im = ax.imshow(m, aspect="auto", origin="lower", interpolation="nearest", cmap="magma")
        ax.figure.colorbar(im, ax=ax)
    else:
        raise ValueError(f"plot kind={kind!r} is not one of {KINDS}")
    ax.set_title(str(spec.get("title", "")), fontsize=9)
    ax.set_xlabel(str(spec.get("xlabel", "")))
    ax.set_ylabel(str(spec.get("ylabel", "")))


def render_png(spec: dict) -> bytes:
    """One plot spec as PNG bytes."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global figure registry

    fig = Figure(figsize=(5.0, 3.2), dpi=80, layout="constrained")
    _draw(fig.add_subplot(), spec)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def png_data_uri(spec: dict) -> str:
    return "data:image/png;base64," + base64.b64encode(render_png(spec)).decode("ascii")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
