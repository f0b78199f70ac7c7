"""Text from a Result (a target, a probe, a message, a waiver's reason) made safe for the
formats reports are written in: one helper per format, for every face.

    md_text(s)                 GitHub-flavoured Markdown, inline: shows s as it is
    md_code(s, table=False)    the same as a code span (monospace)
    html_text(s)               HTML text or a quoted attribute value
    plot_text(s)               a matplotlib label, title or legend entry
    plain_text(s)              a terminal or a CI log: one line, control characters shown

A target is whatever the user named it, and a report lands in a job summary, a PR comment
or a browser: `</td><script>`, `| col |`, a backtick or a newline in a name must show as
written, never end a table cell, open a tag or a link, or start a new line (a heading).
A floor module: it imports nothing from trainprobes.
"""
from __future__ import annotations

import html
import re

__all__ = ["md_text", "md_code", "html_text", "plot_text", "plain_text"]

# CommonMark 0.31 (spec.commonmark.org), GFM tables and strikethrough. Escaped, since any
# ASCII punctuation may take a backslash (section 2.4):
#   \ ` * ~   escapes, code spans, emphasis, strikethrough;
#   < &       raw HTML and autolinks (6.6, 6.5), entities (2.5): unless a space follows,
#             as none of those can begin with one ("p = 0 < alpha" stays as written);
#   |         a table cell's end (GFM 4.10; harmless elsewhere);
#   $         GitHub's math ($...$, $$...$$, $`...`$ in comments and job summaries: LaTeX,
#             so "$\huge{PASSED}$" drew a headline); GitHub's docs escape it as \$;
#   ](        the end of an inline link or image's text (6.3); a reference link needs a
#             definition at the start of a line, which text kept on one line cannot write;
#   _         only where it can open or close emphasis: not between two letters or digits
#             (6.2: intraword _ never does), so metric names such as n_leaks read as written.
_MD_SPECIAL = re.compile(r"[\\`*~|$]|[<&](?!\s)|\](?=\()|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# A line ending (2.1): inline text that held one would start a new block.
_LINE_END = re.compile(r"\r\n|\r|\n")


def _one_line(s) -> str:
    return _LINE_END.sub(" ", str(s))


def md_text(s) -> str:
    """s as Markdown text that shows s (newlines as spaces), in a paragraph, a list item or
    a table cell alike."""
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(), _one_line(s))


def md_code(s, table: bool = False) -> str:
    """s as a code span: a fence of one backtick more than s's longest run of backticks,
    padded with a space where s starts or ends with a backtick (or with spaces, which the
    span would strip). In a table cell (table=True) pipes are escaped: GFM ends the cell at
    a bare one even inside a code span."""
    s = _one_line(s)
    if not s:
        return ""
    fence = "`" * (max(map(len, re.findall("`+", s)), default=0) + 1)
    pad = " " if s[0] == "`" or s[-1] == "`" or (s[0] == s[-1] == " " and s.strip()) else ""
    span = f"{fence}{pad}{s}{pad}{fence}"
    return span.replace("|", "\\|") if table else span


def html_text(s) -> str:
    """s as HTML text, or inside a quoted attribute value (both quote kinds escaped)."""
    return html.escape(str(s), quote=True)


def plot_text(s) -> str:
    """s as matplotlib draws it literally: an unescaped $...$ pair is mathtext, which
    renders a name like a$x$b as math and fails to parse one like $\\frac{$."""
    return str(s).replace("$", "\\$")


# C0 and C1 control characters and DEL: a line ending would start a line of its own (a fake
# "PASSED"), an escape sequence (ESC [ ...) would recolour, move or clear the terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def plain_text(s) -> str:
    """s as one line of a terminal or a CI log, nothing escaped but control characters,
    shown as Python writes them (a newline as \\n, ESC as \\x1b)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(s))
