"""Plots for reports, drawn from plot specs in a Result's evidence.

A probe (or the audit that runs it) puts `evidence["plots"] = [spec, ...]`; each spec is
plain JSON, so a report can be re-rendered later from report.json alone:
  {"kind": "line", "title", "x": [...], "series": {label: [...]}, "xlabel", "ylabel",
   "logx": bool, "logy": bool, "xticklabels": [...],      flip rate by position
   "xrotation": degrees,                                  (optional) slanted tick labels
   "band": {"label", "low": [...], "high": [...]}}        (optional) a shaded range per x
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
  {"kind": "stages", ...}                                 a localisation's stages and shares
                                                          (trainprobes.drift.stage_plot; drawn by
                                                          trainprobes.report.stage_figure)
Any spec may carry "note": a sentence report.html prints under the picture (what is hidden,
how to read it). matplotlib is imported only here, with the Agg backend; without it
reports have no plots.
"""
from __future__ import annotations

import base64
import io
import math
import os
import re
from dataclasses import dataclass

from trainprobes.display import format_number
from trainprobes.markup import plot_text

KINDS = ("line", "hist", "ci", "heatmap", "bars", "panels", "stages")
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
        turn = spec.get("xrotation", 0)  # long names (module paths) slanted so none overlap
        ax.set_xticklabels([plot_text(s) for s in labels[::step]], fontsize=SMALL, rotation=turn,
                           ha="right" if turn else "center")
    elif all(float(v).is_integer() for v in x):
        _integer_ticks(ax.xaxis)


def _draw(fig, spec: dict) -> None:
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ValueError(f"plot kind={kind!r} is not one of {KINDS}")
    if kind == "panels":
        return _draw_panels(fig, spec)
    if kind == "stages":
        from trainprobes.report.stage_figure import draw_stages
        return draw_stages(fig, spec)
    if kind == "ci":
        return _draw_ci(fig, spec)
    if kind == "hist" and (spec.get("below") or spec.get("above")):
        return _draw_hist_tails(fig, spec)
    ax = fig.add_subplot()
    if kind == "line":
        x = _floats(spec["x"])
        series = _series_merged(spec["series"])
        band = spec.get("band")
        if band:  # under the lines: e.g. a noise floor, what the lines are judged against
            ax.fill_between(x, _floats(band["low"]), _floats(band["high"]), color="0.85", lw=0,
                            label=plot_text(band.get("label", "")), gid="band")
        _lines(ax, x, series)
        if spec.get("logx"):
            ax.set_xscale("log")
        else:
            _xticks(ax, spec, x)
        if spec.get("logy"):
            ax.set_yscale("log")
        if len(series) > 1 or band:  # beside the axes, never over the data
            ax.legend(fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    elif kind == "hist":
        _hist_bulk(ax, spec)
        _marks(ax, spec.get("marks") or {})
        if spec.get("logy"):
            ax.set_yscale("log")
        else:
            _integer_ticks(ax.yaxis)
    elif kind == "bars":
        vals = _floats(spec["values"])
        pos = list(range(len(vals)))[::-1]
        status = spec.get("status") or ["unexpected" if b else "exact"
                                         for b in spec.get("bad") or [False] * len(vals)]
        ax.barh(pos, [v if math.isfinite(v) else 0.0 for v in vals],
                color=[BAR_COLORS[s][0] for s in status], gid="bars")
        ax.set_yticks(pos)
        ax.set_yticklabels([plot_text(s) for s in spec["labels"]], fontsize=SMALL)
        refs = [float(x) for x in spec.get("ref", ())]
        for p, v in zip(pos, vals):  # the value at each bar's end: no bar needs a ruler
            ax.annotate(_apart(v, refs), xy=(v if math.isfinite(v) else 0.0, p), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=SMALL)
        # room inside the axes for the longest value written at a bar's end
        ax.set_xlim(0, max([1.0] + [v for v in vals if math.isfinite(v)]) * 1.25)
        from matplotlib.patches import Patch
        shown = list(dict.fromkeys(status))
        ax.legend(handles=[Patch(color=BAR_COLORS[s][0], label=BAR_COLORS[s][1]) for s in shown],
                  fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
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


def _hist_bulk(ax, spec: dict) -> None:
    edges, counts = _floats(spec["edges"]), _floats(spec["counts"])
    if len(edges) != len(counts) + 1:
        raise ValueError(f"hist spec has {len(edges)} edges for {len(counts)} counts; "
                         "expected one more edge than counts")
    widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
    ax.bar(edges[:-1], counts, width=widths, align="edge", edgecolor="none", gid="bulk")
    _few_ticks(ax.xaxis)


def _draw_hist_tails(fig, spec: dict) -> list:
    """A histogram whose bulk is binned and whose tails are not: the values below the first
    edge and above the last each drawn as one bar over the range they span (x_min to the
    first edge, the last edge to x_max), on panels of their own either side of a broken
    axis, labelled "N beyond". Every value is drawn; none is cut without a word."""
    edges = _floats(spec["edges"])
    below, above = int(spec.get("below") or 0), int(spec.get("above") or 0)
    parts = (["below"] if below else []) + ["bulk"] + (["above"] if above else [])
    axes = fig.subplots(1, len(parts), sharey=True, squeeze=False,
                        gridspec_kw={"width_ratios": [1 if p != "bulk" else 5 for p in parts],
                                     "wspace": 0.02})[0]
    unit = spec.get("xunit", "")
    for ax, part in zip(axes, parts):
        if part == "bulk":
            _hist_bulk(ax, spec)
            _marks(ax, spec.get("marks") or {})
            continue
        n = below if part == "below" else above
        end = edges[0] if part == "below" else edges[-1]
        far = spec.get("x_min" if part == "below" else "x_max")
        far = float(far) if isinstance(far, (int, float)) and math.isfinite(far) and far != end \
            else end + (edges[-1] - edges[0]) * (-0.1 if part == "below" else 0.1)
        a, b = sorted((far, end))
        ax.bar([a], [n], width=[b - a], align="edge", color="C3", edgecolor="none", gid=part)
        ax.set_xlim(a - 0.05 * (b - a), b + 0.05 * (b - a))
        ax.set_xticks([a, b], [_short(a), _short(b)], fontsize=SMALL)
        ax.annotate(f"{n} beyond", xy=(0.5, 1.0), xycoords="axes fraction", ha="center",
                    va="bottom", fontsize=SMALL, color="C3", gid=f"{part}-label")
        ax.set_title(f"{'<' if part == 'below' else '>'} {_short(end)}{unit}", fontsize=SMALL,
                     pad=14)
        ax.spines["right" if part == "below" else "left"].set_visible(False)
        # the broken axis's diagonal marks
        d = dict(marker=[(-1, -1.5), (1, 1.5)], markersize=8, linestyle="none", color="k",
                 mec="k", mew=1, clip_on=False)
        x = 1 if part == "below" else 0
        ax.plot([x, x], [0, 1], transform=ax.transAxes, **d)
        ax.tick_params(labelsize=SMALL)
    bulk = axes[parts.index("bulk")]
    if spec.get("logy"):
        bulk.set_yscale("log")
    else:
        _integer_ticks(bulk.yaxis)
    axes[0].set_ylabel(plot_text(spec.get("ylabel", "")), fontsize=MID)
    bulk.set_xlabel(plot_text(spec.get("xlabel", "")), fontsize=MID)
    bulk.set_title(plot_text(spec.get("title", "")), fontsize=BIG, pad=14)
    bulk.tick_params(labelsize=SMALL)
    return list(axes)


def _marks(ax, marks: dict) -> None:
    """Labelled vertical lines (zero, the estimate), the axis widened to show them."""
    for i, (label, x) in enumerate(marks.items()):
        ax.axvline(float(x), color=("black", "C3", "C2")[i % 3], lw=1.0, ls="--",
                   label=plot_text(label))
    if marks:
        ax.legend(fontsize=SMALL, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


# Row colours by what a row is against its expectation: a control that reproduced is
# calm whatever its verdict (a known-leaky router that leaks is the harness working).
STATUS_COLORS = {"ok": "#2a7a3a", "pass": "#1f5fa8", "warn": "#d08a00", "fail": "#c62828",
                 "missed": "#c62828", "error": "#6a1b9a", None: "#1f5fa8"}
STATUS_WORDS = {"ok": "control reproduced its known verdict", "missed": "control MISSED",
                "pass": "finding: pass", "warn": "finding: warn", "fail": "finding: fail",
                "error": "error"}
# Stall bars: exact, lost what the format's arithmetic predicts (expected), or differs from
# the prediction (red: this machine is not doing the format's arithmetic).
BAR_COLORS = {"exact": ("#2a7a3a", "exact (the true sum, bit for bit)"),
              "rounding": ("#8fc79a", "not exact: rounding error only, no stall"),
              "expected": ("#8c8fb8", "stalls where its format predicts (expected)"),
              "unexpected": ("#c62828", "differs from its format's prediction")}
# Rows within this factor of a panel's largest share its linear axis; smaller ones split off:
# a -23.8% bias and a 1e-7% one cannot both be read on one linear axis.
PANEL_SPAN = 20.0


@dataclass(frozen=True)
class ForestRow:
    index: int          # position in the spec
    label: str
    estimate: float     # scaled for display
    low: float
    high: float
    control: bool
    status: str | None
    expected: str | None

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.estimate, self.low, self.high))

    @property
    def magnitude(self) -> float:
        return max(abs(self.estimate), abs(self.low), abs(self.high)) if self.finite else 0.0


def forest_rows(spec: dict) -> list[ForestRow]:
    """The rows of a "ci" spec, in spec order, values multiplied by spec["scale"] (100 for
    a relative effect shown in %)."""
    scale = float(spec.get("scale", 1.0))
    est, lo, hi = _floats(spec["estimate"]), _floats(spec["low"]), _floats(spec["high"])
    if not len(est) == len(lo) == len(hi):
        raise ValueError(f"ci spec has {len(est)} estimates, {len(lo)} lows and {len(hi)} "
                         "highs; expected one of each per row")
    n = len(est)
    labels = [str(x) for x in spec.get("labels", range(n))]
    control = list(spec.get("control") or [False] * n)
    status = list(spec.get("status") or [None] * n)
    expected = list(spec.get("expected") or [None] * n)
    return [ForestRow(i, labels[i], est[i] * scale, lo[i] * scale, hi[i] * scale,
                      bool(control[i]), status[i], expected[i]) for i in range(n)]


def forest_groups(rows: list[ForestRow], span: float = PANEL_SPAN) -> list[list[ForestRow]]:
    """Rows split into panels of similar magnitude, largest first, each within `span` of
    its largest row (rows exactly 0, or not finite, join the smallest panel); spec order
    within a panel."""
    sized = sorted((r for r in rows if r.magnitude > 0), key=lambda r: -r.magnitude)
    groups: list[list[ForestRow]] = []
    for r in sized:
        if groups and groups[-1][0].magnitude / r.magnitude <= span:
            groups[-1].append(r)
        else:
            groups.append([r])
    rest = [r for r in rows if r.magnitude == 0]
    if rest:
        if groups:
            groups[-1].extend(rest)
        else:
            groups.append(rest)
    return [sorted(g, key=lambda r: r.index) for g in groups]


def _short(v: float) -> str:
    return format_number(v, digits=3)


def _apart(v: float, refs) -> str:
    """v in 3 digits, or as many more as keep it from reading as a reference line's value it
    is not (0.99997 is not "1" beside a bar that is not exact)."""
    text = _short(v)
    for digits in range(4, 18):
        if not any(v != r and text == _short(r) for r in refs):
            break
        text = format_number(v, digits=digits)
    return text


def row_text(r: ForestRow, unit: str = "") -> str:
    """What is written beside a row: its value, its interval, and what it was expected to do."""
    u = unit if unit == "%" else (f" {unit}" if unit else "")
    if not r.finite:
        return f"{_short(r.estimate)}{u} [{_short(r.low)}, {_short(r.high)}] (not drawn: not finite)"
    return f"{_short(r.estimate)}{u} [{_short(r.low)}, {_short(r.high)}]"


def _draw_ci(fig, spec: dict) -> list:
    """A forest plot: one row per estimate with its confidence interval, on a linear axis
    per panel of similar magnitude, the value and interval written beside each row;
    controls as hollow diamonds, findings as filled circles, coloured by what each did
    against its expectation."""
    from matplotlib.lines import Line2D
    rows = forest_rows(spec)
    unit = spec.get("unit", "")
    groups = forest_groups(rows)
    axes = fig.subplots(len(groups), 1, squeeze=False,
                        gridspec_kw={"height_ratios": [max(len(g), 1) + 0.8 for g in groups]})[:, 0]
    for ax, group in zip(axes, groups):
        pos = list(range(len(group)))[::-1]
        for y, r in zip(pos, group):
            if not r.finite:
                continue
            color = STATUS_COLORS.get(r.status, STATUS_COLORS[None])
            ax.errorbar([r.estimate], [y], xerr=[[r.estimate - r.low], [r.high - r.estimate]],
                        fmt="D" if r.control else "o", ms=5, capsize=3, lw=1.4, color=color,
                        mfc="white" if r.control else color, mew=1.4, gid=f"row{r.index}")
        ax.axvline(0.0, color="grey", lw=0.8)
        ax.set_yticks(pos)
        ax.set_yticklabels([plot_text(r.label) for r in group], fontsize=SMALL)
        ax.set_ylim(-0.7, len(group) - 0.3)
        for y, r in zip(pos, group):  # beside the axes: never on a point, never clipped
            ax.annotate(plot_text(row_text(r, unit)), xy=(1.01, y),
                        xycoords=("axes fraction", "data"), va="center", fontsize=SMALL,
                        annotation_clip=False, gid=f"text{r.index}")
        vals = [v for r in group if r.finite for v in (r.low, r.high)] + [0.0]
        lo, hi = min(vals), max(vals)
        pad = 0.06 * (hi - lo) if hi > lo else (abs(hi) or 1.0) * 0.5
        ax.set_xlim(lo - pad, hi + pad)
        _few_ticks(ax.xaxis)
        ax.xaxis.get_offset_text().set_fontsize(SMALL)
        ax.tick_params(labelsize=SMALL)
        if len(groups) > 1:
            top = max(r.magnitude for r in group)
            ax.set_title(f"|value| up to {_short(top)}{'' if unit == '%' else ' '}{unit}".rstrip(),
                         fontsize=SMALL, loc="left")
    label = spec.get("xlabel") or spec.get("ylabel", "")
    axes[-1].set_xlabel(plot_text(f"{label} ({unit})" if unit and unit not in label else label),
                        fontsize=MID)
    fig.suptitle(plot_text(spec.get("title", "")), fontsize=BIG)
    seen = list(dict.fromkeys((r.control, r.status) for r in rows))
    if len(seen) > 1 or any(r.control for r in rows):
        handles = [Line2D([], [], marker="D" if c else "o", ls="none",
                          color=STATUS_COLORS.get(s, STATUS_COLORS[None]),
                          mfc="white" if c else STATUS_COLORS.get(s, STATUS_COLORS[None]),
                          label=STATUS_WORDS.get(s, "control" if c else "finding"))
                   for c, s in seen]
        fig.legend(handles=handles, loc="outside lower center", fontsize=SMALL, frameon=False,
                   ncols=min(3, len(handles)))
    return list(axes)


def _draw_panels(fig, spec: dict) -> None:
    """Small multiples sharing the x axis (runs) and one legend beside them."""
    panels = spec["panels"]
    x = _floats(spec["x"])
    labels = list(dict.fromkeys(plot_text(k) for p in panels for k in p["series"]))
    cmap = [f"C{i % 10}" for i in range(len(labels))]
    colors = dict(zip(labels, cmap))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        series = {plot_text(k): v for k, v in panel["series"].items()}
        _lines(ax, x, series, colors)
        if panel.get("title"):
            ax.set_title(plot_text(panel["title"]), fontsize=SMALL, loc="left")
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
    for ax, panel in zip(axes, panels):
        _direct_labels(ax, x, {plot_text(k): v for k, v in panel["series"].items()}, colors)
    _xticks(axes[-1], spec, x)
    axes[-1].set_xlabel(plot_text(spec.get("xlabel", "run")), fontsize=MID)
    fig.suptitle(plot_text(spec.get("title", "")), fontsize=BIG)
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    shown = [k for k in labels if k in handles]
    # below the panels: never on the data, never on the title, whatever the labels' length
    fig.legend([handles[k] for k in shown], shown, loc="outside lower center", fontsize=SMALL,
               frameon=False, ncols=_legend_columns(shown))


DIRECT_LABEL_CHARS = 34


_BRACKETED = re.compile(r"^(.*?)\[(.*)\](.*)$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")


def _fields(name: str) -> list[str]:
    """all_reduce[bf16,avg,w=2] (control) -> [all_reduce, bf16, avg, w=2, (control)]."""
    m = _BRACKETED.match(name)
    if not m:
        return [name]
    head, inner, tail = m.groups()
    return [head] + inner.split(",") + ([tail.strip()] if tail.strip() else [])


def short_names(names: list[str]) -> dict[str, str]:
    """What tells each name apart from the others beside it: the fields of a bracketed name
    that not every name shares (all_reduce[bf16,avg,...,gradient] -> 'bf16,avg,gradient'),
    with the shortest tail of its head that still tells the names apart
    (trainprobes.reference.routing:top1 -> top1); the names as written where nothing is
    shared."""
    if len(names) < 2:
        return {n: n for n in names}
    fields = [_fields(n) for n in names]
    common = set.intersection(*map(set, fields))
    prefix = os.path.commonprefix([f[0] for f in fields])
    if not common and not any(c in prefix for c in ".:/ "):
        return {n: n for n in names}
    best = {n: n for n in names}
    tails = [lambda h: h]
    if all(_IMPORT_PATH.match(f[0]) for f in fields):  # pkg.mod:fn: its last parts may do
        tails += [lambda h: h.rpartition(":")[2], lambda h: h.rpartition(".")[2]]
    for tail in tails:
        heads = [tail(f[0][max(prefix.rfind(c) for c in ".:/ ") + 1:]) for f in fields]
        out = {n: ",".join(x for x in [h, *f[1:]] if x and x not in common) or n
               for n, h, f in zip(names, heads, fields)}
        if len(set(out.values())) == len(out) and sum(map(len, out.values())) < sum(map(len, best.values())):
            best = out
    # a tail every name shares (" (control)") says nothing beside a line either
    suffix = os.path.commonprefix([v[::-1] for v in best.values()])[::-1]
    cut = suffix.find(" ") if " " in suffix else -1
    if cut >= 0 and all(len(v) > len(suffix) - cut for v in best.values()):
        best = {n: v[:len(v) - (len(suffix) - cut)] for n, v in best.items()}
    return best


def spread(wanted: list[float], gap: float = 0.16, top: float = 1.05) -> list[float]:
    """Label centres (axes fractions) as near their lines' ends as `gap` between them
    allows: pushed up from the lowest, then, past `top`, down from the highest, so a
    crowd at one end never pushes a lone label far from its line."""
    placed: list[float] = []
    for f in wanted:                       # ascending
        placed.append(f if not placed else max(f, placed[-1] + gap))
    for i in range(len(placed) - 1, -1, -1):
        limit = top if i == len(placed) - 1 else placed[i + 1] - gap
        placed[i] = min(placed[i], limit)
    return placed


def _direct_labels(ax, x, series: dict, colors: dict) -> None:
    """Each line's name at its last finite point, right of the axes, in its colour, spread
    apart so no two overlap; lines whose values are equal there share one label."""
    ends: dict = {}
    for label, ys in series.items():
        pts = [(xv, float(y)) for xv, y in zip(x, ys) if y != "nan" and math.isfinite(float(y))]
        if pts:
            ends.setdefault(round(pts[-1][1], 12), []).append(label)
    if not ends:
        return
    lo, hi = ax.get_ylim()
    span = (hi - lo) or 1.0
    placed = spread([(yv - lo) / span for yv in sorted(ends)])
    short = short_names(list(series))
    for (yv, labels), f in zip(sorted(ends.items()), placed):
        names = [short[lab] for lab in labels]
        text = " = ".join(names)
        if len(text) > DIRECT_LABEL_CHARS and len(names) > 1:  # the legend names each
            text = f"{names[0]} = {len(names) - 1} more"
        if len(text) > DIRECT_LABEL_CHARS:   # names differ at either end: keep both
            half = (DIRECT_LABEL_CHARS - 1) // 2
            text = text[:half] + "\u2026" + text[len(text) - (DIRECT_LABEL_CHARS - 1 - half):]
        ax.annotate(text, xy=(1.01, f), xycoords="axes fraction", va="center",
                    fontsize=7, color=colors.get(labels[0], "k"), annotation_clip=False,
                    gid="direct-label")


def _legend_columns(labels: list[str]) -> int:
    return 1 if not labels or max(map(len, labels)) > 45 else 2


def size_of(spec: dict) -> tuple[float, float]:
    """Figure size in inches: wide enough for a legend beside the axes, tall enough for
    one readable row per label."""
    kind = spec.get("kind")
    if kind == "stages":
        from trainprobes.report.stage_figure import size_of_stages
        return size_of_stages(spec)
    if kind == "ci":
        groups = forest_groups(forest_rows(spec))
        return 9.5, 1.3 + 0.28 * len(spec["estimate"]) + 0.45 * len(groups)
    if kind == "bars":
        return 7.5, 1.5 + 0.28 * len(spec["values"])
    if kind == "panels":
        labels = list(dict.fromkeys(plot_text(k) for p in spec["panels"] for k in p["series"]))
        rows = math.ceil(len(labels) / _legend_columns(labels))
        return 10.0, 1.0 + 1.6 * len(spec["panels"]) + 0.19 * rows
    if kind == "hist" and (spec.get("below") or spec.get("above")):
        return 8.0, 3.4
    if kind == "line" and (len(spec.get("series", ())) > 1 or spec.get("band")) or kind == "hist" and spec.get("marks"):
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


def png_sheet(rows: list) -> bytes:
    """Rows of plot specs drawn side by side, the rows stacked: one PNG (a command's --plot)."""
    from PIL import Image
    ims = [[Image.open(io.BytesIO(render_png(s, colors=256))).convert("RGB") for s in row] for row in rows]
    width = max((sum(im.width for im in row) for row in ims), default=1)
    height = sum(max((im.height for im in row), default=0) for row in ims) or 1
    sheet = Image.new("RGB", (width, height), "white")
    y = 0
    for row in ims:  # loop over rows of pictures
        x = 0
        for im in row:
            sheet.paste(im, (x, y))
            x += im.width
        y += max((im.height for im in row), default=0)
    buf = io.BytesIO()
    sheet.save(buf, format="PNG")
    return buf.getvalue()
