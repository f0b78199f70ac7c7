"""A confirmed zoo finding measured again (trainprobes.zoo.findings holds the findings; this
module runs their cells, so the findings' data never imports the cells that annotate with it)."""
from __future__ import annotations

from trainprobes.zoo.findings import Finding

__all__ = ["measure", "rerun"]


def measure(f: Finding, seed: int = 0):
    """The finding's cell measured now (a Cell; verdict 'error' where the model cannot be built)."""
    import torch
    from trainprobes.zoo.cells import Cell, batch_cell, isolation_cell, router_cells
    from trainprobes.zoo.shrink import Failure, build
    impl = f.variant.split(",")[0] if f.probe == "isolation" else None
    b = build(f.model_type, attn_implementation=impl, seed=seed)
    if isinstance(b, Failure):
        return Cell(f.model_type, f.probe, f.variant, "error", None, "", f"cannot build: {b.reason}")
    with torch.no_grad():
        if f.probe == "isolation":
            return isolation_cell(f.model_type, b.model, impl, f.variant.split(",")[1], seed)
        if f.probe == "router":
            return router_cells(f.model_type, b.model, seed, modes=(f.variant,))[0]
        if f.probe == "batch":
            return batch_cell(f.model_type, b.model, seed)
    raise NotImplementedError(f"a {f.probe} finding cannot be measured again")


def rerun(f: Finding, seed: int = 0) -> tuple[bool, str]:
    """(reproduced, the cell's verdict and reason now)."""
    c = measure(f, seed)
    return c.verdict == f.verdict, f"{c.verdict}: {c.reason}"
