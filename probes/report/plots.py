"""Plots for reports, drawn from plot specs in a Result's evidence.

A probe (or the audit that runs it) puts `evidence["plots"] = [spec, ...]`; each spec is
plain JSON, so a report can be re-rendered later from report.json alone:
  {"kind": "line", "title", "x": [...], "series": {label: [...]}, "xlabel", "ylabel",
   "logx": bool, "logy": bool, "xticklabels": [...]}      flip rate by position
  {"kind": "hist", "title", "edges": [...], "counts": [...], "xlabel", "marks": {label: x}}
                                                          error / log-ratio histograms
  {"kind": "ci", "title", "labels": [...], "estimate": [...], "low": [...], "high": [...],
   "ylabel"}                                              bias with its confidence interval
  {"kind": "heatmap", "title", "matrix": [[...]], "xlabel", "ylabel", "clabel"}
                                                          causality leak map (position x cut)
  {"kind": "bars", "title", "labels": [...], "values": [...], "xlabel", "ref": [...]}
                                                          one measured value per row (stall)
  {"kind": "panels", "title", "x": [...], "xticklabels": [...], "xlabel",
   "panels": [{"ylabel", "series": {label: [...]}, "integer": bool}], "note"}
                                                          trends across runs, one panel a metric
Any spec may carry "note": a sentence report.html prints under the picture (what is hidden,
how to read it). matplotlib is imported only here, with the Agg backend; without it
reports have no plots.
"""
from __future__ import annotations

import base64
import io
import math

from trainprobes.markup import plot_text

KINDS = ("line", "hist", "ci", "heatmap", "bars", "panels")
DPI = 96
SMALL, MID, BIG = 8, 9, 10  # points: ticks and legends, axis labels, titles


def _floats(v):
    return [float(x) for x in v]


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator
    axis.set_major_locator(MaxNLocator(integer=True, nbins="auto"))


def _few_ticks(axis, n: int = 5) -> None:
    """At most n ticks, labels in plain or scientific notation as short as they get: long
    labels such as -0.000125 side by side overlap in a 400-pixel plot."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter
    axis.set_major_locator(MaxNLocator(nbins=n))
    fmt = ScalarFormatter(useMathText=True)
    fmt.set_powerlimits((-2, 3))
    axis.set_major_formatter(fmt)


def _series_merged(series: dict) -> dict:
    """Series with identical values drawn once, labelled together ("fp16 = tf32"), so one
    line can never hide another."""
    merged: dict = {}
    for label, ys in series.items():
        key = tuple("nan" if y != y else y for y in _floats(ys))
        merged.setdefault(key, []).append(plot_text(label))
    return {" = ".join(labels): list(key) for key, labels in merged.items()}


MARKERS = "os^vDx+*<>"


def _lines(ax, x, series: dict, colors: dict | None = None) -> None:
    """One line per series, each with its own marker, so equal values stay visible."""
    for i, (label, ys) in enumerate(series.items()):
        ys = [math.nan if y == "nan" else y for y in ys]
        k = list(colors).index(label) if colors and label in colors else i
        ax.plot(x, _floats(ys), marker=MARKERS[k % len(MARKERS)], ms=4, lw=1.2, label=label,
                color=(colors or {}).get(label), mfc="none",
                linestyle=("-", "--", ":", "-.")[k // 10 % 4])


def _xticks(ax, spec: dict, x) -> None:
    labels = spec.get("xticklabels")
    if labels:
        step = max(1, math.ceil(len(x) / 8))  # never more than 8 labels along the axis
        ax.set_xticks(x[::step])
        ax.set_xticklabels([plot_text(s) for s in labels[::step]], fontsize=SMALL)
    elif all(float(v).is_integer() for v in x):
        _integer_ticks(ax.xaxis)


def _draw(fig, spec: dict) -> None:
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ValueError(f"plot kind={kind!r} is not one of {KINDS}")
    if kind == "panels":
        return _draw_panels(fig, spec)
    ax = fig.add_subplot()
    if kind == "line":
        x = _floats(spec["x"])
        series = _series_merged(spec["series"])
        _lines(ax, x, series)
        if spec.get("logx"):
            ax.set_xscale("log")
        else:
            _xticks(ax, spec, x)
        if spec.get("logy"):
            ax.set_yscale("log")
        if len(series) > 1:  # beside the axes, never over the data
            ax.legend(fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    elif kind == "hist":
        edges, counts = _floats(spec["edges"]), _floats(spec["counts"])
        if len(edges) != len(counts) + 1:
            raise ValueError(f"hist spec has {len(edges)} edges for {len(counts)} counts; "
                             "expected one more edge than counts")
        widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
        ax.bar(edges[:-1], counts, width=widths, align="edge", edgecolor="none")
        _marks(ax, spec.get("marks") or {})
        _few_ticks(ax.xaxis)
        if spec.get("logy"):
            ax.set_yscale("log")
        else:
            _integer_ticks(ax.yaxis)
    elif kind == "ci":
        _draw_ci(ax, spec)
        spec = {**spec, "xlabel": spec.get("ylabel", ""), "ylabel": ""}
    elif kind == "bars":
        vals = _floats(spec["values"])
        pos = list(range(len(vals)))[::-1]
        bad = spec.get("bad") or [False] * len(vals)
        ax.barh(pos, [v if math.isfinite(v) else 0.0 for v in vals],
                color=["#c33" if b else "#4a7" for b in bad])
        ax.set_yticks(pos)
        ax.set_yticklabels([plot_text(s) for s in spec["labels"]], fontsize=SMALL)
        for ref in spec.get("ref", ()):
            ax.axvline(float(ref), color="grey", lw=0.8, ls="--")
        if spec.get("logx"):
            ax.set_xscale("log")
    elif kind == "heatmap":
        m = [_floats(row) for row in spec["matrix"]]
        im = ax.imshow(m, aspect="auto", origin="lower", interpolation="nearest", cmap="magma")
        bar = fig.colorbar(im, ax=ax)
        bar.set_label(plot_text(spec.get("clabel", "count")), fontsize=MID)
        if all(v.is_integer() for row in m for v in row):
            _integer_ticks(bar.ax.yaxis)
        _integer_ticks(ax.xaxis)
        _integer_ticks(ax.yaxis)
    ax.set_title(plot_text(spec.get("title", "")), fontsize=BIG)
    ax.set_xlabel(plot_text(spec.get("xlabel", "")), fontsize=MID)
    ax.set_ylabel(plot_text(spec.get("ylabel", "")), fontsize=MID)
    ax.tick_params(labelsize=SMALL)


def _marks(ax, marks: dict) -> None:
    """Labelled vertical lines (zero, the estimate), the axis widened to show them."""
    for i, (label, x) in enumerate(marks.items()):
        ax.axvline(float(x), color=("black", "C3", "C2")[i % 3], lw=1.0, ls="--",
                   label=plot_text(label))
    if marks:
        ax.legend(fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _draw_ci(ax, spec: dict) -> None:
    """Horizontal: long target names read on the y axis. Estimates spanning orders of
    magnitude (a 0.2 stall bias beside a 1e-9 fp32 one) get a symlog axis."""
    est, lo, hi = _floats(spec["estimate"]), _floats(spec["low"]), _floats(spec["high"])
    pos = list(range(len(est)))[::-1]
    err = [[max(e - low, 0.0) for e, low in zip(est, lo)],
           [max(h - e, 0.0) for e, h in zip(est, hi)]]
    ax.errorbar(est, pos, xerr=err, fmt="o", capsize=3)
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_yticks(pos)
    ax.set_yticklabels([plot_text(s) for s in spec.get("labels", pos)], fontsize=SMALL)
    nz = [abs(v) for v in est + lo + hi if v != 0.0 and v == v]
    if nz and max(nz) / min(nz) > 100:
        lt = min(nz)
        ax.set_xscale("symlog", linthresh=lt)
        d0, d1 = math.floor(math.log10(lt)), math.ceil(math.log10(max(nz)))
        step = max(1, math.ceil((d1 - d0) / 2))  # two decades a side at most: labels fit
        # decades from the largest down, leaving out the ones inside the linear band
        # around 0 (their labels would sit on top of "0")
        dec = [10.0 ** d for d in range(d1, d0 - 1, -step) if 10.0 ** d > 2 * lt] or [10.0 ** d1]
        ticks = [-v for v in dec if any(x < 0 for x in est + lo)] + [0.0] + dec[::-1]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:.0e}" if t else "0" for t in ticks], fontsize=SMALL)
    else:
        _few_ticks(ax.xaxis)


def _draw_panels(fig, spec: dict) -> None:
    """Small multiples sharing the x axis (runs) and one legend beside them."""
    panels = spec["panels"]
    x = _floats(spec["x"])
    labels = list(dict.fromkeys(plot_text(k) for p in panels for k in p["series"]))
    cmap = [f"C{i % 10}" for i in range(len(labels))]
    colors = dict(zip(labels, cmap))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        _lines(ax, x, {plot_text(k): v for k, v in panel["series"].items()}, colors)
        ax.set_ylabel(plot_text(panel.get("ylabel", "")), fontsize=SMALL)
        ax.tick_params(labelsize=SMALL)
        _few_ticks(ax.yaxis, 4)
        ax.yaxis.get_offset_text().set_fontsize(SMALL)
        values = [float(v) for ys in panel["series"].values() for v in ys if v != "nan"]
        if panel.get("integer") and values:  # counts: no 0.3 of a failure
            top = max(max(values), 1.0)
            ax.set_ylim(min(min(values), 0.0) - 0.05 * top, top * 1.05)
            _integer_ticks(ax.yaxis)
            ax.yaxis.set_major_formatter("{x:.0f}")
    _xticks(axes[-1], spec, x)
    axes[-1].set_xlabel(plot_text(spec.get("xlabel", "run")), fontsize=MID)
    fig.suptitle(plot_text(spec.get("title", "")), fontsize=BIG)
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    shown = [k for k in labels if k in handles]
    # below the panels: never on the data, never on the title, whatever the labels' length
    fig.legend([handles[k] for k in shown], shown, loc="outside lower center", fontsize=SMALL,
               frameon=False, ncols=_legend_columns(shown))


def _legend_columns(labels: list[str]) -> int:
    return 1 if not labels or max(map(len, labels)) > 45 else 2


def size_of(spec: dict) -> tuple[float, float]:
    """Figure size in inches: wide enough for a legend beside the axes, tall enough for
    one readable row per label."""
    kind = spec.get("kind")
    if kind in ("ci", "bars"):
        n = len(spec.get("estimate", spec.get("values", ())))
        return 7.5, 1.2 + 0.28 * n
    if kind == "panels":
        labels = list(dict.fromkeys(plot_text(k) for p in spec["panels"] for k in p["series"]))
        rows = math.ceil(len(labels) / _legend_columns(labels))
        return 8.0, 1.0 + 1.4 * len(spec["panels"]) + 0.19 * rows
    if kind == "line" and len(spec.get("series", ())) > 1 or kind == "hist" and spec.get("marks"):
        return 7.0, 3.2
    return 5.0, 3.2


def figure(spec: dict):
    """The spec drawn on a matplotlib Figure (no pyplot: no global figure registry)."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=size_of(spec), dpi=DPI, layout="constrained")
    _draw(fig, spec)
    return fig


def render_png(spec: dict, colors: int = 128) -> bytes:
    """One plot spec as PNG bytes, in a palette of `colors` (a third of the bytes of full
    colour; Pillow comes with matplotlib). Octree keeps every line's colour: median cut
    merged a thin blue line into grey."""
    buf = io.BytesIO()
    figure(spec).savefig(buf, format="png")
    try:
        from PIL import Image
    except ImportError:
        return buf.getvalue()
    out = io.BytesIO()
    Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.FASTOCTREE) \
        .save(out, format="PNG")
    return out.getvalue()


def png_data_uri(spec: dict) -> str:
    return "data:image/png;base64," + base64.b64encode(render_png(spec)).decode("ascii")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
