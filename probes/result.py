"""The one result model every probe returns.

A Result is plain data: names, a verdict, numbers and JSON-able evidence. It round-trips
through JSON with a schema version, so the plugin, the audit and the gate consume only
this and never the probe's internals. Loading never unpickles.

JSON (docs/gate.md, "Reports"): standard JSON, exact round trip. A non-finite float is the
object {"$float": "nan"}, {"$float": "inf"} or {"$float": "-inf"}; everything else is
plain JSON. Each probe reports its verdict as one boolean metric (VERDICT_FLAGS) and
documents its metric names in PROBES.
"""
from __future__ import annotations

import json
import math
import operator
import os
import platform
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainprobes.errors import CannotJudge, InvalidArgument, InvalidType, OutputExists, SchemaError
from trainprobes.validation import check_choice, check_type

# 2: non-finite floats are {"$float": "nan"} (1 wrote the strings "nan", "inf", "-inf",
# which a string metric could not be told apart from); reports of version 1 are still read.
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
VERDICTS = ("pass", "warn", "fail", "error")

# Warning and failure codes, in the manner of pytest-benchmark: searchable and waivable.
CODES = {
    "TP-B1": "biased reduction",
    "TP-B2": "accumulation stall",
    "TP-B3": "lower accumulator precision",
    "TP-B4": "emulator disagrees with real backend",
    "TP-C1": "causality leak",
    "TP-C2": "nondeterministic target",
    "TP-C3": "batch isolation leak",
    "TP-D1": "biased train/inference drift",
    "TP-D2": "heavy-tailed train/inference drift",
    "TP-D3": "drift over threshold",
    "TP-D4": "engines disagree beyond noise (localised)",
    "TP-I1": "packed-document leak",
    "TP-I2": "batch-variant output",
    "TP-T1": "biased parallel transform",
    "TP-T2": "inconsistent replicas under a parallel transform",
    "TP-T3": "wrong gradient or loss under a parallel transform",
    "TP-T4": "transform scale significantly changed",
    "TP-G1": "probe missing from candidate",
    "TP-G2": "bias significantly larger",
    "TP-G3": "drift significantly worse",
    "TP-G4": "control no longer reproduces its known verdict",
    "TP-E1": "probe error",
}

# The verdict boolean each probe reports in its metrics, and the value that is good news.
# One convention for every probe, so the plugin's assert_* helpers and the gate read the
# same field: a probe that measured nothing reports None (and a verdict of fail or error).
VERDICT_FLAGS = {
    "biased": False,           # numerics.bias, drift.compare
    "causal": True,            # causality.check
    "equivalent": True,        # transforms.equivalence
    "isolated": True,          # isolation.documents
    "batch_invariant": True,   # isolation.batch_invariance, isolation.end_to_end
    "engines_agree": True,     # drift.localize
}


@dataclass(frozen=True)
class ProbeMetrics:
    """What a probe documents about its metrics (the one place thresholds, the gate and
    the plugin read them from; a test checks each probe's real Results against it).

    flag: its verdict boolean (a key of VERDICT_FLAGS), or None when it has none.
    code: the code a Result carries when the flag has its bad value.
    needs: metrics present, as numbers, whenever the probe measured (flag not None).
    names: every metric it may report; "name[...]" stands for any "name[<label>]".
    labels: those of names that are not numbers (strings, booleans besides the flag):
        a threshold (fail_above / fail_below) can name every other one.
    advisory: the probe describes the machine (this torch build and device), not the
        user's code: the flag's bad value is a watch-out, a "warn" with the code, not a
        failure (CPU fp32 GEMMs are batch-variant on a healthy machine). It still never
        passes, and the gate still blocks the flag going from good to bad.
    """

    flag: str | None = None
    code: str | None = None
    needs: tuple = ()
    names: tuple = ()
    labels: tuple = ()
    advisory: bool = False

    def __post_init__(self):
        if self.flag is not None and (self.flag not in VERDICT_FLAGS or self.code is None):
            raise InvalidArgument(f"flag={self.flag!r} must be one of {sorted(VERDICT_FLAGS)} "
                                  "and come with the code its bad value carries")
        if self.code is not None and self.code not in CODES:
            raise InvalidArgument(f"code={self.code!r} is not in CODES")

    @property
    def numbers(self) -> tuple:
        """The documented metrics that are numbers: what a threshold can compare."""
        return tuple(n for n in self.names if n != self.flag and n not in self.labels)

    def is_number(self, name: str) -> bool:
        return self.documents(name) and name != self.flag and name not in self.labels

    def documents(self, name: str) -> bool:
        if name in self.names:
            return True
        return any(n.endswith("[...]") and name.startswith(n[:-4]) and name.endswith("]")
                   for n in self.names)


_BIAS = ("trials", "bias", "ci_low", "ci_high", "confidence", "std", "rms", "p_value", "p_sign",
         "p_wilcoxon", "positive_trials", "negative_trials", "zero_trials", "alpha",
         "min_effect", "biased", "nonfinite_trials", "zero_reference_trials", "min_detectable_bias")
_DRIFT = ("n_tokens", "n_units", "n_sequences", "mean_log_ratio", "ci_low", "ci_high", "se_mean",
          "t_stat", "p_mean", "p_excess", "p_value", "std_log_ratio", "mean_abs_log_ratio",
          "max_abs_log_ratio", "k1_kl", "k2_kl", "k3_kl", "k3_kl_reverse", "chi2_token",
          "excess_kurtosis", "skewness", "mean_ratio", "min_ratio", "max_ratio", "ess_token",
          "n_ratio_outside", "frac_ratio_outside", "tail_share", "mean_abs_prob_diff",
          "max_abs_prob_diff", "prob_pearson", "ratio_p0.1", "ratio_p1", "ratio_p5",
          "ratio_p50", "ratio_p95", "ratio_p99", "ratio_p99.9", "seq_mean_log_ratio", "ess_seq",
          "chi2_seq", "frac_seq_ratio_outside", "frac_seq_geo_ratio_outside", "alpha", "clip",
          "noise_kl_max", "min_bias", "biased", "heavy_tailed", "drift_verdict", "min_detectable_bias")
_COLLECTIVE = ("max_ulp_error", "mean_ulp_error", "bias", "bias_z", "bias_p", "bias_relative",
               "nonfinite", "world", "numel", "dtype", "op", "collective", "backend",
               "algorithm", "bitwise_match_fraction", "mismatched", "compared")
_TRANSFORM = (
    "equivalent", "transform_verdict", "worst_parameter", "transform", "world", "dtype", "backend",
    "trials", "alpha", "alpha_per_test", "tests", "paired", "min_effect", "noise_tol",
    "replica_tol", "power", "scale", "scale_ci_low", "scale_ci_high", "scale_error",
    "scale_error_se", "added_scale_error", "added_scale_error_p", "signed_relative_error",
    "signed_relative_error_ci_low", "signed_relative_error_ci_high", "signed_relative_error_se",
    "added_signed_relative_error", "added_signed_relative_error_p", "max_relative_error",
    "mean_relative_error", "max_added_error", "mean_residual", "min_detectable_scale_error",
    "min_detectable_parameter_scale_error",
    "min_detectable_relative_bias", "n_parameters", "n_biased_parameters", "n_inconsistent",
    "loss_reported", "single_device_max_relative_error", "loss_relative_error",
    "loss_relative_error_se", "loss_scale", "loss_scale_ci_low", "loss_scale_ci_high",
    "max_loss_relative_error", "max_added_loss_error", "added_loss_error", "added_loss_error_p",
    "min_detectable_loss_error", "known_verdict", "matches_known_verdict")
PROBES = {
    "numerics.bias": ProbeMetrics("biased", "TP-B1", ("bias", "std", "trials"), _BIAS),
    "drift.compare": ProbeMetrics("biased", "TP-D1", ("mean_log_ratio", "se_mean"), _DRIFT,
                                  ("heavy_tailed", "drift_verdict")),
    "causality.check": ProbeMetrics("causal", "TP-C1", (), (
        "causal", "deterministic", "n_nondeterministic", "n_leaks", "n_structural",
        "n_numerical", "n_unverified", "n_unconfirmed", "n_flips", "n_score_leaks",
        "n_score_numerical", "flip_rate", "n_compared", "n_cuts", "trials", "batch_isolated",
        "batch_invariant", "packed", "n_evaluations", "n_confirmations", "tokens_evaluated",
        "evaluations_to_first_flip", "first_leak_position", "min_leak_distance",
        "max_leak_distance", "fp64", "mismatch_rate", "inference_mismatch_rate", "n_near_ties",
        "n_near_tie_leaks"),
        ("deterministic", "batch_isolated", "batch_invariant", "packed", "fp64")),
    "distributed.collective": ProbeMetrics(None, None, ("bias", "bias_z"), _COLLECTIVE,
                                           ("dtype", "op", "collective", "backend", "algorithm")),
    "numerics.reveal": ProbeMetrics(None, "TP-B3", ("accumulator_mantissa_bits",), (
        "accumulator_mantissa_bits", "accumulator_bits_lower_bound", "rounds_per_add",
        "rounding", "order_shape", "fan_in", "n", "input_format", "output_format"),
        ("accumulator_bits_lower_bound", "rounds_per_add", "rounding", "order_shape",
         "input_format", "output_format")),
    "numerics.gemm": ProbeMetrics("biased", "TP-B1", ("relative_bias", "std", "trials"), (
        "preset", "recipe", "gemm", "k", "samples", "trials", "relative_bias", "ci_low",
        "ci_high", "std", "p_value", "alpha", "tolerance", "min_detectable_bias",
        "max_relative_error", "sqnr_db", "growth_exponent", "stall_k", "promote_every_needed",
        "biased", "gemm_verdict", "relative_offset", "offset_ci_low", "offset_ci_high",
        "offset_std", "offset_p_value", "confidence", "rows_drawn", "columns_drawn", "what_if",
        "promotion_searched"),
        ("preset", "recipe", "gemm", "gemm_verdict", "what_if", "promotion_searched")),
    "numerics.stall": ProbeMetrics(None, "TP-B2", (), (
        "rows", "rows_over_tolerance", "max_abs_relative_error", "rel_tol",
        "sequential_sum[...]")),
    # trainprobes.drift.decompose.localize
    "drift.localize": ProbeMetrics("engines_agree", "TP-D4", ("n_tokens",), (
        "engines_agree", "kind", "first_layer", "op", "op_module", "explained_by", "explained_by_op",
        "explained_by_module", "n_tokens", "n_sequences",
        "mean_log_ratio", "mean_abs_log_ratio", "max_abs_log_ratio", "n_dropped_tokens",
        "n_stale_tensors", "n_trainer_rounded_tensors", "n_unmatched_tensors", "n_forwards", "margin", "alpha", "nominal_roundoff",
        *(f"share_{p}{s}" for p in ("weights", "routing", "temperature", "renormalisation",
                                    "numerics", "unexplained") for s in ("", "_ci_low", "_ci_high")),
        "share_numerics[...]", "own_error[...]", "free_error[...]", "noise_floor[...]",
        "routing_mismatch[...]", "routing_frac_decisions", "routing_frac_tokens_any_layer",
        "temperature_slope", "temperature_slope_ci_low", "temperature_slope_ci_high",
        "temperature", "renormalised", "frac_positions_renormalised", "mean_log_mass_kept",
        "offset"),
        ("kind", "first_layer", "op", "op_module", "explained_by", "explained_by_op", "explained_by_module",
         "temperature", "renormalised")),
    # trainprobes.transforms
    "transforms.equivalence": ProbeMetrics("equivalent", "TP-T1", (
        "scale", "scale_error", "scale_error_se", "trials"), _TRANSFORM, (
        "paired", "loss_reported", "transform_verdict", "worst_parameter", "transform", "dtype",
        "backend", "known_verdict", "matches_known_verdict")),
    # trainprobes.isolation
    "isolation.documents": ProbeMetrics("isolated", "TP-I1", ("n_leaks", "max_leak"), (
        "isolated", "n_documents", "n_leaks", "n_numerical", "n_unverified", "n_blind_tokens", "max_leak",
        "max_cross_change", "deterministic", "causal", "n_evaluations", "n_fp64_evaluations",
        "fp64", "batched", "causality_evaluations", "n_nondeterministic", "by_hand_change"),
        ("deterministic", "causal", "fp64", "batched")),
    "isolation.batch_invariance": ProbeMetrics("batch_invariant", "TP-I2", ("max_abs_diff",), (
        "batch_invariant", "frac_outputs_differ", "frac_rows_differ", "max_abs_diff",
        "mean_abs_diff", "max_ulps", "breaking_sizes", "first_breaking_size",
        "companion_dependent", "deterministic", "n_evaluations", "n_rows", "atol"),
        ("breaking_sizes", "companion_dependent", "deterministic")),
    # the per-op map of this machine (trainprobes.isolation.ops): the same metrics, advisory
    "isolation.op_map": ProbeMetrics("batch_invariant", "TP-I2", ("max_abs_diff",), (
        "batch_invariant", "frac_outputs_differ", "frac_rows_differ", "max_abs_diff",
        "mean_abs_diff", "max_ulps", "breaking_sizes", "first_breaking_size",
        "companion_dependent", "deterministic", "n_evaluations", "n_rows", "atol"),
        ("breaking_sizes", "companion_dependent", "deterministic"), advisory=True),
    "isolation.end_to_end": ProbeMetrics("batch_invariant", "TP-I2", ("max_abs_diff",), (
        "batch_invariant", "size", "frac_tokens_differ", "max_abs_diff", "drift_verdict",
        "mean_log_ratio", "std_log_ratio", "k3_kl", "p_value", "n_tokens", "n_evaluations",
        "variance_share", "variance_ratio", "bias_share", "measured_std_log_ratio",
        "measured_mean_log_ratio"),
        ("drift_verdict",)),
}


# --- JSON: exact, and standard --------------------------------------------------------

# JSON has no NaN or infinity (RFC 8259 section 6), so a non-finite float is written as a
# one-key object; every other value is plain JSON. Python's float repr round-trips, so
# finite floats (and -0.0) come back bit for bit.
FLOAT_TAG = "$float"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def to_jsonable(obj: Any) -> Any:
    """Tensors, numpy arrays and scalars, tuples and paths to plain JSON values.

    Non-finite floats become {"$float": "nan" | "inf" | "-inf"} (from_jsonable reads them
    back), so the JSON stays standard and the round trip exact.
    """
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {FLOAT_TAG: "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        if set(obj) == {FLOAT_TAG}:
            raise InvalidArgument(f"{obj!r}: a dict whose only key is {FLOAT_TAG!r} is reserved "
                                  "for non-finite floats in trainprobes JSON; rename the key")
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # torch.Tensor, numpy array or numpy scalar
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return str(obj)


def from_jsonable(obj: Any) -> Any:
    """The inverse of to_jsonable on what it writes: {"$float": "nan"} -> nan, recursively."""
    if isinstance(obj, dict):
        if FLOAT_TAG in obj and len(obj) == 1:
            tag = obj[FLOAT_TAG]
            if tag not in _NONFINITE:
                raise SchemaError(f"{obj!r}: {FLOAT_TAG!r} must be one of {sorted(_NONFINITE)}")
            return _NONFINITE[tag]
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


def _from_v1(obj: Any) -> Any:
    """Version 1 wrote non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(obj, dict):
        return {k: _from_v1(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_v1(v) for v in obj]
    return _NONFINITE.get(obj, obj) if isinstance(obj, str) else obj


def _upgrade_v1(d: dict) -> dict:
    """A version-1 Result dict as version 2: floats back, and numerics.bias's string
    metric "verdict" as the boolean `biased` (None where nothing was measured)."""
    d = {**d, "metrics": _from_v1(d.get("metrics")), "evidence": _from_v1(d.get("evidence")),
         "schema_version": SCHEMA_VERSION}
    m = d["metrics"]
    if d.get("probe") == "numerics.bias" and isinstance(m, dict) and "verdict" in m:
        m = dict(m)
        m["biased"] = {"biased": True, "unbiased": False}.get(m.pop("verdict"))
        d["metrics"] = m
    return d


def environment() -> dict:
    """What produced a Result: versions and machine, never anything secret."""
    env = {"python": sys.version.split()[0], "platform": platform.platform()}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        try:
            env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except Exception:  # a broken driver must not break a report
            env["device"] = "unknown"
    return env


# Every field a Result's JSON holds; a report missing one was cut or hand-edited. Version 1
# predates `expected`.
FIELDS = ("probe", "target", "verdict", "metrics", "evidence", "seed", "codes", "message",
          "environment", "created", "schema_version", "expected")
_V1_FIELDS = tuple(f for f in FIELDS if f != "expected")


@dataclass(eq=False)
class Result:
    """What a probe found.

    probe: which probe ("numerics.bias", "causality.check", ...).
    target: what it probed (an import path, "all_reduce[bf16,ring,w=1024]", ...).
    verdict: "pass", "warn", "fail" or "error".
    metrics: flat name -> number/bool/str; what baselines and gates compare. A probe's
        verdict boolean (VERDICT_FLAGS: biased, causal, ...) is one of them.
    evidence: JSON-able detail (tables, leaks, histograms) for reports and plots.
    codes: failure/warning codes from CODES that apply.
    message: one human sentence saying what was found and why it matters.
    expected: for a control (a reference router, a zoo bug, an engine pair: a case whose
        verdict is known from its mechanism), that known verdict; None for a finding about
        the user's code or machine. A control that gets its expected verdict is "reproduced":
        a pass of the harness even when the verdict is "fail" (a known-leaky router leaks).

    Two Results are equal when their JSON is: `Result.from_json(r.to_json()) == r` holds
    for every Result, NaN and infinities included.
    """

    probe: str
    target: str
    verdict: str
    metrics: dict = field(default_factory=dict)
    evidence: dict = field(default_factory=dict)
    seed: int | None = None
    codes: list = field(default_factory=list)
    message: str = ""
    environment: dict = field(default_factory=environment)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    schema_version: int = SCHEMA_VERSION
    expected: str | None = None

    def __post_init__(self):
        # a hand-edited report must fail at load (the gate cannot judge), not deep in a probe
        # comparison: a None target matched nothing, a list of metrics was a traceback
        for name in ("probe", "target", "message", "created"):
            check_type(str, getattr(self, name), name, hint="a string")
        for name in ("metrics", "evidence", "environment"):
            check_type(dict, getattr(self, name), name, hint="a dict (a JSON object)")
        if self.seed is not None:  # numpy and torch integer seeds are ints too
            try:
                if isinstance(self.seed, bool):
                    raise TypeError
                self.seed = operator.index(self.seed)
            except TypeError:
                raise InvalidType(f"seed={self.seed!r} must be an int or None") from None
        if isinstance(self.codes, tuple):
            self.codes = list(self.codes)
        if not isinstance(self.codes, list):
            raise InvalidType(f"codes={self.codes!r} must be a list of codes"
                              + (f", e.g. [{self.codes!r}]" if isinstance(self.codes, str) else ""))
        check_choice(self.verdict, "verdict", VERDICTS)
        if self.expected is not None:
            check_choice(self.expected, "expected", VERDICTS,
                         hint="None (a finding) or the known verdict of a control")
        if self.schema_version != SCHEMA_VERSION:
            raise InvalidArgument(f"schema_version={self.schema_version!r}; a Result in memory "
                                  f"is version {SCHEMA_VERSION}")
        unknown = [c for c in self.codes if c not in CODES]
        if unknown:
            raise InvalidArgument(f"codes={unknown!r} are not known codes; see "
                                  "trainprobes.result.CODES")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Result):
            return NotImplemented
        return self.to_json(sort_keys=True) == other.to_json(sort_keys=True)

    __hash__ = None  # mutable

    @property
    def passed(self) -> bool:
        return self.verdict in ("pass", "warn")

    @property
    def is_control(self) -> bool:
        return self.expected is not None

    @property
    def reproduced(self) -> bool | None:
        """For a control: did it get its known verdict? None for a finding. A probe that
        knows a finer verdict than pass/fail (the transforms zoo: biased, not merely some
        failure) says whether it matched in metrics matches_known_verdict; False misses."""
        if self.expected is None:
            return None
        return self.verdict == self.expected and self.metrics.get("matches_known_verdict") is not False

    @property
    def key(self) -> str:
        """Identity used to match a Result across reports (baseline vs candidate)."""
        return f"{self.probe}::{self.target}"

    def number(self, name: str) -> float | None:
        """metrics[name] as a float (NaN and infinities included), None when absent.

        Raises InvalidType when present but not a number (a bool, a string such as "nan"):
        a judge must say the metric is mistyped, not read it as missing."""
        if name not in self.metrics:
            return None
        v = self.metrics[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidType(f"{self.key!r}: metric {name}={v!r} is a {type(v).__name__}, "
                              "expected a number")
        return float(v)

    def flag(self, name: str | None = None) -> bool | None:
        """The probe's verdict boolean (VERDICT_FLAGS; by default the one PROBES documents
        for this probe): True, False, or None where the probe measured nothing.

        Fails closed: raises CannotJudge when the metric is absent, mistyped, or None
        beside a passing verdict (nothing measured cannot pass)."""
        if name is None:
            spec = PROBES.get(self.probe)
            if spec is None or spec.flag is None:
                raise CannotJudge(f"{self.key!r}: probe {self.probe!r} documents no verdict "
                                  f"boolean (one of {sorted(VERDICT_FLAGS)})")
            name = spec.flag
        if name not in self.metrics:
            raise CannotJudge(f"{self.key!r}: metric {name!r} (the verdict boolean) is missing")
        v = self.metrics[name]
        if v is not None and not isinstance(v, bool):
            raise CannotJudge(f"{self.key!r}: metric {name}={v!r} is mistyped: a "
                              f"{type(v).__name__}, expected true or false")
        if v is None and self.passed:
            raise CannotJudge(f"{self.key!r}: metric {name}=None (nothing measured) beside "
                              f"verdict {self.verdict!r}")
        return v

    def to_dict(self) -> dict:
        return to_jsonable(asdict(self))

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        """A Result from its JSON object (to_dict's output, or a version-1 one)."""
        if not isinstance(d, dict):
            raise SchemaError(f"a Result must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise SchemaError(
                f"Result schema_version={version!r}; this trainprobes reads {READABLE_VERSIONS}"
                + (" (the report is from a newer trainprobes: upgrade)" if isinstance(version, int)
                   and not isinstance(version, bool) and version > SCHEMA_VERSION else ""))
        missing = [k for k in (_V1_FIELDS if version == 1 else FIELDS) if k not in d]
        if missing:
            raise SchemaError(f"Result for {d.get('probe')!r} is missing fields {missing!r}")
        try:
            d = _upgrade_v1(d) if version == 1 else from_jsonable(d)
            return cls(**{k: v for k, v in d.items() if k in FIELDS})
        except (TypeError, ValueError) as e:
            raise SchemaError(f"Result for {d.get('probe')!r} is malformed: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> "Result":
        try:
            return cls.from_dict(strict_json(text))
        except (json.JSONDecodeError, DuplicateKeys) as e:
            raise SchemaError(f"not valid JSON: {e}") from e

    def summary_line(self) -> str:
        codes = f" [{', '.join(self.codes)}]" if self.codes else ""
        if self.is_control:  # judged on reproducing its known verdict: OK / MISSED, as reports say
            word = "OK" if self.reproduced else "MISSED"
            return (f"{word:5} {self.probe} {self.target}{codes}: control, known verdict "
                    f"{self.expected}, got {self.verdict}: {self.message}")
        return f"{self.verdict.upper():5} {self.probe} {self.target}{codes}: {self.message}"


def repeat_suffix(key: str, earlier_keys) -> str:
    """" #n" for the n-th Result under one probe::target key (n >= 2), "" for the first.

    The gate matches Results by key, so a report must hold each key once; two Results of
    one probe on one target (a router in two modes, two stall sums in one test) are told
    apart by their order, which is stable across runs.
    """
    n = sum(k == key or k.rsplit(" #", 1)[0] == key for k in earlier_keys)
    return f" #{n + 1}" if n else ""


def write_atomic(path: str | os.PathLike, text: "str | bytes", *, replace: bool = True) -> Path:
    """Write text (or bytes) to path via a temp file in the same folder and a rename.

    A crash midway leaves the old file (or none), never half a file. replace=False never
    replaces an existing file, even one another process created meanwhile: the temp file is
    hard-linked into place (link(2) fails on an existing name), else OutputExists.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not replace and path.exists():
        raise OutputExists(f"{str(path)!r} exists; pass --force to replace it, or name a new file")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; a report is meant to be read by others, so give it
        # the mode an ordinary open() would (0666 less the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise OutputExists(f"{str(path)!r} was created by someone else while this run "
                                   f"wrote it; it is left as it is (pass --force to replace "
                                   f"it)") from None
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def report_document(results: list[Result], **meta) -> dict:
    """The one shape of a report, written by save_results and printed by every command's
    --json: {"schema_version", **meta (e.g. "command"), "results": [Result.to_dict(), ...]}."""
    if "schema_version" in meta:
        raise InvalidArgument("meta may not name 'schema_version': it is the report's own key")
    return {"schema_version": SCHEMA_VERSION, **to_jsonable(meta),
            "results": [r.to_dict() for r in results]}


def dumps_report(results: list[Result], **meta) -> str:
    """report_document as standard JSON text (no NaN tokens), indented."""
    return json.dumps(report_document(results, **meta), indent=2, allow_nan=False)


def save_results(path, results: list[Result], *, replace: bool = True, **meta) -> Path:
    """Write a report (report_document's shape), atomically; replace=False refuses to replace
    an existing file (OutputExists)."""
    return write_atomic(path, dumps_report(results, **meta) + "\n", replace=replace)


class DuplicateKeys(ValueError):
    """A JSON object names a key twice (strict_json)."""


def _no_duplicate_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        # json keeps the last silently: a hand-edited report could hide a field's first value
        dup = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise DuplicateKeys(f"key(s) {dup} appear twice in one object")
    return d


def strict_json(text: str):
    """json.loads, refusing an object that names a key twice (DuplicateKeys)."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys)


def load_results(path) -> tuple[list[Result], dict]:
    """Read a report written by save_results. Raises SchemaError with the path on any fault."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SchemaError(f"report {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SchemaError(f"report {str(path)!r} cannot be read: {e}") from e
    try:
        doc = strict_json(text)
    except (json.JSONDecodeError, DuplicateKeys) as e:
        raise SchemaError(f"report {str(path)!r} is not valid JSON (truncated, or edited?): {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise SchemaError(f"report {str(path)!r} has no 'results' list"
                          + (" (it is a single Result: save reports with save_results or a "
                             "command's --json/--output)" if isinstance(doc, dict)
                             and "probe" in doc else ""))
    version = doc.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise SchemaError(
            f"report {str(path)!r} has schema_version={version!r}; this trainprobes reads "
            f"{READABLE_VERSIONS}" + (" (written by a newer trainprobes: upgrade to read it)"
                                      if isinstance(version, int) and not isinstance(version, bool)
                                      and version > SCHEMA_VERSION else ""))
    results = []
    for i, r in enumerate(doc["results"]):
        try:
            results.append(Result.from_dict(r))
        except SchemaError as e:
            raise SchemaError(f"report {str(path)!r}, results[{i}]: {e}") from e
    meta = {k: v for k, v in doc.items() if k not in ("results", "schema_version")}
    return results, meta
