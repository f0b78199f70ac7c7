"""scripts/gpu-check.sh: without CUDA it must fail loudly, never pass silently."""
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the script would run")
def test_gpu_check_fails_loudly_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "no GPU check was run" in p.stderr
    assert not out.exists()
