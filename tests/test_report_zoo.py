"""The zoo map's pages: the HTML page (report style) and the Markdown table show each cell's
verdict with the tone a reader needs (a finding apart from a leak by design), say why a cell
was not measured, escape whatever a reason holds, and count what the headline claims."""
from __future__ import annotations

import re

from trainprobes.report.zoo import render_zoo_html
from trainprobes.zoo.findings import FINDINGS
from trainprobes.zoo.page import columns, render, summary, tone


def _cell(mt, probe, variant, verdict, *, finding=False, expected=None, reason="r", number=None):
    return {"model_type": mt, "probe": probe, "variant": variant, "verdict": verdict, "number": number,
            "what": "w", "reason": reason, "expected": expected, "finding": finding, "seconds": 0.0}


MAP = {"versions": {"transformers": "5.24.0", "torch": "2.13.0", "trainprobes": "x", "python": "3.11"},
       "wall_seconds": 12.0, "peak_rss_mb": 500.0, "rows": {
           "llama": [_cell("llama", "isolation", "sdpa,mask_4d", "isolated", expected="isolated"),
                     _cell("llama", "isolation", "sdpa,position_ids", "leaky", reason="by design: cache"),
                     _cell("llama", "router", "", "n/a")],
           "afmoe": [_cell("afmoe", "isolation", "sdpa,mask_4d", "leaky", finding=True, expected="isolated",
                           reason="</td><script>x</script>", number=0.7),
                     _cell("afmoe", "router", "perturb", "causal", expected="causal"),
                     _cell("afmoe", "batch", "", "error", reason="RuntimeError: boom")],
           "dbrx": [_cell("dbrx", "build", "sdpa", "n/a", reason="meta: AttributeError: rope_theta")]}}


def test_tones_keep_a_finding_apart_from_a_leak_by_design():
    rows = MAP["rows"]
    assert [tone(c) for c in rows["llama"]] == ["good", "design", "na"]
    assert [tone(c) for c in rows["afmoe"]] == ["finding", "good", "error"]
    assert tone(_cell("x", "batch", "", "variant")) == "rounding"
    assert tone(_cell("x", "router", "perturb", "unknown")) == "unknown"


def test_summary_counts_measured_rows_routers_and_findings():
    s = summary(MAP)
    assert s == {"model_types": 3, "measured": 2, "routers": 1, "routers_decided": 1, "findings": 1,
                 "unmeasured": ["dbrx"]}


def test_html_page_marks_each_cell_and_escapes_reasons(html_page):
    text = render_zoo_html(MAP, FINDINGS)
    page = html_page(text)
    assert "script" not in page.tags                    # a reason never opens a tag
    width = 1 + len(columns(MAP["rows"]))
    zoo = [r for r in page.rows if r and r[0] in ("llama", "afmoe", "dbrx")     # the map, not the findings
           and (r[1].startswith("not built") or (len(r) == width and ": " not in r[1]))]
    assert [r[0] for r in zoo] == ["afmoe", "dbrx", "llama"]
    assert zoo[1][1] == "not built: meta: AttributeError: rope_theta"     # one cell says why
    afmoe = re.search(r"<tr><td class='mt'[^>]*>afmoe</td>(.*?)</tr>", text).group(1)
    assert "class='t-finding'" in afmoe and ">LEAK<" in afmoe and "class='t-error'" in afmoe
    assert "design: isolated" in afmoe and "&lt;/td&gt;&lt;script&gt;" in afmoe and "0.7" in afmoe
    llama = re.search(r"<tr><td class='mt'[^>]*>llama</td>(.*?)</tr>", text).group(1)
    assert "class='t-design'" in llama and "class='t-finding'" not in llama
    assert "rope_theta" in page.text and "RuntimeError: boom" in page.text    # why not measured
    assert "5.24.0" in page.text and "afmoe_packed_position_ids.py" in " ".join(page.code)
    # every finding shows its versions; a fixed one says where and how
    assert "measured on transformers 5.24.0 (torch 2.13.0)" in page.text
    assert "fixed upstream in 5.25.0: BertModel._create_attention_masks" in page.text


def test_markdown_table_bolds_findings_and_lists_unmeasured_cells():
    md = render(MAP)
    afmoe = next(ln for ln in md.splitlines() if ln.startswith("| afmoe"))
    assert "**LEAK**" in afmoe and "err" in afmoe
    llama = next(ln for ln in md.splitlines() if ln.startswith("| llama"))
    assert "leak" in llama and "**" not in llama
    assert "`dbrx` build sdpa: meta: AttributeError: rope\\_theta" in md or "rope_theta" in md
    assert "transformers 5.24.0" in md and "1 cells contradicting the design" in md
