"""The picture of a localisation (trainprobes.drift.stage_plot, drawn by
trainprobes.report.stage_figure): the numbers drawn are the Result's numbers, every stage is
drawn, exact zeros sit on the "0" strip and nowhere else, the log-probs row is in nats on its
own axis, and the part that explains the drift (a stage, or a temperature with no stage of
its own) is highlighted with its share."""
import io
import math

import pytest
from trainprobes.drift.stage_plot import stage_plot

MARGIN = 8.0


def _row(name, role, own, free, floor, verdict):
    return {"name": name, "role": role, "own_error": own, "free_error": free, "noise_floor": floor,
            "verdict": verdict}


# a bf16 MLP in block 1: exact before it, carried after it (own 0, free > 0), lm_head and the
# logits after it differ, the log-prob function's own part is noise
NUMERIC = [_row("model.embed_tokens", "embedding", 0.0, 0.0, 4e-8, "exact"),
           _row("model.layers.0", "block", 0.0, 0.0, 8e-8, "exact"),
           _row("model.layers.1", "block", 2.6e-4, 2.6e-4, 8e-8, "beyond"),
           _row("into model.norm", "hand_off", 0.0, 2.55e-4, 8e-8, "exact"),
           _row("model.norm", "norm", 0.0, 2.48e-4, 6.6e-8, "exact"),
           _row("lm_head", "lm_head", 0.0, 2.5e-4, 8.8e-8, "exact"),
           _row("after lm_head", "post_processing", 0.0, 2.5e-4, 1.2e-7, "exact"),
           _row("log-probs", "logprobs", 0.0, 9.1e-3, 2.4e-7, "exact")]
NUMERIC_SHARES = {"weights": (0.0, 0.0, 0.0), "routing": (0.0, 0.0, 0.0), "temperature": (0.0, 0.0, 0.0),
                  "renormalisation": (0.0, 0.0, 0.0), "numerics": (1.0, 0.98, 1.02),
                  "unexplained": (0.0, -0.02, 0.02), "numerics[model.layers.1]": (1.0, 0.98, 1.02)}
# a temperature applied twice by the engine: no stage differs, the whole drift is in the
# log-probs row's free value
TEMPERATURE = [dict(r, own_error=0.0, free_error=0.0, verdict="exact") for r in NUMERIC[:-1]] + \
              [_row("log-probs", "logprobs", 2.2e-7, 0.31, 1.8e-7, "noise")]
TEMPERATURE_SHARES = dict(NUMERIC_SHARES, numerics=(0.0, 0.0, 0.0), temperature=(1.0, 0.99, 1.01),
                          unexplained=(-1e-7, -1e-6, 1e-6))
del TEMPERATURE_SHARES["numerics[model.layers.1]"]


def _shares(d):
    return {k: {"share": s, "ci_low": lo, "ci_high": hi} for k, (s, lo, hi) in d.items()}


def _numeric():
    return stage_plot(NUMERIC, MARGIN, "numeric: x", shares=_shares(NUMERIC_SHARES), kind="numeric",
                      explained_by="model.layers.1")


def _temperature():
    return stage_plot(TEMPERATURE, MARGIN, "temperature: x", shares=_shares(TEMPERATURE_SHARES),
                      kind="temperature")


def test_spec_carries_every_stage_with_the_results_values():
    s = _numeric()
    assert s["kind"] == "stages" and len(s["stages"]) == len(NUMERIC)
    for row, st in zip(s["stages"], NUMERIC):
        assert (row["name"], row["own"], row["free"], row["floor"]) == \
            (st["name"], st["own_error"], st["free_error"], st["noise_floor"])
        assert row["high"] == st["noise_floor"] * MARGIN
    assert [r["unit"] for r in s["stages"]] == ["relative"] * 7 + ["nats"]
    assert [r["label"] for r in s["stages"]][:3] == ["embed_tokens", "layers.0", "layers.1"]
    assert s["explains"] == {"stage": "model.layers.1", "part": "numerics[model.layers.1]", "share": 1.0}
    # numerics split by stage; the total is not drawn twice
    assert [p["label"] for p in s["shares"]] == ["weights", "routing", "temperature", "renormalisation",
                                                 "numerics: layers.1", "unexplained"]


def test_whole_model_part_is_highlighted_where_it_shows():
    s = _temperature()
    assert s["explains"] == {"stage": "log-probs", "part": "temperature", "share": 1.0}
    # a rescale in the forward that is beyond noise after lm_head shows there instead
    post = [dict(r, verdict="beyond", own_error=0.1) if r["role"] == "post_processing" else r for r in TEMPERATURE]
    assert stage_plot(post, MARGIN, "t", shares=_shares(TEMPERATURE_SHARES), kind="temperature")["explains"][
        "stage"] == "after lm_head"
    # an engine's log-softmax in bf16: numeric at the log-probs row, which is shaded
    mode = NUMERIC[:-1] + [_row("log-probs", "logprobs", 9e-3, 9e-3, 2.4e-7, "beyond")]
    shares = dict(NUMERIC_SHARES, **{"numerics[log-probs]": (1.0, 0.99, 1.01)})
    del shares["numerics[model.layers.1]"]
    s = stage_plot(mode, MARGIN, "t", shares=_shares(shares), kind="numeric", explained_by="log-probs")
    assert s["explains"] == {"stage": "log-probs", "part": "numerics[log-probs]", "share": 1.0}
    for kind in ("exact", "noise"):  # nothing explains what is not a finding
        assert stage_plot(NUMERIC, MARGIN, "t", shares=_shares(NUMERIC_SHARES), kind=kind)["explains"]["stage"] is None


def test_from_dumps_no_own_error_no_shares():
    dumps = [{"name": r["name"], "free_error": r["free_error"], "noise_floor": r["noise_floor"],
              "divergent": r["free_error"] > MARGIN * r["noise_floor"]} for r in NUMERIC[:5]]
    s = stage_plot(dumps, MARGIN, "t")
    assert [r["own"] for r in s["stages"]] == [None] * 5 and s["shares"] == []
    assert s["explains"]["stage"] == "model.layers.1" and s["highlight"] == "first divergent stage"
    fig = _drawn(s)
    assert len(fig.axes) == 2  # no nats row, no shares
    assert _points(fig.axes[1], "free") == [(2.48e-4, 4), (2.55e-4, 3), (2.6e-4, 2)]
    assert _points(fig.axes[0], "free-zero") == [(0.0, 0), (0.0, 1)] and not _points(fig.axes[1], "own")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "free-running error (all before it too)", "noise floor .. x8", "first divergent stage"]
    assert stage_plot([], MARGIN, "t") is None


def test_title_names_factories_not_their_import_paths():
    s = stage_plot(NUMERIC, MARGIN, "numeric: pkg.mod:trainer vs pkg.mod:engine")
    assert s["title"] == "numeric: trainer vs engine"
    assert stage_plot(NUMERIC, MARGIN, "noise: demo: x (MoE)")["title"] == "noise: demo: x (MoE)"


# --- drawn --------------------------------------------------------------------------------

def _drawn(spec):
    pytest.importorskip("matplotlib")
    from trainprobes.report.plots import figure
    fig = figure(spec)
    fig.savefig(io.BytesIO(), format="png")  # lays it out
    return fig


def _points(ax, gid):
    return sorted((float(ln.get_xdata()[0]), round(float(ln.get_ydata()[0]))) for ln in ax.lines
                  if ln.get_gid() == gid)


@pytest.mark.parametrize("make", [_numeric, _temperature], ids=["numeric", "temperature"])
def test_drawn_values_are_the_results_and_zeros_sit_on_the_zero_strip(make):
    spec = make()
    rows = spec["stages"]
    fig = _drawn(spec)
    zero, ax, zero_n, ax_n, shares = fig.axes
    rel, nats = rows[:-1], rows[-1:]
    for (z, a, group) in ((zero, ax, rel), (zero_n, ax_n, nats)):
        assert a.get_xscale() == "log" and [t.get_text() for t in z.get_xticklabels()] == ["0"]
        # every stage labelled, in call order
        labels = [t.get_text().split(" \u25c0")[0] for t in z.get_yticklabels()]
        assert labels == [r["label"] + (" (nats)" if r["unit"] == "nats" else "") for r in group]
        for key in ("own", "free"):
            want_log = sorted((r[key], i) for i, r in enumerate(group) if r[key] != 0)
            want_zero = sorted((0.0, i) for i, r in enumerate(group) if r[key] == 0)
            assert _points(a, key) == want_log
            assert _points(z, f"{key}-zero") == want_zero
            assert not _points(a, f"{key}-zero") and not _points(z, key)
        lo, hi = a.get_xlim()
        assert all(lo < x < hi for key in ("own", "free") for x, _ in _points(a, key))
        bands = sorted((p.get_x(), p.get_x() + p.get_width()) for p in a.patches if p.get_gid() == "band")
        want = sorted((r["floor"], r["high"]) for r in group)
        assert [b[0] for b in bands] == [w[0] for w in want]
        assert [b[1] for b in bands] == pytest.approx([w[1] for w in want])
    bars = {p.get_gid(): p for p in shares.patches if p.get_gid()}
    for part in spec["shares"]:
        bar = bars[f"share:{part['key']}"]
        assert bar.get_width() == pytest.approx(part["share"] * 100)
    top = bars[f"share:{spec['explains']['part']}"].get_facecolor()
    assert all(b.get_facecolor() != top for k, b in bars.items() if k != f"share:{spec['explains']['part']}")


def test_nonzero_tail_and_post_processing_are_drawn_not_zeroed():
    """The regression of issue 31: lm_head, the logits after it and a temperature's log-probs
    differ; each is drawn on the log axis at its value."""
    fig = _drawn(_numeric())
    ax, ax_n = fig.axes[1], fig.axes[3]
    assert (2.5e-4, 5) in _points(ax, "free") and (2.5e-4, 6) in _points(ax, "free")
    assert _points(ax_n, "free") == [(9.1e-3, 0)]
    fig = _drawn(_temperature())
    assert _points(fig.axes[3], "free") == [(0.31, 0)] and _points(fig.axes[3], "own") == [(2.2e-7, 0)]
    assert _points(fig.axes[1], "free") == [] and len(_points(fig.axes[0], "free-zero")) == 7


def test_the_explaining_stage_is_shaded_and_labelled_with_its_share():
    fig = _drawn(_numeric())
    zero, ax = fig.axes[:2]
    shaded = [p for p in zero.patches + ax.patches if p.get_gid() == "explains"]
    assert len(shaded) == 2 and all(math.isclose(p.get_y() + p.get_height() / 2, 2) for p in shaded)
    assert zero.get_yticklabels()[2].get_text() == "layers.1 \u25c0 100%"
    fig = _drawn(_temperature())
    assert fig.axes[2].get_yticklabels()[0].get_text() == "log-probs (nats) \u25c0 100%"


# --- from a real localisation ------------------------------------------------------------

@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("name", ["block 2's MLP in bf16", "temperature applied twice by the engine"])
def test_the_plot_of_a_demo_case_draws_its_results_numbers(name):
    pytest.importorskip("transformers")
    from trainprobes.drift.localize_demo import CASES, run_case
    r = run_case(next(c for c in CASES if c.name == name))
    m, spec = r.metrics, r.evidence["plots"][0]
    rows = {row["name"]: row for row in spec["stages"]}
    assert list(rows) == [s["name"] for s in r.evidence["stages"]]  # every stage, in order
    for n, row in rows.items():
        assert (row["own"], row["free"], row["floor"]) == \
            (m[f"own_error[{n}]"], m[f"free_error[{n}]"], m[f"noise_floor[{n}]"])
    # the free column of the last rows is the free-running difference, never the row's own part
    assert rows["log-probs"]["free"] == pytest.approx(m["mean_abs_log_ratio"], rel=1e-12)
    if m["kind"] == "numeric":
        assert rows["lm_head"]["free"] > 1e-4
        assert rows["after lm_head"]["free"] == pytest.approx(rows["lm_head"]["free"], rel=0.05)
        assert spec["explains"] == {"stage": "model.layers.2", "part": "numerics[model.layers.2]",
                                    "share": m["share_numerics[model.layers.2]"]}
    else:
        assert rows["log-probs"]["free"] > 0.1 and rows["lm_head"]["free"] == 0.0
        assert spec["explains"] == {"stage": "log-probs", "part": "temperature", "share": m["share_temperature"]}
    fig = _drawn(spec)
    names = list(rows)
    for key in ("own", "free"):
        drawn = _points(fig.axes[1], key) + _points(fig.axes[3], key)
        zeros = _points(fig.axes[0], f"{key}-zero") + _points(fig.axes[2], f"{key}-zero")
        assert sorted(drawn) == sorted((rows[n][key], i if n != "log-probs" else 0)
                                       for i, n in enumerate(names) if rows[n][key] != 0)
        assert len(zeros) == sum(rows[n][key] == 0 for n in names)


def test_plot_writes_a_grid_three_to_a_row(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image
    from trainprobes.commands.drift_localize import PLOT_COLUMNS, plot, render
    from trainprobes.report.plots import render_png
    from trainprobes.result import Result
    specs = [_numeric(), _temperature(), _numeric(), _temperature()]
    results = [Result("drift.localize", f"t{i}", "fail", metrics={"kind": "numeric"},
                      evidence={"plots": [s], "stages": NUMERIC}) for i, s in enumerate(specs)]
    plot(results, tmp_path / "p.png")
    sheet = Image.open(tmp_path / "p.png")
    sizes = [Image.open(io.BytesIO(render_png(s))).size for s in specs]
    assert PLOT_COLUMNS == 3
    assert sheet.width == sum(w for w, _ in sizes[:3])
    assert sheet.height == max(h for _, h in sizes[:3]) + sizes[3][1]
    # the text table gives the log-probs row its unit
    assert [ln for ln in render(results[:1]).splitlines() if "log-probs" in ln][0].endswith("(nats)")


def test_a_non_finite_error_is_written_not_dropped():
    rows = [dict(r, own_error=math.inf, free_error=math.nan, verdict="beyond") if r["name"] == "model.layers.1" else r
            for r in NUMERIC]
    fig = _drawn(stage_plot(rows, MARGIN, "t", shares=_shares(NUMERIC_SHARES), kind="numeric"))
    texts = {t.get_gid(): t.get_text() for t in fig.axes[1].texts}
    assert texts == {"own-nonfinite": "own inf", "free-nonfinite": "free nan"}
    assert 2 not in [y for _, y in _points(fig.axes[1], "own") + _points(fig.axes[0], "own-zero")]
    assert all(math.isfinite(v) for v in fig.axes[1].get_xlim())
