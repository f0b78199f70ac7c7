"""The per-stage plot spec of a localisation (trainprobes.drift.stage_plot), drawn by
trainprobes.report.plots: free-running and own error on a log axis over the noise-floor band,
exact zeros at the bottom edge."""
import pytest
from trainprobes.drift.stage_plot import stage_plot

ROWS = [{"name": "model.embed_tokens", "free_error": 0.0, "own_error": 0.0, "noise_floor": 4e-8},
        {"name": "model.layers.0", "free_error": 3e-4, "own_error": 3e-4, "noise_floor": 8e-8},
        {"name": "model.layers.1", "free_error": 3.1e-4, "own_error": 0.0, "noise_floor": 8e-8}]


def test_spec_values_band_and_zeros():
    s = stage_plot(ROWS, 8.0, "numeric: x")
    bottom = 4e-9  # a tenth of the smallest positive value (the embedding's floor)
    assert s["logy"] and s["xticklabels"] == ["embed_tokens", "layers.0", "layers.1"]
    assert s["series"]["free-running error"] == pytest.approx([bottom, 3e-4, 3.1e-4])
    assert s["series"]["own error (patched)"] == pytest.approx([bottom, 3e-4, bottom])
    assert s["band"]["low"] == [4e-8, 8e-8, 8e-8] and s["band"]["high"] == pytest.approx([3.2e-7, 6.4e-7, 6.4e-7])
    assert "bottom edge (4e-09)" in s["note"]
    dumps = stage_plot([dict(r, own_error=None) for r in ROWS], 8.0, "t")
    assert list(dumps["series"]) == ["free-running error"]  # from dumps: no patched run
    assert stage_plot([], 8.0, "t") is None


def test_drawn_on_a_log_axis_with_the_band_under_the_lines():
    pytest.importorskip("matplotlib")
    from trainprobes.report.plots import figure
    fig = figure(stage_plot(ROWS, 8.0, "numeric: x"))
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    band = [c for c in ax.collections if c.get_gid() == "band"]
    assert len(band) == 1 and band[0].get_label() == "noise floor .. x8"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}
    assert lines["free-running error"][1:] == [3e-4, 3.1e-4]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["embed_tokens", "layers.0", "layers.1"]
    assert ax.get_xticklabels()[0].get_rotation() == 30
