"""examples/drift_monitor_loop.py runs: the monitor inside a training loop, on the tiny LM."""
import importlib.util
from pathlib import Path

import torch


def test_monitor_loop_example_runs(capsys):
    path = Path(__file__).resolve().parents[1] / "examples" / "drift_monitor_loop.py"
    spec = importlib.util.spec_from_file_location("drift_monitor_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: one thread is far faster on a shared machine
    try:
        assert mod.main(["--steps", "3", "--bug-at", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.count("step ") >= 3 and "drift.monitor" in out and "trend of mean log-ratio" in out
