"""Redraw the pictures in docs/ from real runs, as a reader gets them (minutes on 2 cores):

    python scripts/doc_pictures.py [--out docs] [--runs 5]

  drift-plot.png    `trainprobes drift --plot` on a heavy-tailed file: 8192 tokens whose
                    inference log-probs sit 0.01 nats above the trainer's with 0.02 of noise,
                    and 20 tokens 1 to 6 nats below (a sampler bug on rare tokens)
  drift-localize.png  `trainprobes drift localize --plot` on the demo's example pair (a tiny
                    Llama whose block 2's MLP runs in bf16): one Result, one figure
  audit-report.png  report.html of `trainprobes audit` (the default suite), at 900 pixels
                    wide, as a browser (headless chromium) draws it
  audit-trends.png  the trends the report draws after `--runs` audits into one --history
                    (the same seed, as a nightly), the same PNGs the page holds, one under
                    the other

Look at each before committing it: every value readable, no point clipped unsaid, nothing
expected in red, units on every axis.
"""
from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def run(*argv: str, cwd: Path) -> None:
    print("$ trainprobes", " ".join(argv), flush=True)
    code = subprocess.run([sys.executable, "-m", "trainprobes", *argv], cwd=cwd).returncode
    if code not in (0, 1):   # 1: a finding, as the heavy-tailed file is meant to give
        raise SystemExit(f"trainprobes {argv[0]} exited {code}")


def heavy_tailed(folder: Path) -> tuple[Path, Path]:
    import numpy as np
    g = np.random.default_rng(0)
    n = 8192
    train = np.log(g.beta(0.35, 1.0, n).clip(1e-6, 1.0))        # peaked: most tokens likely
    infer = train + 0.01 + 0.02 * g.standard_normal(n)
    rare = np.argsort(train)[:400]                               # the sampler bug: rare tokens
    hit = g.choice(rare, 20, replace=False)
    infer[hit] -= g.uniform(1.0, 6.0, 20)
    infer = np.minimum(infer, 0.0)
    paths = folder / "train.npz", folder / "infer.npz"
    np.savez(paths[0], logprobs=train.astype(np.float32))
    np.savez(paths[1], logprobs=infer.astype(np.float32))
    return paths


def screenshot(page: Path, png: Path, width: int = 900, height: int = 1700) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs chromium (apt-get install -y chromium)")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)


def stacked(pngs: list[bytes], path: Path) -> None:
    from PIL import Image
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in pngs]
    sheet = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    y = 0
    for im in images:
        sheet.paste(im, (0, y))
        y += im.height
    sheet.save(path, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None,
                    help="a folder to keep (and reuse: audits run until its history holds "
                         "--runs of them); default: a temporary one")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="trainprobes-pictures-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        train, infer = heavy_tailed(work)
        run("drift", "--train", str(train), "--infer", str(infer), "--plot",
            str(args.out / "drift-plot.png"), "--force", cwd=work)
        run("drift", "localize", "--target", "trainprobes.drift.localize_demo:example_trainer",
            "--engine", "trainprobes.drift.localize_demo:example_engine", "--no-progress", "--plot",
            str(args.out / "drift-localize.png"), "--force", cwd=work)
        from trainprobes.audit.history import read_history, trend_plots
        for _ in range(args.runs - len(read_history(work / "history"))):
            # a nightly: the same suite and seed every night
            run("audit", "--out", "reports", "--history", "history", "--no-progress", cwd=work)
        screenshot(work / "reports" / "latest" / "report.html", args.out / "audit-report.png")

        from trainprobes.report.plots import render_png
        stacked([render_png(s, colors=256) for s in trend_plots(read_history(work / "history"))],
                args.out / "audit-trends.png")
        names = ("drift-plot.png", "drift-localize.png", "audit-report.png", "audit-trends.png")
        print(f"wrote {', '.join(str(args.out / n) for n in names)}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
