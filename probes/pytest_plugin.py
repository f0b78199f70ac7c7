"""pytest plugin for training CI (entry point pytest11). Kept light: no torch at import."""

MARKERS = {
    "numerics": "low-precision numerics probes (bias, stall, accumulator)",
    "causality": "future-token causality probes",
    "drift": "train/inference log-prob drift probes",
    "distributed": "runs real collectives on torch.distributed",
    "gpu": "needs CUDA; skipped with a reason where there is none",
}


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
