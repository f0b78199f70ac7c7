"""Report writers: JSON round trip, Markdown summary, self-contained HTML with plots, and
the plots themselves (legends beside the data, integer ticks for counts and runs)."""
import base64
import html.parser
import json
import re

import pytest
from trainprobes.report import outline, render_html, summarised_document, summary_markdown, write_report
from trainprobes.report.evidence import LIMIT, dumps, summarise
from trainprobes.report.html import FILTER_JS
from trainprobes.report.plots import KINDS, figure, render_png
from trainprobes.result import SCHEMA_VERSION, Result, load_results

SPECS = {
    "line": {"kind": "line", "title": "flip rate", "x": [0, 1, 2], "series": {"r": [0, 0.5, 1]}},
    "hist": {"kind": "hist", "title": "errors", "edges": [-1, 0, 1, 2], "counts": [3, 5, 1]},
    "ci": {"kind": "ci", "title": "bias", "labels": ["ring", "tree"], "estimate": [1e-3, -2e-4],
           "low": [5e-4, -4e-4], "high": [1.5e-3, 0.0]},
    "heatmap": {"kind": "heatmap", "title": "leaks", "matrix": [[0, 1, 1], [0, 0, 1]],
                "xlabel": "cut", "ylabel": "position"},
    "bars": {"kind": "bars", "title": "stall", "labels": ["fp32 + 1", "fp16 + 1"],
             "values": [1.0, 0.5], "bad": [False, True], "ref": [1.0]},
    "panels": {"kind": "panels", "title": "trends", "x": [1, 2, 3],
               "xticklabels": ["11-28 07:30", "11-29 07:30", "11-30 07:30"],
               "panels": [{"ylabel": "bias", "series": {"a": [1, 2, 3], "b": [0, 0, "nan"]}},
                          {"ylabel": "k3_kl", "series": {"a": [0.1, 0.1, 0.2]}}]},
    "stages": {"kind": "stages", "title": "numeric: x", "margin": 8.0,
               "stages": [{"name": "a", "label": "a", "own": 0.0, "free": 0.0, "floor": 1e-7, "high": 8e-7,
                           "verdict": "exact", "unit": "relative"},
                          {"name": "b", "label": "b", "own": 3e-4, "free": 3e-4, "floor": 1e-7, "high": 8e-7,
                           "verdict": "beyond", "unit": "relative"},
                          {"name": "log-probs", "label": "log-probs", "own": 0.0, "free": 9e-3, "floor": 2e-7,
                           "high": 1.6e-6, "verdict": "exact", "unit": "nats"}],
               "shares": [{"key": "numerics[b]", "label": "numerics: b", "share": 1.0, "low": 0.9, "high": 1.1}],
               "explains": {"stage": "b", "part": "numerics[b]", "share": 1.0}},
}

EMOJI = re.compile("[\u2600-\u27bf\U0001f300-\U0001faff\ufe0f]")


def results():
    return [
        Result("numerics.stall", "sequential_sum[nearest]", "warn", metrics={"stall_point": 2048.0},
               codes=["TP-B2"], message="fp16 stalls at 2048", expected="warn",
               evidence={"plots": [SPECS["bars"]]}),
        Result("causality.check", "trainprobes.reference.routing:expert_choice", "fail",
               metrics={"causal": False, "n_leaks": 12}, codes=["TP-C1"], seed=3, expected="fail",
               message="decisions at 12 positions change with the future <script>"),
        Result("causality.check", "mypkg.router:route", "fail", metrics={"causal": False},
               codes=["TP-C1"], seed=0, message="a real leak in the user's router",
               evidence={"plots": [SPECS["heatmap"], SPECS["line"]]}),
        Result("drift.compare", "engine pair", "pass", metrics={"mean_log_ratio": 1e-5}),
        Result("numerics.reveal", "torch.sum[fp16,cpu]", "warn", codes=["TP-B3"],
               message="watch out: 10 bits", evidence={"plots": [SPECS["hist"]]}),
    ]


# --- plots -------------------------------------------------------------------------------

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


def _renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _boxes(fig, labels):
    r = _renderer(fig)
    return [t.get_window_extent(r) for t in labels if t.get_text() and t.get_visible()]


def test_histogram_tick_labels_do_not_overlap():
    # was: the bf16 tree all-reduce's x labels (-0.00025, -0.0002, ...) ran into each
    # other; these are that histogram's bins and counts from the default suite
    edges = [-0.0002692937309617232 + i * 1.4113300426277497e-05 for i in range(25)]
    counts = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 1, 2, 3, 1, 1, 2, 0, 0, 2]
    fig = figure({"kind": "hist", "title": "signed relative error per trial", "edges": edges,
                  "counts": counts, "xlabel": "signed relative error", "ylabel": "trials"})
    ax = fig.axes[0]
    boxes = _boxes(fig, ax.get_xticklabels())
    assert len(boxes) >= 3
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), [b.bounds for b in boxes]
    assert all(float(t).is_integer() for t in ax.get_yticks())  # counts of trials


def test_ci_tick_labels_on_a_symlog_axis_do_not_overlap():
    # was: -1e+00-1e-02-1e-04-1e-06 0 1e-06 ... run together under the drift CI plot
    fig = figure({"kind": "ci", "labels": list("abcdefg"),
                  "estimate": [-3e-8, 1e-7, 0.0, 0.084, -2e-6, 0.085, 3e-5],
                  "low": [-2e-7, -1e-6, 0.0, 0.036, -4e-6, 0.081, -2e-4],
                  "high": [1e-7, 1e-6, 0.0, 0.131, 0.0, 0.089, 2e-4], "ylabel": "mean_log_ratio"})
    boxes = _boxes(fig, fig.axes[0].get_xticklabels())
    assert len(boxes) >= 3
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), [b.bounds for b in boxes]


def test_heatmap_colour_bar_is_labelled_with_integer_ticks():
    # was: no label, and ticks at 0.25 for counts of leaks
    fig = figure({"kind": "heatmap", "title": "leaks", "matrix": [[0, 1], [2, 1]],
                  "clabel": "leaks (count)"})
    bar = fig.axes[1]
    assert bar.get_ylabel() == "leaks (count)"
    assert all(float(t).is_integer() for t in bar.get_yticks())


def test_line_legend_sits_beside_the_axes_not_on_the_data():
    fig = figure({"kind": "line", "x": [1, 2, 3], "series": {f"s{i}": [i, i, i] for i in range(5)}})
    ax = fig.axes[0]
    r = _renderer(fig)
    assert ax.get_legend().get_window_extent(r).x0 >= ax.get_window_extent(r).x1


def test_identical_series_are_drawn_once_and_labelled_together():
    # was: tf32 sat exactly under fp16 in the stall plot and could not be seen
    fig = figure({"kind": "line", "x": [1, 2], "series": {"fp16": [1, 2], "tf32": [1, 2],
                                                          "bf16": [1, 1]}})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["fp16 = tf32", "bf16"]


def test_trend_panels_have_integer_runs_dates_and_one_legend_outside():
    # was: runs on a 0.0 - 1.0 axis, the legend covering max_ulp_error's whole plot
    fig = figure(SPECS["panels"])
    axes = [a for a in fig.axes]
    assert len(axes) == 2
    assert [t.get_text() for t in axes[-1].get_xticklabels()] == SPECS["panels"]["xticklabels"]
    assert list(axes[-1].get_xticks()) == [1, 2, 3]
    r = _renderer(fig)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b"]
    box, title = legend.get_window_extent(r), fig._suptitle.get_window_extent(r)
    assert not any(box.overlaps(a.get_window_extent(r)) for a in axes) and not box.overlaps(title)
    assert title.x0 >= 0 and title.x1 <= fig.bbox.width  # was: cut off at the left


def test_count_panels_have_integer_ticks_even_when_every_run_had_none():
    # was: "problems per run" at zero drew ticks at -0.04 ... 0.04
    fig = figure({**SPECS["panels"], "panels": [{"ylabel": "results", "integer": True,
                                                 "series": {"errors": [0, 0, 0]}}]})
    _renderer(fig)
    ticks = fig.axes[0].get_yticks()
    assert all(float(t).is_integer() for t in ticks) and 0 in ticks and 1 in ticks


# --- outline -------------------------------------------------------------------------------

def test_outline_ranks_problems_first_and_counts_controls_per_family():
    rs = results() + [Result("causality.check", "known leaky, missed", "pass", expected="fail"),
                      Result("drift.compare", "broken", "error", codes=["TP-E1"])]
    assert [r.target for r in outline.findings(rs)] == [
        "broken", "mypkg.router:route", "torch.sum[fp16,cpu]", "engine pair"]
    cal = {f.family: f for f in outline.calibration(rs)}
    assert cal["causality.check"].line() == ("causality.check: 1 of 2 controls reproduced; "
                                             "missed: known leaky, missed")
    assert cal["numerics.stall"].line() == "numerics.stall: 1 of 1 control reproduced"
    assert outline.headline(rs) == ("findings: 1 pass, 1 warn, 1 fail, 1 error; "
                                    "calibration: 2 of 3 controls reproduced")
    assert [outline.badge(r).text for r in rs[:3]] == ["OK", "OK", "FAIL"]
    assert outline.badge(rs[5]).text == "MISSED"


# --- evidence ------------------------------------------------------------------------------

def test_evidence_is_summarised_with_lengths_recorded_and_plots_kept_whole():
    ev = {"leaks": [{"position": i} for i in range(1000)], "n": 3,
          "nested": {"cuts": list(range(100))}, "plots": [{"kind": "line", "x": list(range(500))}]}
    out = summarise(ev)
    assert len(out["leaks"]) == LIMIT and out["leaks"][0] == {"position": 0}
    assert out["truncated"] == {"leaks": 1000, "nested.cuts": 100}
    assert len(out["plots"][0]["x"]) == 500 and out["n"] == 3
    assert len(ev["leaks"]) == 1000  # the Result in memory is never cut


def test_dumps_round_trips_with_plain_lists_on_one_line():
    doc = {"a": [[1, 2], [3, 4]], "t": [{"x": 1}], "s": "x", "e": {}, "n": None}
    text = dumps(doc)
    assert json.loads(text) == doc
    assert '  [1, 2],\n' in text and '{"x": 1}' in text


# --- the three files ---------------------------------------------------------------------

def test_write_report_writes_three_files_that_round_trip(tmp_path):
    paths = write_report(tmp_path / "r", results(), {"suite": "test", "seconds": 1.5})
    assert sorted(paths) == ["html", "json", "markdown"]
    loaded, meta = load_results(paths["json"])
    fields = ("probe", "target", "verdict", "metrics", "codes", "seed", "message", "evidence",
              "expected")
    assert [[getattr(r, f) for f in fields] for r in loaded] == \
        [[getattr(r, f) for f in fields] for r in results()]
    assert meta["suite"] == "test"
    assert json.loads(paths["json"].read_text())["schema_version"] == SCHEMA_VERSION
    assert not list((tmp_path / "r").glob(".*.tmp"))  # no temp file left behind
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in paths.values())


def test_report_json_is_the_document_json_prints_and_cuts_long_evidence(tmp_path):
    r = Result("causality.check", "t", "fail", evidence={"leaks": list(range(500))})
    paths = write_report(tmp_path, [r], {"command": "audit", "history_plots": [SPECS["line"]]})
    doc = json.loads(paths["json"].read_text())
    doc.pop("report_seconds")
    assert doc == json.loads(json.dumps(summarised_document([r], {"command": "audit"})))
    assert list(doc)[:2] == ["schema_version", "command"] and list(doc)[-1] == "results"
    assert "history_plots" not in doc  # drawn in report.html only
    assert doc["results"][0]["evidence"]["truncated"] == {"leaks": 500}
    full = write_report(tmp_path / "full", [r], {}, full_evidence=True)
    assert len(json.loads(full["json"].read_text())["results"][0]["evidence"]["leaks"]) == 500


def test_write_report_says_what_it_draws_and_times_the_whole_run(tmp_path):
    import time
    said = []
    started = time.perf_counter() - 5.0
    paths = write_report(tmp_path, results(), {}, progress=said.append, started=started)
    assert said[0] == "drawing 4 plots for report.html"  # the leak map, the flip rate, ...
    assert [s.split(":")[0] for s in said[1:5]] == [f"plot {i}/4" for i in range(1, 5)]
    assert said[-1].startswith("wrote report.json (") and "report.html (" in said[-1]
    assert json.loads(paths["json"].read_text())["seconds"] >= 5.0
    shown = re.search(r"wall time</th><td>([0-9.]+) s", paths["html"].read_text())
    assert float(shown.group(1)) >= 5.0


def test_markdown_summary_lists_findings_first_in_words():
    md = summary_markdown(results(), {"seconds": 2.0, "suite": "default"})
    assert "**2 problems**" not in md and "**1 problem**" in md  # the user's leaky router
    assert "findings: 1 pass, 1 warn, 1 fail; calibration: 2 of 2 controls reproduced" in md
    assert md.index("**Findings**") < md.index("mypkg.router:route") < md.index("**Calibration**")
    assert "- **FAIL** causality.check `mypkg.router:route` [`TP-C1` causality leak]" in md
    assert "- OK causality.check: 1 of 1 control reproduced" in md
    assert "| OK | control, known fail | causality.check |" in md
    assert "causal=false, n_leaks=12" in md
    assert not EMOJI.search(md)  # was: emoji verdicts


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.scripts, self.links, self.ids = [], [], [], []
        self.data: list[dict] = []      # the data-* attributes of each filterable element
        self._script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.srcs.append(a.get("src", ""))
        if tag == "script":
            self.scripts.append("")
            self._script = True
        if "data-family" in a:
            self.data.append({k[5:]: v for k, v in a.items() if k.startswith("data-")}
                             | ({"hidden": True} if "hidden" in a else {}))
        if tag in ("link", "a") and a.get("href", "").startswith("http"):
            self.links.append(a["href"])
        if tag == "h2":
            self.ids.append(a.get("id"))

    def handle_endtag(self, tag):
        self._script = self._script and tag != "script"

    def handle_data(self, data):
        if self._script:
            self.scripts[-1] += data


def test_html_opens_with_findings_then_calibration_trends_and_the_table():
    # was: a table in run order first, trends after it, then "All results" repeating it all
    rs = results()
    page = render_html(rs, {"suite": "default", "history_plots": [SPECS["panels"]]})
    tags = _Tags()
    tags.feed(page)
    assert tags.ids == ["findings", "calibration", "trends"]
    from trainprobes.report.html import _target
    for r in rs:  # one place per Result
        shown = _target(r.target)
        assert page.count(f"<span class='target'>{shown}<") \
            + page.count(f'<span class="target">{shown}<') == 1, r.target
    findings = page[page.index("id='findings'"):page.index("id='calibration'")]
    assert findings.index("a real leak") < findings.index("watch out: 10 bits") \
        < findings.index("engine") < len(findings)
    assert "expert_choice" not in findings  # a reproduced control is not a finding
    assert "1 problem</span>" in page


def test_html_draws_only_what_it_shows_self_contained():
    page = render_html(results(), {"suite": "default"})
    tags = _Tags()
    tags.feed(page)
    # the user's leak (map + flip rate), the reveal warning's histogram, the stall family's
    # bars in calibration; nothing for the reproduced expert_choice control
    assert len(tags.srcs) == 4
    for src in tags.srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    # nothing to fetch; one script, the filter's constant
    assert tags.scripts == [FILTER_JS] and tags.links == []
    assert "&lt;script&gt;" in page  # messages are escaped


def test_html_controls_and_findings_look_different_and_use_words_not_emoji():
    page = render_html(results())
    assert "class='b b-ok'" in page and "b-fail" in page and "card finding v-fail" in page
    assert not EMOJI.search(page)
    assert "seed None" not in page  # was: the deterministic stall card said "seed None"


def test_html_results_table_has_sized_columns_and_targets_that_wrap_between_fields():
    # was: the target column took ~470 px, the message was cut off at 900 px
    r = Result("distributed.collective", "all_reduce[fp32,sum,gloo,w=4,n=4096]", "pass")
    page = render_html([r])
    assert "table-layout:fixed;width:100%" in page and "<colgroup>" in page
    assert "all_reduce[<wbr>fp32,<wbr>sum,<wbr>gloo" in page


def test_skipped_families_and_missing_hardware_are_named():
    meta = {"skipped": {"gloo": "trainprobes.distributed is not installed in this build"},
            "not_here": {"nccl": "no CUDA device"}}
    md, page = summary_markdown([], meta), render_html([], meta)
    assert "Skipped **gloo**: trainprobes.distributed is not installed" in md
    assert "skipped gloo</b>: trainprobes.distributed is not installed" in page
    assert "Not on this machine: nccl (no CUDA device)" in md
    assert "not on this machine: nccl (no CUDA device)" in page


def test_html_survives_a_bad_plot_spec():
    r = Result("numerics.stall", "t", "warn", evidence={"plots": [{"kind": "pie", "title": "x"}]})
    page = render_html([r])
    assert "could not be drawn" in page and "plot kind=" in page


# --- names that hold markup: shown as written, never a tag, a link or a broken table ------

NASTY = ["</td><script>alert(1)</script>", "a | b | c", "`tick` and ``two``", "line\n# heading",
         "[x](javascript:alert(1))", "<!-- the rest", "c$\\frac{$d", "a$x$b"]  # even: controls


def nasty_results():
    """Findings and controls (with CI plots) whose targets, messages and metric names hold
    markup: each name in a target, a message and a waiver-like reason."""
    out = []
    for i, name in enumerate(NASTY):
        control = i % 2 == 0
        out.append(Result("numerics.bias", name, "fail" if i % 3 == 0 else "pass",
                          metrics={"biased": i % 3 == 0, "bias": 1e-3 * i, "ci_low": 0.0,
                                   "ci_high": 1e-2, f"m|{i}": 1.0},
                          codes=["TP-B1"] if i % 3 == 0 else [], seed=i,
                          expected=("fail" if i % 3 == 0 else "pass") if control else None,
                          message=f"said: {name}"))
    return out


def test_summary_markdown_shows_names_with_markup_as_written_in_its_table(html_page):
    from markdown_it import MarkdownIt
    rs = nasty_results()
    md = summary_markdown(rs, {"title": "nightly </h2><script>x</script>", "suite": "a|b"})
    page = html_page(MarkdownIt("commonmark").enable("table").render(md))  # raw HTML would pass
    assert "script" not in page.tags and "a" not in page.tags and "img" not in page.tags
    assert set(page.tags) <= {"h2", "p", "strong", "ul", "li", "code", "table", "thead",
                              "tbody", "tr", "th", "td"}, set(page.tags)
    table = [r for r in page.rows if len(r) == 7]
    assert len(page.rows) == len(rs) + 1 == len(table)  # every row 7 cells: the shape held
    shown = [name.replace("\n", " ") for name in NASTY]
    assert [r[3] for r in table[1:]] == shown and set(shown) <= set(page.code)  # as code
    assert "nightly </h2><script>x</script>" in page.text and "suite: a|b" in page.text
    listed = [r for r in rs if r.verdict == "fail" and not r.is_control]
    assert listed and all(r.message.replace("\n", " ") in page.text for r in listed)


def test_html_report_shows_names_with_markup_as_text_and_draws_every_plot(tmp_path, html_page):
    rs = nasty_results()
    paths = write_report(tmp_path, rs, {"title": "nightly </title><script>x</script>"})
    text = paths["html"].read_text()
    page = html_page(text)
    assert page.tags.count("script") == 1 and FILTER_JS in text  # the filter's, no other
    assert "a" not in page.tags
    assert "could not be drawn" not in text  # a$x$b and c$\frac{$d are not mathtext
    assert page.tags.count("img") >= 1
    assert all(r.target in page.text for r in rs)  # each name shown as written
    assert all(r.message in page.text for r in rs)


def test_each_warn_card_says_what_it_means_and_what_to_do():
    rs = results()
    page = render_html(rs, {"suite": "default"})
    found = page[page.index("id='findings'"):page.index("id='calibration'")]
    card = found[found.index("watch out: 10 bits"):]
    card = card[:card.index("</div>")]
    assert "What TP-B3 means:" in card and "What to do:" in card
    assert outline.ADVICE["TP-B3"].todo.split(" (")[0] in card.replace("&#x27;", "'")


# --- the filter ---------------------------------------------------------------------------

def test_every_result_is_one_filterable_element_with_what_the_filter_reads():
    rs = results() + nasty_results()
    tags = _Tags()
    tags.feed(render_html(rs, {"suite": "default"}))
    assert len(tags.data) == len(rs)                         # one place per Result
    by_words = sorted(d["words"] for d in tags.data)
    assert by_words == sorted(" ".join([r.target, r.probe, *r.codes, r.message]).lower() for r in rs)
    for r in rs:
        d = next(d for d in tags.data if d["words"].startswith(r.target.lower() + " "))
        assert d["kind"] == ("control" if r.is_control else "finding")
        assert d["family"] == outline.family(r)
        assert outline.badge(r).css[2:] in d["show"].split()
        assert ("problem" in d["show"].split()) is outline.is_problem(r)
    # names with markup reach the attributes escaped, never the script
    assert all(name not in FILTER_JS for name in NASTY)


def test_a_page_without_results_has_no_filter():
    page = render_html([])
    assert "id='filter'" not in page and "<script>" not in page


@pytest.mark.slow
@pytest.mark.skipif(not __import__("shutil").which("chromium"), reason="no chromium here")
@pytest.mark.parametrize("fragment, shown", [("show=warn&kind=finding", "warning findings")])
def test_the_filter_hides_what_does_not_match_in_a_browser(tmp_path, fragment, shown):
    """One browser run (seconds): two of the filter's choices at once, set by the link."""
    import subprocess
    rs = results()
    page = tmp_path / "report.html"
    page.write_text(render_html(rs, {"suite": "default"}))
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                          "--dump-dom", f"{page.as_uri()}#{fragment}"],
                         capture_output=True, text=True, timeout=60).stdout
    tags = _Tags()
    tags.feed(dom)
    want = {"every": rs, "problems": [r for r in rs if outline.is_problem(r)],
            "controls": [r for r in rs if r.is_control],
            "warning findings": [r for r in rs if r.verdict == "warn" and not r.is_control],
            "expert": [r for r in rs if "expert" in " ".join([r.target, r.message]).lower()]}[shown]
    visible = [d for d in tags.data if "hidden" not in d]
    words = sorted(" ".join([r.target, r.probe, *r.codes, r.message]).lower() for r in want)
    assert sorted(d["words"] for d in visible) == words
    assert want and (len(want) < len(rs) or shown == "every")


def test_findings_that_say_the_same_thing_share_one_card_with_the_advice_once():
    # was: six batch-variant ops, six cards, the same advice six times
    warn = [Result("isolation.op_map", f"torch.mm[K={k}]", "warn", codes=["TP-I2"],
                   message=f"batch-variant at K={k}") for k in (64, 128, 256)]
    other = Result("numerics.reveal", "torch.sum[fp16]", "warn", codes=["TP-B3"], message="10 bits")
    page = render_html(warn + [other])
    found = page[page.index("id='findings'"):]
    assert found.count("What TP-I2 means:") == 1 and found.count("What TP-B3 means:") == 1
    assert "3 findings of isolation.op_map" in found
    tags = _Tags()
    tags.feed(page)
    assert len(tags.data) == 4                           # still one place per Result
    assert "<code>trainprobes drift</code>" in page      # the advice's commands as code
    assert "`" not in found.split("<script>")[0]
