"""Train/inference log-prob drift: statistics and verdict (`compare`), a streaming monitor
(`DriftMonitor`), importance-sampling corrections, adapters for HF transformers and vLLM
outputs, and file readers. See docs/drift.md."""
from probes.drift.compare import DRIFT_VERDICTS, classify, compare
from probes.drift.stats import METRICS, QUANTILES

__all__ = ["compare", "classify", "DRIFT_VERDICTS", "METRICS", "QUANTILES"]
