"""Train/inference log-prob drift: statistics and verdict (`compare`), a streaming monitor
(`DriftMonitor`), importance-sampling corrections, adapters for HF transformers and vLLM
outputs, and file readers. See docs/drift.md."""
from trainprobes.drift.compare import DRIFT_VERDICTS, classify, compare
from trainprobes.drift.stats import METRICS, QUANTILES

__all__ = ["compare", "classify", "DRIFT_VERDICTS", "METRICS", "QUANTILES"]
from trainprobes.drift.monitor import HISTORY_KEYS, DriftAlarm, DriftMonitor  # noqa: E402

__all__ += ["DriftMonitor", "DriftAlarm", "HISTORY_KEYS"]
from trainprobes.drift.corrections import Correction, masked_is, truncated_is  # noqa: E402

__all__ += ["Correction", "truncated_is", "masked_is"]
from trainprobes.drift.io import DriftFileError, Rollouts, load_logprobs, load_rollouts  # noqa: E402

__all__ += ["DriftFileError", "Rollouts", "load_logprobs", "load_rollouts"]
from trainprobes.drift.adapters import hf_token_logprobs, recompute_with_hf, vllm_logprobs  # noqa: E402

__all__ += ["hf_token_logprobs", "recompute_with_hf", "vllm_logprobs"]
