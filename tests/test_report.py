"""Report writers: JSON round trip, Markdown summary, self-contained HTML with plots."""
import base64
import html.parser
import json
import re

import pytest
from trainprobes.report import append_step_summary, render_html, summary_markdown, write_report
from trainprobes.report.plots import KINDS, render_png
from trainprobes.result import SCHEMA_VERSION, Result, load_results

SPECS = {
    "line": {"kind": "line", "title": "stall", "x": [1, 2, 4], "series": {"fp16": [1, 1, 0.5]},
             "logx": True},
    "hist": {"kind": "hist", "title": "errors", "edges": [-1, 0, 1, 2], "counts": [3, 5, 1]},
    "ci": {"kind": "ci", "title": "bias", "labels": ["ring", "tree"], "estimate": [1e-3, -2e-4],
           "low": [5e-4, -4e-4], "high": [1.5e-3, 0.0]},
    "heatmap": {"kind": "heatmap", "title": "leaks", "matrix": [[0, 1, 1], [0, 0, 1]],
                "xlabel": "cut", "ylabel": "position"},
}


def results():
    return [
        Result("numerics.stall", "sequential_sum[nearest]", "warn", metrics={"stall_point": 2048.0},
               codes=["TP-B2"], message="fp16 stalls at 2048", evidence={"plots": list(SPECS.values())}),
        Result("causality.check", "trainprobes.reference.routing:expert_choice", "fail",
               metrics={"causal": False, "n_leaks": 12}, codes=["TP-C1"], seed=3,
               message="decisions at 12 positions change with the future <script>"),
        Result("drift.compare", "engine pair", "pass", metrics={"mean_log_ratio": 1e-5}),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_each_plot_kind_renders_a_png(kind):
    png = render_png(SPECS[kind])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


@pytest.mark.parametrize("spec,match", [
    ({"kind": "pie"}, r"plot kind='pie' is not one of"),
    ({"kind": "hist", "edges": [0, 1], "counts": [1, 2]}, r"2 edges for 2 counts"),
])
def test_bad_plot_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        render_png(spec)


def test_write_report_writes_three_files_that_round_trip(tmp_path):
    paths = write_report(tmp_path / "r", results(), {"suite": "test", "seconds": 1.5})
    assert sorted(paths) == ["html", "json", "markdown"]
    loaded, meta = load_results(paths["json"])
    fields = ("probe", "target", "verdict", "metrics", "codes", "seed", "message", "evidence")
    assert [[getattr(r, f) for f in fields] for r in loaded] == \
        [[getattr(r, f) for f in fields] for r in results()]
    assert meta["suite"] == "test"
    assert json.loads(paths["json"].read_text())["schema_version"] == SCHEMA_VERSION
    assert not list((tmp_path / "r").glob(".*.tmp"))  # no temp file left behind
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in paths.values())


def test_markdown_summary_lists_findings_first():
    md = summary_markdown(results(), {"seconds": 2.0, "suite": "default"})
    assert "1 pass, 1 warn, 1 fail" in md and "2.0 s" in md
    findings = md.index("**Findings**")
    assert md.index("expert_choice") > findings  # the failure is named under Findings
    assert "`TP-C1` causality leak" in md
    assert "causal=false, n_leaks=12" in md
    assert "| ⚠️ | numerics.stall |" in md


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.scripts, self.links = [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.srcs.append(a.get("src", ""))
        if tag == "script":
            self.scripts += 1
        if tag in ("link", "a") and a.get("href", "").startswith("http"):
            self.links.append(a["href"])


def test_html_is_self_contained_with_embedded_plots():
    page = render_html(results(), {"suite": "default"})
    tags = _Tags()
    tags.feed(page)
    assert len(tags.srcs) == len(SPECS)
    for src in tags.srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    assert tags.scripts == 0 and tags.links == []  # nothing to fetch, nothing to run
    assert "&lt;script&gt;" in page  # messages are escaped


def test_skipped_families_are_named_in_both_summaries():
    meta = {"skipped": {"gloo": "trainprobes.distributed is not installed in this build"}}
    assert "Skipped **gloo**: trainprobes.distributed is not installed" in summary_markdown([], meta)
    assert "skipped gloo</b>: trainprobes.distributed is not installed" in render_html([], meta)


def test_html_survives_a_bad_plot_spec():
    r = Result("numerics.stall", "t", "pass", evidence={"plots": [{"kind": "pie", "title": "x"}]})
    page = render_html([r])
    assert "could not be drawn" in page and "plot kind=" in page


def test_history_plots_appear_in_html():
    page = render_html(results(), {"history_plots": [SPECS["line"]]})
    assert "trends across runs" in page
    assert len(re.findall(r'src="data:image/png', page)) == len(SPECS) + 1


@pytest.mark.parametrize("set_env", [True, False])
def test_step_summary_appended_only_when_set(tmp_path, set_env):
    target = tmp_path / "summary.md"
    target.write_text("earlier step\n")
    env = {"GITHUB_STEP_SUMMARY": str(target)} if set_env else {}
    got = append_step_summary("## trainprobes audit", env=env)
    text = target.read_text()
    if set_env:
        assert got == target and text == "earlier step\n## trainprobes audit\n"
    else:
        assert got is None and text == "earlier step\n"
