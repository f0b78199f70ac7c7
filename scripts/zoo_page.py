"""Write docs/zoo.md's map section and the HTML page from a zoo map:

  python scripts/zoo_page.py docs/zoo_map.json docs/zoo.md docs/zoo.html

Everything in the Markdown page from the line '<!-- map -->' on is replaced by the rendered
map; the HTML page (report style, one file, no script) is written whole, only where it is new
or --force is given (never someone else's file)."""
from __future__ import annotations

import argparse
from pathlib import Path

from trainprobes.errors import InvalidArgument
from trainprobes.report.zoo import render_zoo_html
from trainprobes.zoo.diff import load_map
from trainprobes.zoo.findings import FINDINGS
from trainprobes.zoo.page import render


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("map")
    p.add_argument("markdown")
    p.add_argument("html", nargs="?")
    p.add_argument("--force", action="store_true", help="replace an existing HTML page")
    a = p.parse_args()
    m = load_map(a.map)
    page = Path(a.markdown)
    head = page.read_text().split("<!-- map -->")[0] if page.exists() else ""
    page.write_text(head + "<!-- map -->\n\n" + render(m))
    if a.html:
        out = Path(a.html)
        if out.exists() and not a.force:
            raise InvalidArgument(f"{out} exists; pass --force to replace it")
        out.write_text(render_zoo_html(m, FINDINGS))
    return 0


if __name__ == "__main__":
    from trainprobes.exits import guarded
    raise SystemExit(guarded("zoo_page", main))
