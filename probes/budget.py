"""What a run needs against what this machine has, checked before the run starts.

    check_fits(need_bytes, what, fix="...")   raises TooLarge (exit 2) when need > the share
                                               of available memory a run may take
    available_bytes()                          MemAvailable, capped by a cgroup limit
    NEEDS                                      bytes per element of each path (measured)

The per-element figures are peak RSS over element count, measured with /usr/bin/time on
torch 2.13 CPU (two sizes each, the difference divided by the difference in elements, so
the interpreter's ~300 MB drops out), then rounded up:
  - the emulated collective: 8 x 1e6 -> 64 x 1e6 elements -> 256 x 1e6: 31 B/element
    (the fp64 stack, its rounded copy and two temporaries);
  - numerics.bias on the emulator: world 4096, numel 256 -> 2048: 73 B/element (per trial,
    trials run one after another);
  - causality: the [B, T, D] inputs and the perturbed copies a check keeps (float64).
Only what trainprobes allocates is counted: a user's target takes its own memory on top.
Imports nothing of trainprobes but its errors, so every layer may use it.
"""
from __future__ import annotations

import os

from trainprobes.errors import InvalidArgument

NEEDS = {"emulated_collective": 32, "bias": 80, "causality_float": 8 * 8, "causality_ids": 8 * 8}
BASE_BYTES = 400 * 2**20   # the interpreter with torch imported, and headroom
SHARE = 0.8                # of available memory a run may plan to take


class TooLarge(InvalidArgument):
    """A request that would need more memory than this machine has available."""


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """cgroup v2 memory.max - memory.current of this process's group, if limited."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="ascii") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError, StopIteration):
        return None


def available_bytes() -> int:
    """Memory a new run can take now: MemAvailable (or physical pages where /proc has no
    figure), capped by this process's cgroup limit."""
    figures = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    if not figures:
        try:
            figures = [os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
        except (ValueError, OSError, AttributeError):
            return 2**63  # no figure on this OS: nothing to refuse against
    return min(figures)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} PiB"


def check_fits(need_bytes: float, what: str, *, fix: str) -> None:
    """Refuse `what` (e.g. "--world 100000 --numel 1e8") when it needs more than SHARE of
    the available memory; the message gives both figures and `fix`."""
    have = available_bytes()
    need = need_bytes + BASE_BYTES
    if need > SHARE * have:
        raise TooLarge(f"{what} needs about {human(need)} of memory and this machine has "
                       f"{human(have)} available (a run may plan on {SHARE:.0%} of it); {fix}")
