"""Check torch's float32 -> fp8 cast against the exact rounding on EVERY float32 in +-max_finite.

    python scripts/fp8_cast_exhaustive.py        # ~3 minutes on 2 cores

reference/fp8codes.py casts float32 inputs with torch's own cast where no value can
overflow (|x| <= max_finite). This script checks that choice exhaustively, for the
installed torch, against fastround's magic-number rounding (itself checked against
Format.round by tests/test_fastround.py): every float32 bit pattern of either sign up to
max_finite, subnormals and -0 included. The tests check ties, their neighbours and random
values on every run; this is the complete check, too slow for the suite.
Result with torch 2.13.0 (CPU): e4m3fn 2,277,507,074 values, e5m2 2,394,947,586, 0 mismatches.
"""
import sys
import time

import torch
from trainprobes.reference.fastround import round_nearest
from trainprobes.reference.formats import get_format


def main() -> int:
    mismatches = 0
    for name in ("fp8_e4m3fn", "fp8_e5m2"):
        f, t0, bad, n = get_format(name), time.time(), 0, 0
        top = int(torch.tensor(f.max_finite, dtype=torch.float32).view(torch.int32))
        for lo in range(0, top + 1, 1 << 24):
            bits = torch.arange(lo, min(lo + (1 << 24), top + 1), dtype=torch.int32)
            for sign in (0, -(1 << 31)):
                x = (bits | sign).view(torch.float32)
                got = x.to(f.torch_dtype).view(torch.uint8)
                want = round_nearest(x, f).to(f.torch_dtype).view(torch.uint8)
                bad += int((got != want).sum())
                n += x.numel()
        print(f"{name}: {n:,} float32 values, {bad} mismatches ({time.time() - t0:.0f} s)",
              flush=True)
        mismatches += bad
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
