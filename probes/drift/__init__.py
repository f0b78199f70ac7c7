"""Train/inference log-prob drift: statistics and verdict (`compare`), a streaming monitor
(`DriftMonitor`), importance-sampling corrections, adapters for HF transformers and vLLM
outputs, and file readers. See docs/drift.md.

The submodules import one another by their full names (trainprobes.drift.stats, ...), never
this package, so the package imports them without a cycle.
"""
from trainprobes.drift.adapters import hf_token_logprobs, recompute_with_hf, vllm_logprobs
from trainprobes.drift.compare import compare
from trainprobes.drift.corrections import Correction, masked_is, truncated_is
from trainprobes.drift.io import DriftFileError, Rollouts, load_logprobs, load_rollouts
from trainprobes.drift.monitor import HISTORY_KEYS, DriftAlarm, DriftMonitor
from trainprobes.drift.stats import METRICS, QUANTILES
from trainprobes.drift.verdict import DRIFT_VERDICTS, classify

__all__ = ["compare", "classify", "DRIFT_VERDICTS", "METRICS", "QUANTILES",
           "DriftMonitor", "DriftAlarm", "HISTORY_KEYS",
           "Correction", "truncated_is", "masked_is",
           "DriftFileError", "Rollouts", "load_logprobs", "load_rollouts",
           "hf_token_logprobs", "recompute_with_hf", "vllm_logprobs"]
