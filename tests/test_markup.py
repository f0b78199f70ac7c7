"""trainprobes.markup: any text shows as written through a CommonMark + GFM-table renderer
(markdown-it-py), in a paragraph, a list item and a table cell, and keeps the table's shape;
HTML and plot text likewise."""
from html.parser import HTMLParser

import pytest
from hypothesis import given
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from trainprobes.markup import html_text, md_code, md_text, plot_text

MD = MarkdownIt("commonmark").enable(["table", "strikethrough"])  # raw HTML passes: html=True

NASTY = ["</td><script>alert(1)</script>", "| col |", "`tick`", "``", "a\nb", "a\r\n# heading",
         "[x](javascript:alert(1))", "![i](http://e/i.png)", "<!-- rest", "&lt;b&gt;", "*bold*",
         "_em_", "__init__", "~~gone~~", "a\\|b", "a\\", "\\`", "  spaced  ", "n_leaks", "x<",
         "<\tb>", "<a@b.c>", "<http://e>", "& &amp; &#60;"]
text = st.one_of(st.sampled_from(NASTY), st.text(
    st.characters(whitelist_categories=("L", "N", "P", "S", "Zs"), whitelist_characters="\n\r\t"),
    max_size=30))


class _Cells(HTMLParser):
    """The text of every <td>/<th> by row, every tag seen, and the text of <code>."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows, self.tags, self.code, self._in, self._code = [], [], [], None, False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")
            self._in = tag
        elif tag == "code":
            self.code.append("")
            self._code = True

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._in = None
        elif tag == "code":
            self._code = False

    def handle_data(self, data):
        if self._in:
            self.rows[-1][-1] += data
        if self._code:
            self.code[-1] += data


def parsed(markdown: str) -> _Cells:
    p = _Cells()
    p.feed(MD.render(markdown))
    return p


def one_line(s: str) -> str:
    return s.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def text_of(markdown: str) -> str:
    """All the text a reader sees."""
    class Text(HTMLParser):
        out = ""

        def handle_data(self, data):
            self.out += data
    t = Text(convert_charrefs=True)
    t.feed(MD.render(markdown))
    return t.out.strip("\n")


@given(text)
def test_md_text_shows_any_text_as_written_in_a_paragraph(s):
    md = f"before {md_text(s)} after"
    assert parsed(md).tags == ["p"], s  # no tag, link, code span, emphasis or heading of its own
    assert text_of(md) == f"before {one_line(s)} after"


@given(text)
def test_md_text_in_a_list_item_shows_as_written(s):
    md = f"- **FAIL** {md_text(s)}: end"
    assert parsed(md).tags == ["ul", "li", "strong"], s
    assert text_of(md).strip() == f"FAIL {one_line(s)}: end"


@given(text, text)
def test_a_table_keeps_its_shape_and_every_cell_shows_as_written(a, b):
    table = "| a | b | c |\n|---|---|---|\n" + f"| {md_text(a)} | {md_code(b, table=True)} | z |\n"
    p = parsed(table)
    assert [len(r) for r in p.rows] == [3, 3], (a, b, p.rows)
    assert p.rows[1][0].strip() == one_line(a).strip() and p.rows[1][2] == "z"  # cells trimmed
    assert set(p.tags) <= {"table", "thead", "tbody", "tr", "th", "td", "code"}, p.tags
    assert p.code == ([one_line(b)] if b else [])


@given(text)
def test_md_code_is_one_code_span_of_the_text(s):
    p = parsed(f"x {md_code(s)} y")
    if s:
        assert p.tags == ["p", "code"] and p.code == [one_line(s)], (s, p.tags, p.code)
    else:
        assert md_code(s) == ""


def test_plain_names_stay_readable_in_a_terminal():
    # only what could change the rendering is escaped: metric names, brackets, arrows stay
    for plain in ("n_leaks [1, 2] -> [2, 3] (cut 5)", "p = 0 < alpha = 0.01", "a & b"):
        assert md_text(plain) == plain
    assert md_code("all_reduce[bf16,ring]") == "`all_reduce[bf16,ring]`"
    assert md_code("a`b") == "``a`b``" and md_code("`a") == "`` `a ``"


@pytest.mark.parametrize("s", NASTY)
def test_html_text_leaves_no_tag_and_no_way_out_of_an_attribute(s):
    out = html_text(s)
    assert "<" not in out and ">" not in out and '"' not in out and "'" not in out


def test_plot_text_draws_dollars_literally():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from matplotlib.text import Text
    for s in ("a$x$b", "c$\\frac{$d", "$"):
        t = Text(text=plot_text(s), figure=Figure())
        assert t._preprocess_math(t.get_text()) == (s, False)
