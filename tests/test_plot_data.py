"""What each plot draws is what its Result says: the matplotlib artists read back.

Every kind of plot the project draws gets its data checked here: the forest plot of
estimates and confidence intervals, the histogram with its tails, the stall bars, the
trend panels, the leak map and the flip-rate line. A point outside its axis, a value written wrong beside its row, a tail left
undrawn or an expected behaviour in red fails a test.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("matplotlib")
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from trainprobes.audit.families import drift_plots, stall_plot  # noqa: E402
from trainprobes.report.html import family_plots  # noqa: E402
from trainprobes.report.plots import BAR_COLORS, STATUS_COLORS, figure, forest_rows, row_text  # noqa: E402
from trainprobes.result import Result  # noqa: E402

# The default audit's bias controls (report.json of `trainprobes audit --quick`): a -23%
# bf16 ring beside a 3e-9 fp32 one, nine decades apart.
BIAS = [("all_reduce[bf16,ring,sum,nearest,w=1024,n=16]", "fail", -0.23104745, -0.32740214, -0.13469276),
        ("all_reduce[bf16,tree,sum,nearest,w=16,n=128]", "pass", -9.1307e-05, -3.6076e-04, 1.7814e-04),
        ("all_reduce[bf16,ring,avg,nearest,w=6,n=128]", "fail", 1.8616e-03, 1.6219e-03, 2.1013e-03),
        ("all_reduce[fp16,ring,avg,nearest,w=8,n=128]", "pass", -2.2092e-05, -5.5063e-05, 1.0879e-05),
        ("all_reduce[fp32,ring,sum,nearest,w=128,n=128]", "pass", -3.1129e-09, -2.0635e-08, 1.4409e-08),
        ("all_reduce[fp8_e4m3fn,ring,sum,nearest,w=32,n=128]", "fail", -0.13307104, -0.14680959, -0.11933249)]


def bias_results(mine_verdict="pass"):
    out = [Result(probe="numerics.bias", target=t, verdict=v, expected=v,
                  metrics={"bias": b, "ci_low": lo, "ci_high": hi}) for t, v, b, lo, hi in BIAS]
    out.append(Result(probe="numerics.bias", target="my_kernel", verdict=mine_verdict,
                      metrics={"bias": 4e-3, "ci_low": 3.5e-3, "ci_high": 4.5e-3}))
    return out


def forest_drawn(fig):
    """{row index: (x, y, low, high, marker, face colour, edge colour, axes)} read back."""
    out = {}
    for ax in fig.axes:
        for c in ax.containers:
            if not isinstance(c, ErrorbarContainer):
                continue
            line, _caps, (bars,) = c.lines
            (x,), (y,) = line.get_xdata(), line.get_ydata()
            (seg,) = bars.get_segments()
            out[int(line.get_gid()[3:])] = dict(
                x=float(x), y=float(y), low=float(seg[0][0]), high=float(seg[1][0]),
                marker=line.get_marker(), face=to_hex(line.get_markerfacecolor()),
                edge=to_hex(line.get_color()), ax=ax)
    return out


def texts(fig, prefix: str) -> dict:
    return {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts
            if (t.get_gid() or "").startswith(prefix)}


def test_forest_draws_every_row_at_its_value_inside_its_axis_with_its_text():
    (spec, ) = family_plots(bias_results())
    fig = figure(spec)
    fig.canvas.draw()
    drawn = forest_drawn(fig)
    rows = forest_rows(spec)
    assert sorted(drawn) == [r.index for r in rows]  # every row drawn, none dropped
    written = texts(fig, "text")
    for r in rows:
        d = drawn[r.index]
        assert d["x"] == pytest.approx(r.estimate) and d["low"] == pytest.approx(r.low) \
            and d["high"] == pytest.approx(r.high)
        lo, hi = d["ax"].get_xlim()
        assert lo < d["low"] <= d["x"] <= d["high"] < hi, (r.label, (lo, hi))  # nothing clipped
        # the interval is visible: at least 1% of its panel's width (a tiny CI is not a dot)
        assert (d["high"] - d["low"]) / (hi - lo) > 0.01, r.label
        assert written[f"text{r.index}"] == row_text(r, "%")
        at = {float(t): lab.get_text() for t, lab in
              zip(d["ax"].get_yticks(), d["ax"].get_yticklabels())}
        assert at[d["y"]] == r.label  # each point on its own row's label
    # the bf16 ring in %: -23.1% [-32.7, -13.5], on a linear axis with room both sides
    ring = drawn[0]
    assert written["text0"] == "-23.1% [-32.7, -13.5]"
    assert ring["ax"].get_xscale() == "linear"
    assert all(ax.get_xscale() == "linear" for ax in fig.axes)
    # the fp32 row (1e-6 %) is not on the same axis as the bf16 ring (-23 %)
    assert drawn[4]["ax"] is not ring["ax"]
    assert "bias (%)" in fig.axes[-1].get_xlabel()


def test_forest_marks_controls_apart_and_a_reproduced_failing_control_is_not_red():
    fig = figure(family_plots(bias_results(mine_verdict="fail"))[0])
    drawn = forest_drawn(fig)
    ring, mine = drawn[0], drawn[len(BIAS)]
    assert ring["marker"] == "D" and ring["face"] == "#ffffff"   # a control: hollow diamond
    assert ring["edge"] == STATUS_COLORS["ok"]                   # known fail, reproduced: calm
    assert mine["marker"] == "o" and mine["edge"] == STATUS_COLORS["fail"]  # the user's: red
    missed = Result(probe="numerics.bias", target="x", verdict="pass", expected="fail",
                    metrics={"bias": -0.2, "ci_low": -0.3, "ci_high": -0.1})
    fig = figure(family_plots([missed] + bias_results()[:1])[0])
    assert forest_drawn(fig)[0]["edge"] == STATUS_COLORS["missed"]


def test_forest_writes_a_non_finite_row_instead_of_dropping_it():
    spec = {"kind": "ci", "labels": ["a", "b"], "estimate": [0.1, float("nan")],
            "low": [0.05, float("nan")], "high": [0.15, float("nan")], "unit": "nats/token"}
    fig = figure(spec)
    assert sorted(forest_drawn(fig)) == [0]
    assert "not drawn: not finite" in texts(fig, "text")["text1"]


def test_histogram_draws_every_token_tails_included():
    # 20 outliers among 8192 tokens behind a HEAVY-TAILED verdict: all 20 must be drawn
    from trainprobes.drift import compare
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(64, 128, generator=g, dtype=torch.float64) * 4 - 0.05
    infer = (train + 0.01 + 0.02 * torch.randn(64, 128, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    flat = infer.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:20]
    flat[idx] -= torch.linspace(1.0, 6.0, 20, dtype=torch.float64)
    r = compare(train, infer)
    hist, ci = drift_plots(r)
    fig = figure(hist)
    heights = {}
    for ax in fig.axes:
        for p in ax.patches:
            heights[p.get_gid()] = heights.get(p.get_gid(), 0) + p.get_height()
    assert sum(heights.values()) == r.metrics["n_tokens"]  # every token is in some bar
    assert heights.get("below", 0) == hist["below"] > 0
    assert texts(fig, "below")["below-label"] == f"{hist['below']} beyond"
    tail = next(p for ax in fig.axes for p in ax.patches if p.get_gid() == "below")
    assert tail.get_x() == pytest.approx(-r.metrics["max_abs_log_ratio"])  # to the last token
    # the bias by probability: whiskers are the 99% CI of the mean, not the std
    bars = forest_drawn(figure(ci))
    for i, b in bars.items():
        row = r.evidence["by_probability"][[k for k, x in enumerate(r.evidence["by_probability"])
                                            if x["n"] >= 2][i]]
        half = 2.576 * row["std_log_ratio"] / math.sqrt(row["n"])
        assert b["high"] - b["x"] == pytest.approx(half)


def test_stall_bars_draw_expected_format_stalls_as_expected_not_red():
    from trainprobes.numerics.stall import stall
    r = stall(formats=("fp32", "tf32", "fp16", "bf16"), increments=(1.0,), n=4096)
    spec = stall_plot(r)
    fig = figure(spec)
    ax = fig.axes[0]
    bars = [p for p in ax.patches]
    values = [row["sequential_sum"] / row["true_sum"] for row in r.evidence["rows"]]
    assert [b.get_width() for b in bars] == pytest.approx(values)
    colors = [to_hex(b.get_facecolor()) for b in bars]
    assert BAR_COLORS["unexpected"][0] not in colors  # the formats did what formats do
    assert colors[0] == BAR_COLORS["exact"][0]        # fp32 sums 4096 ones exactly
    assert set(colors[1:]) == {BAR_COLORS["expected"][0]}
    assert ax.get_xlim()[1] > max(values)
    # a row that does not stall where its format predicts is red
    wrong = Result.from_dict(r.to_dict())
    wrong.evidence["rows"][2]["sequential_sum"] = 4096.0
    assert stall_plot(wrong)["status"][2] == "unexpected"


def test_a_sum_within_tolerance_that_is_not_the_true_sum_is_not_called_exact():
    # was: fp32 + 0.001 over 4096 adds drawn green, "exact", labelled "4.096 of 4.096": the
    # sum is 4.09589
    from trainprobes.numerics.stall import stall
    r = stall(formats=("fp32",), increments=(1.0, 0.001), n=4096)
    rows = r.evidence["rows"]
    assert rows[0]["sequential_sum"] == rows[0]["true_sum"] != rows[1]["sequential_sum"]
    spec = stall_plot(r)
    assert spec["status"] == ["exact", "rounding"]
    shown, of = spec["labels"][1].split(": ")[1].split(" of ")
    assert of == "4.096" and shown != of and float(shown) == pytest.approx(rows[1]["sequential_sum"], rel=1e-4)
    ax = figure(spec).axes[0]
    assert [to_hex(b.get_facecolor()) for b in ax.patches] == [BAR_COLORS["exact"][0],
                                                              BAR_COLORS["rounding"][0]]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[1].startswith("not exact")
    ends = [t.get_text() for t in ax.texts]  # the value at each bar's end
    assert ends[0] == "1" and ends[1] != "1" and float(ends[1]) == pytest.approx(4.095885753631592 / 4.096, rel=1e-4)


def test_trend_panels_draw_every_series_given_and_label_each_line():
    spec = {"kind": "panels", "title": "t", "x": [1, 2, 3, 4, 5], "xlabel": "run",
            "panels": [{"ylabel": "nats/token", "title": "mean_log_ratio",
                        "series": {"mine": [0.1, 0.2, 0.3, 0.2, 0.1],
                                   "ctl (control)": [0.0, 0.0, 0.0, 0.0, 0.0],
                                   "other (control)": [0.0, 0.0, 0.0, 0.0, 0.0]}}]}
    fig = figure(spec)
    ax = fig.axes[0]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert set(lines) == set(spec["panels"][0]["series"])
    for k, ys in spec["panels"][0]["series"].items():
        assert lines[k] == pytest.approx(ys)
    labels = sorted(t.get_text() for t in ax.texts if t.get_gid() == "direct-label")
    assert labels == ["ctl (control) = other (control)", "mine"]
    assert ax.get_ylabel() == "nats/token" and ax.get_title(loc="left") == "mean_log_ratio"
    lo, hi = ax.get_ylim()
    assert all(lo <= y <= hi for ys in lines.values() for y in ys)


def test_direct_labels_say_what_tells_each_line_apart_never_a_cut_name():
    # was: eight 'all_reduce[bf16,avg,gloo,alg=gloo...' labels cut at 34 characters
    from trainprobes.report.plots import short_names
    names = [f"all_reduce[{d},{op},gloo,alg=gloo,w=2,n=4096,{data},seed=0]"
             for d in ("bf16", "fp16") for op in ("sum", "avg") for data in ("gradient", "positive")]
    short = short_names(names)
    assert short[names[0]] == "bf16,sum,gradient" and len(set(short.values())) == len(names)
    mixed = ["torch.sum[fp16,cpu]", "emulated all_reduce[bf16,ring] (control)"]
    assert short_names(mixed) == {n: n for n in mixed}       # nothing shared: as written
    assert short_names(["pkg.routing:top1", "pkg.routing:expert_choice"]) == {
        "pkg.routing:top1": "top1", "pkg.routing:expert_choice": "expert_choice"}
    spec = {"kind": "panels", "title": "t", "x": [1, 2, 3], "xlabel": "run",
            "panels": [{"ylabel": "ulp", "title": "largest error",
                        "series": {n: [0.5, 0.5, 0.5] for n in names}}]}
    ax = figure(spec).axes[0]
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "direct-label"]
    assert labels == ["bf16,sum,gradient = 7 more"]          # equal lines: one label, counted
    assert len(ax.get_lines()) == len(names)                  # every series still drawn


def test_labels_stay_beside_their_lines_when_others_crowd_one_end():
    # was: five labels near 0 pushed every label down, the two far below fell under the axes
    from trainprobes.report.plots import spread
    placed = spread([0.0, 0.9, 0.95, 0.96, 1.0])
    assert placed[0] == 0.0                                  # the lone one where its line ends
    assert placed[1:] == pytest.approx([0.57, 0.73, 0.89, 1.05])  # the crowd below the top
    assert all(b - a >= 0.16 - 1e-9 for a, b in zip(placed, placed[1:]))
    assert placed[-1] <= 1.05


def test_short_names_of_drift_pairs_and_import_paths():
    from trainprobes.report.plots import short_names
    pairs = ["tinylm: T=0.7 processed logprobs / trainer at T=0.7 (fixed) (control)",
             "tinylm: bf16 infer / bf16 train (control)"]
    # a dot inside T=0.7 is not a module path: never cut there; the shared tail goes
    assert short_names(pairs) == {pairs[0]: "T=0.7 processed logprobs / trainer at T=0.7 (fixed)",
                                  pairs[1]: "bf16 infer / bf16 train"}
    routers = ["trainprobes.reference.routing:capacity_gshard_order[truncate] (control)",
               "trainprobes.reference.models.moe:causal_block[perturb] (control)"]
    assert short_names(routers) == {routers[0]: "capacity_gshard_order,truncate",
                                    routers[1]: "causal_block,perturb"}


def test_trend_units_follow_the_family_a_collectives_bias_is_in_ulps():
    from trainprobes.audit.history import trend_plots
    runs = [{"created": f"2026-11-0{i}T07:30:00", "metrics": {
        "distributed.collective::all_reduce[bf16]::bias": 0.01 * i,
        "numerics.bias::all_reduce[bf16,ring]::bias": -0.2}} for i in (1, 2)]
    units = {p["title"]: [q["ylabel"] for q in p["panels"]] for p in trend_plots(runs)}
    assert units["distributed.collective: bias across runs"] == ["ulp"]
    assert units["numerics.bias: bias across runs"] == ["relative error"]


def _leaky_causality_result():
    from trainprobes.causality import check
    from trainprobes.reference.routing import expert_choice
    x = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(0))
    return check(expert_choice, x, seed=0, decision=0, target="expert_choice")


def test_leak_map_draws_every_leak_the_result_counts_and_the_line_its_rates():
    from trainprobes.audit.families import causality_result
    r = causality_result(_leaky_causality_result(), 32)
    heat, line = r.evidence["plots"]
    counts = r.evidence.get("leak_map")
    fig = figure(heat)
    drawn = fig.axes[0].get_images()[0].get_array()
    assert drawn.tolist() == heat["matrix"]                          # the matrix as drawn
    total = sum(n for _, _, n in counts) if counts else len(r.evidence["leaks"])
    assert int(drawn.sum()) == total > 0                             # no leak left off the map
    assert fig.axes[1].get_ylabel() == "leaks (decisions that changed)"   # the colour bar's unit
    ax = figure(line).axes[0]
    ys = ax.get_lines()[0].get_ydata()
    rates = [math.nan if v == "nan" else v for v in line["series"]["expert_choice"]]
    assert [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(ys, rates)] == [True] * len(rates)
    lo, hi = ax.get_ylim()
    assert all(lo <= y <= hi for y in ys if not math.isnan(y))      # nothing clipped
    assert ax.get_ylabel() == "fraction of compared decisions flipped"
