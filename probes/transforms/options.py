"""The probe's statistical options on a command line: one definition for `trainprobes
transforms` and the torchrun entry (trainprobes.transforms.torchrun)."""
from __future__ import annotations

import argparse

from trainprobes.validation import parse_int, parse_number


def add_probe_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=parse_int("trials", min=4), default=16,
                   help="seeded batches (default 16)")
    p.add_argument("--seed", type=parse_int("seed", min=0), default=0, help="(default 0)")
    p.add_argument("--alpha", type=parse_number("alpha", min=0, max=1, min_open=True, max_open=True),
                   default=0.01, help="false-positive rate of a verdict (default 0.01)")
    p.add_argument("--min-effect", type=parse_number("min-effect", min=0), default=1e-6,
                   help="smallest relative scale error called biased (default 1e-6)")
    p.add_argument("--noise-tol", type=parse_number("noise-tol", min=0, min_open=True), default=None,
                   help="largest relative error called rounding noise (default: by dtype)")
