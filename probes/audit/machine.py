"""What this machine lacks for a family (no CUDA device), said as a reason: the
suites and the family modules ask here, so no family imports the suite that lists it."""
from __future__ import annotations

__all__ = ["cuda_missing"]


def cuda_missing() -> str | None:
    """Why there is no usable CUDA device here, or None when there is one."""
    import torch
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
    except Exception as e:  # a broken driver: say so, run the rest
        return f"CUDA unusable: {e}"
    return "no CUDA device"
