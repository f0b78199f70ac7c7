"""The zoo map under two transformers releases, each in its own venv, and what changed.

  python scripts/zoo_versions.py 5.24.0 5.25.0 --out reports/zoo-5.24.0-5.25.0
  python scripts/zoo_versions.py 5.24.0 5.25.0 --out DIR --keep    # keep the two venvs in DIR

Steps:
  1. for each release, a venv in DIR/venv-<release>: torch first (--torch, as
     scripts/upstream_check.py), then trainprobes' test set pinned by constraints.txt, then
     `transformers==<release>` over it;
  2. the whole map swept in each (scripts/zoo_sweep.py) into DIR/zoo_map-<release>.json;
  3. `trainprobes zoo --diff` of the two, into DIR/diff.md: new and gone model types, newly
     buildable or not, newly leaky / isolated / causal / non-causal cells, findings that came
     or went, other verdict changes (trainprobes.zoo.diff.categorise), each cell as measured.
DIR must not exist yet (nothing someone wrote is replaced). Exit 0 when both maps were made
(whatever changed), 2 when a venv or a sweep could not be made (the log says why).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_check import ROOT, default_torch, make_venv, run  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="a transformers release, e.g. 5.24.0")
    ap.add_argument("after", help="a later transformers release, e.g. 5.25.0")
    ap.add_argument("--out", type=Path, required=True, help="a new folder for the maps, the diff and the log")
    ap.add_argument("--torch", default=default_torch(), help="the torch to install first (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the venvs")
    args = ap.parse_args(argv)
    if args.out.exists():
        ap.error(f"--out {str(args.out)!r} exists; name a new folder")
    args.out.mkdir(parents=True)
    maps, venvs = {}, []
    try:
        with open(args.out / "log.txt", "w") as log:
            for release in (args.before, args.after):
                venvs.append(args.out / f"venv-{release}")
                py = make_venv(venvs[-1], args.torch, True, log)
                if run([py, "-m", "pip", "install", "-q", f"transformers=={release}"], log).returncode:
                    print(f"zoo_versions: transformers=={release} could not be installed (log.txt)", file=sys.stderr)
                    return 2
                maps[release] = args.out / f"zoo_map-{release}.json"
                run([py, ROOT / "scripts" / "zoo_sweep.py", "--moe-first", "--jsonl",
                     args.out / f"rows-{release}.jsonl", "--out", maps[release]], log, cwd=ROOT)
                if not maps[release].is_file():
                    print(f"zoo_versions: the sweep under {release} wrote no map (log.txt)", file=sys.stderr)
                    return 2
            diff = run([py, "-m", "trainprobes", "zoo", "--diff", maps[args.before], maps[args.after]], log)
    finally:
        for venv in venvs * (not args.keep):
            shutil.rmtree(venv, ignore_errors=True)
    (args.out / "diff.md").write_text(f"# The zoo map, transformers {args.before} -> {args.after}\n\n```\n"
                                      f"{diff.stdout.strip()}\n```\n")
    print(f"zoo_versions: {args.out / 'diff.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
