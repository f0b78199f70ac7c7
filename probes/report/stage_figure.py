"""The "stages" plot spec (trainprobes.drift.stage_plot) drawn: one row per stage, every
stage labelled, in call order from the top.

  | 0 |  log axis: own (filled), free-running (open), band floor .. margin x floor | shares |
  | 0 |  the log-probs row, in nats, on its own log axis                            |        |

A log axis has no zero, so a value that is exactly 0 is drawn on the narrow "0" strip at
the left, never at a made-up small number. The stage that explains the drift is shaded and
its label carries the share; the share panel draws every part with its interval, the largest
one highlighted, so a temperature or a renormalisation (no stage of its own) is as visible as
a stage."""
from __future__ import annotations

import math

from trainprobes.markup import plot_text

SMALL, MID, BIG = 8, 9, 10
OWN, FREE = "#c62828", "#1f5fa8"       # own error (the stage alone), free-running
HIGHLIGHT = "#fde0dc"
OFFSET = 0.18                          # own and free a little apart on a row: never one on the other


def rows_of(spec: dict) -> tuple[list, list]:
    """(relative rows, nats rows) of the spec, in spec order."""
    rel = [r for r in spec["stages"] if r.get("unit") != "nats"]
    return rel, [r for r in spec["stages"] if r.get("unit") == "nats"]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _limits(rows: list) -> tuple[float, float]:
    vals = [v for r in rows for v in (r["own"], r["free"], r["floor"], r["high"]) if _finite(v) and v > 0]
    if not vals:
        return 1e-9, 1.0
    lo, hi = min(vals), max(vals)
    return lo / 3, hi * 3


def _label(r: dict, explains: dict) -> str:
    text = r["label"] + (" (nats)" if r.get("unit") == "nats" else "")
    if r["name"] == explains.get("stage") and explains.get("share") is not None:
        text += f" \u25c0 {explains['share']:.0%}"
    return plot_text(text)


def _stage_axes(zero, ax, rows: list, spec: dict) -> None:
    """One row per stage on a zero strip and a log axis that share y."""
    explains = spec.get("explains") or {}
    ys = list(range(len(rows)))
    for y, r in zip(ys, rows):
        if r["name"] == explains.get("stage"):
            for a in (zero, ax):
                a.axhspan(y - 0.5, y + 0.5, color=HIGHLIGHT, lw=0, zorder=0, gid="explains")
        if _finite(r["floor"]) and r["floor"] > 0:
            ax.barh(y, r["high"] - r["floor"], left=r["floor"], height=0.7, color="0.86", lw=0, zorder=1,
                    gid="band")
        for key, dy, color, filled in (("own", OFFSET, OWN, True), ("free", -OFFSET, FREE, False)):
            v = r[key]
            if v is None:  # from dumps: no patched run, no own error
                continue
            if not _finite(v):  # no place on any axis: said in words at the row's end
                ax.annotate(f"{key} {v}", xy=(0.99, y + dy), xycoords=("axes fraction", "data"), ha="right",
                            va="center", fontsize=SMALL, color=color, gid=f"{key}-nonfinite")
                continue
            target, x = (zero, 0.0) if v == 0 else (ax, v)
            target.plot([x], [y + dy], ls="none", marker="o" if key == "own" else "D", ms=5, color=color,
                        mfc=color if filled else "white", mew=1.3, zorder=3,
                        gid=f"{key}-zero" if v == 0 else key)
    for a in (zero, ax):
        a.set_ylim(len(rows) - 0.5, -0.5)  # call order from the top
        a.tick_params(labelsize=SMALL)
        a.grid(axis="y", color="0.93", lw=0.6, zorder=0)
    ax.set_xscale("log")
    ax.set_xlim(*_limits(rows))
    ax.tick_params(axis="y", left=False, labelleft=False)
    zero.set_xlim(-1, 1)
    zero.set_xticks([0.0], ["0"])
    zero.set_yticks(ys, [_label(r, explains) for r in rows])
    for tick, r in zip(zero.get_yticklabels(), rows):
        if r["name"] == explains.get("stage"):
            tick.set_color(OWN)
            tick.set_fontweight("bold")
        elif r.get("verdict") == "beyond":
            tick.set_fontweight("bold")
    zero.spines["right"].set_visible(False)
    ax.spines["left"].set_linestyle(":")


def _percent(v: float) -> str:
    """A share as written beside its bar: 0 only when it is 0, a rounding residue in full."""
    if v == 0 or not _finite(v):
        return "0" if v == 0 else str(v)
    return f"{v:.0%}" if abs(v) >= 0.005 else f"{v * 100:.2g}%"


def _shares(ax, spec: dict) -> None:
    parts = spec.get("shares") or []
    explains = spec.get("explains") or {}
    ys = list(range(len(parts)))
    for y, p in zip(ys, parts):
        top = p["key"] == explains.get("part")
        ax.barh(y, p["share"] * 100, height=0.6, color=OWN if top else "0.6", gid=f"share:{p['key']}")
        if _finite(p["low"]) and _finite(p["high"]):
            ax.plot([p["low"] * 100, p["high"] * 100], [y, y], color="k", lw=1.0, zorder=3)
        ax.annotate(_percent(p["share"]), xy=(1.02, y),
                    xycoords=("axes fraction", "data"), va="center", fontsize=SMALL, annotation_clip=False,
                    fontweight="bold" if top else "normal", color=OWN if top else "k")
    ax.axvline(0, color="k", lw=0.8)
    vals = [v * 100 for p in parts for v in (p["share"], p["low"], p["high"]) if _finite(v)] + [0.0, 100.0]
    ax.set_xlim(min(vals) - 5, max(vals) + 5)
    ax.set_yticks(ys, [plot_text(p["label"]) for p in parts], fontsize=SMALL)
    ax.set_ylim(len(parts) - 0.5, -0.5)
    ax.set_xlabel("share of the drift, % (interval)", fontsize=MID)
    ax.set_title("what explains the drift", fontsize=MID)
    ax.tick_params(labelsize=SMALL)


def draw_stages(fig, spec: dict) -> list:
    """The spec on fig (constrained layout); returns the axes: zero strip, log axis, then
    the nats row's pair, then the share panel where they exist."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    rel, nats = rows_of(spec)
    groups = [g for g in (rel, nats) if g]
    has_shares = bool(spec.get("shares"))
    gs = fig.add_gridspec(len(groups), 3 if has_shares else 2, height_ratios=[len(g) + 1.2 for g in groups],
                          width_ratios=[0.45, 4.0] + ([2.0] if has_shares else []), wspace=0.02)
    axes = []
    for i, (rows, label) in enumerate(zip(groups, [spec.get("xlabel", ""), spec.get("xlabel_nats", "")]
                                          if rel else [spec.get("xlabel_nats", "")])):
        zero = fig.add_subplot(gs[i, 0])
        ax = fig.add_subplot(gs[i, 1], sharey=zero)
        _stage_axes(zero, ax, rows, spec)
        ax.set_xlabel(plot_text(label), fontsize=MID)
        if i == 0:
            zero.set_title("exact", fontsize=SMALL)
        axes += [zero, ax]
    if has_shares:
        sh = fig.add_subplot(gs[:, 2])
        _shares(sh, spec)
        axes.append(sh)
    fig.suptitle(plot_text(spec.get("title", "")), fontsize=BIG)
    handles = [Line2D([], [], ls="none", marker="o", color=OWN, label="own error (the stage alone)"),
               Line2D([], [], ls="none", marker="D", color=FREE, mfc="white", mew=1.3,
                      label="free-running error (all before it too)"),
               Patch(color="0.86", label=f"noise floor .. x{spec.get('margin', 0):g}"),
               Patch(color=HIGHLIGHT, label=spec.get("highlight", "explains the drift"))]
    if not (spec.get("explains") or {}).get("stage"):
        handles = handles[:-1]
    if not any(r["own"] is not None for r in spec["stages"]):
        handles = handles[1:]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=SMALL, frameon=False)
    return axes


def size_of_stages(spec: dict) -> tuple[float, float]:
    rel, nats = rows_of(spec)
    return 10.0, 1.3 + 0.22 * (len(rel) + len(nats)) + 0.55 * (bool(rel) + bool(nats))
