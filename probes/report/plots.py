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
        # Horizontal: long target names read on the y axis. Estimates spanning orders of
        # magnitude (a 0.2 stall bias beside a 1e-9 fp32 one) get a symlog axis.
        est, lo, hi = _floats(spec["estimate"]), _floats(spec["low"]), _floats(spec["high"])
        pos = list(range(len(est)))[::-1]
        err = [[max(e - l, 0.0) for e, l in zip(est, lo)], [max(h - e, 0.0) for e, h in zip(est, hi)]]
        ax.errorbar(est, pos, xerr=err, fmt="o", capsize=3)
        ax.axvline(0.0, color="grey", lw=0.8)
        ax.set_yticks(pos)
        ax.set_yticklabels([str(s) for s in spec.get("labels", pos)], fontsize=7)
        nz = [abs(v) for v in est + lo + hi if v != 0.0 and v == v]
        if nz and max(nz) / min(nz) > 100:
            import math
            lt = min(nz)
            ax.set_xscale("symlog", linthresh=lt)
            d0, d1 = math.floor(math.log10(lt)), math.ceil(math.log10(max(nz)))
            step = max(1, (d1 - d0) // 3)
            # decades from the largest down, leaving out the ones inside the linear band
            # around 0 (their labels would sit on top of "0")
            dec = [10.0 ** d for d in range(d1, d0 - 1, -step) if 10.0 ** d > 2 * lt] or [10.0 ** d1]
            ticks = [-v for v in dec if any(x < 0 for x in est + lo)] + [0.0] + dec[::-1]
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:.0e}" if t else "0" for t in ticks], fontsize=7)
        spec = {**spec, "xlabel": spec.get("ylabel", ""), "ylabel": ""}
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

    size = (5.0, 3.2)
    if spec.get("kind") == "ci":
        size = (7.5, 1.2 + 0.3 * len(spec.get("estimate", ())))
    fig = Figure(figsize=size, dpi=80, layout="constrained")
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
