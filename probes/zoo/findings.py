"""Confirmed zoo findings, kept as controls: each names the cell, the verdict it had when
confirmed, the call (bug or by design) and the library code that causes it, and the
reproduction script. `rerun()` measures the cell again: a library upgrade that changes it
shows as a control no longer reproduced."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finding", "FINDINGS", "rerun"]


@dataclass(frozen=True)
class Finding:
    model_type: str
    probe: str
    variant: str
    verdict: str          # what the probe said when the finding was confirmed
    call: str             # "bug" or "by design"
    cause: str            # library file and function
    why: str
    script: str           # the reproduction, under scripts/zoo_findings/


FINDINGS = (
    Finding("afmoe", "isolation", "sdpa,position_ids_no_cache", "leaky", "bug",
            "transformers/models/afmoe/modeling_afmoe.py: AfmoeModel.forward",
            "mask_kwargs lacks position_ids, so masking_utils never sees the packed position ids "
            "(find_packed_sequence_indices) and the mask stays causal over the whole row",
            "scripts/zoo_findings/afmoe_packed_position_ids.py"),
    Finding("afmoe", "isolation", "eager,position_ids_no_cache", "leaky", "bug",
            "transformers/models/afmoe/modeling_afmoe.py: AfmoeModel.forward",
            "as under sdpa: the mask is built without the position ids",
            "scripts/zoo_findings/afmoe_packed_position_ids.py"),
)


def rerun(f: Finding, seed: int = 0) -> tuple[bool, str]:
    """(reproduced, the cell's verdict and reason now)."""
    import torch
    from trainprobes.zoo.cells import isolation_cell
    from trainprobes.zoo.shrink import Failure, build
    if f.probe != "isolation":
        raise NotImplementedError(f"rerun of a {f.probe} finding")
    impl, conv = f.variant.split(",")
    b = build(f.model_type, attn_implementation=impl, seed=seed)
    if isinstance(b, Failure):
        return False, f"cannot build: {b.reason}"
    with torch.no_grad():
        c = isolation_cell(f.model_type, b.model, impl, conv, seed)
    return c.verdict == f.verdict, f"{c.verdict}: {c.reason}"
