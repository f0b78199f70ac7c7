"""Write docs/zoo.md's map section from a zoo map: python scripts/zoo_page.py MAP.json docs/zoo.md

Everything in docs/zoo.md from the line '<!-- map -->' on is replaced by the rendered map."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trainprobes.zoo.page import render


def main() -> int:
    m = json.loads(Path(sys.argv[1]).read_text())
    page = Path(sys.argv[2])
    head = page.read_text().split("<!-- map -->")[0] if page.exists() else ""
    page.write_text(head + "<!-- map -->\n\n" + render(m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
