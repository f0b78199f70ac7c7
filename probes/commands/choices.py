"""The choices the commands list in their --help, as plain data: building a parser (every
`trainprobes ... --help`, every run) must not import torch (a second or more) for them.

Each mirrors the table named beside it, which stays the one the probes use;
tests/test_cli.py checks every one equals its source.
"""
from __future__ import annotations

# trainprobes.reference.formats.ROUNDING_MODES
ROUNDING_MODES = ("nearest", "stochastic", "toward_zero")
# trainprobes.numerics.stall.DEFAULT_FORMATS
STALL_FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz",
                 "fp8_e5m2fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn")
# trainprobes.reference.collectives.OPS (and trainprobes.distributed.worker.OPS)
OPS = ("sum", "avg", "max", "min")
# trainprobes.reference.schedules.ALGORITHMS
ALGORITHMS = ("ring", "tree", "halving_doubling", "hierarchical", "sequential", "order", "gloo")
# trainprobes.distributed.worker.COLLECTIVES
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "reduce")
# trainprobes.distributed.inputs.DATA
DATA = {
    "normal": "standard normal values",
    "gradient": "heavy-tailed, gradient-like: Student-t (3 dof) times 1e-3",
    "positive": "same-signed small values: uniform in [0, 1e-3) (bias compounds)",
    "ones": "all ones: the stall pattern (a running sum of ones stalls at 2^(p))",
}

# (name here, module, name there): what tests/test_cli.py compares
SOURCES = (("ROUNDING_MODES", "trainprobes.reference.formats", "ROUNDING_MODES"),
           ("STALL_FORMATS", "trainprobes.numerics.stall", "DEFAULT_FORMATS"),
           ("OPS", "trainprobes.reference.collectives", "OPS"),
           ("OPS", "trainprobes.distributed.worker", "OPS"),
           ("ALGORITHMS", "trainprobes.reference.schedules", "ALGORITHMS"),
           ("COLLECTIVES", "trainprobes.distributed.worker", "COLLECTIVES"),
           ("DATA", "trainprobes.distributed.inputs", "DATA"))
