"""The one result model every probe returns.

A Result is plain data: names, a verdict, numbers and JSON-able evidence. It round-trips
through JSON with a schema version, so the plugin, the audit and the gate consume only
this and never the probe's internals. Loading never unpickles.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainprobes.errors import SchemaError

SCHEMA_VERSION = 1
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
    "TP-T1": "biased parallel transform",
    "TP-T2": "inconsistent replicas under a parallel transform",
    "TP-T3": "wrong gradient or loss under a parallel transform",
    "TP-T4": "transform scale significantly changed",
    "TP-G1": "probe missing from candidate",
    "TP-G2": "bias significantly larger",
    "TP-G3": "drift significantly worse",
    "TP-E1": "probe error",
}


def to_jsonable(obj: Any) -> Any:
    """Tensors, numpy arrays and scalars, tuples and paths to plain JSON values.

    Non-finite floats become the strings "nan", "inf", "-inf" so the JSON stays standard.
    """
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
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


@dataclass
class Result:
    """What a probe found.

    probe: which probe ("numerics.bias", "causality.check", ...).
    target: what it probed (an import path, "all_reduce[bf16,ring,w=1024]", ...).
    verdict: "pass", "warn", "fail" or "error".
    metrics: flat name -> number/bool/str; what baselines and gates compare.
    evidence: JSON-able detail (tables, leaks, histograms) for reports and plots.
    codes: failure/warning codes from CODES that apply.
    message: one human sentence saying what was found and why it matters.
    expected: for a control (a reference router, a zoo bug, an engine pair: a case whose
        verdict is known from its mechanism), that known verdict; None for a finding about
        the user's code or machine. A control that gets its expected verdict is "reproduced":
        a pass of the harness even when the verdict is "fail" (a known-leaky router leaks).
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
        for name in ("probe", "target"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a string")
        for name in ("metrics", "evidence"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a dict (a JSON object)")
        if isinstance(self.codes, str):
            raise ValueError(f"codes={self.codes!r} must be a list of codes, e.g. [{self.codes!r}]")
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} is not one of {VERDICTS}")
        if self.expected is not None and self.expected not in VERDICTS:
            raise ValueError(f"expected={self.expected!r} must be None (a finding) or one of {VERDICTS}")
        unknown = [c for c in self.codes if c not in CODES]
        if unknown:
            raise ValueError(f"codes={unknown!r} are not known codes; see trainprobes.result.CODES")

    @property
    def passed(self) -> bool:
        return self.verdict in ("pass", "warn")

    @property
    def is_control(self) -> bool:
        return self.expected is not None

    @property
    def reproduced(self) -> bool | None:
        """For a control: did it get its known verdict? None for a finding."""
        return None if self.expected is None else self.verdict == self.expected

    @property
    def key(self) -> str:
        """Identity used to match a Result across reports (baseline vs candidate)."""
        return f"{self.probe}::{self.target}"

    def to_dict(self) -> dict:
        return to_jsonable(asdict(self))

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        if not isinstance(d, dict):
            raise SchemaError(f"a Result must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SchemaError(
                f"Result schema_version={version!r}; this trainprobes reads {SCHEMA_VERSION}"
                + (" (the report is from a newer trainprobes: upgrade)" if isinstance(version, int)
                   and version > SCHEMA_VERSION else ""))
        missing = [k for k in ("probe", "target", "verdict") if k not in d]
        if missing:
            raise SchemaError(f"Result is missing fields {missing!r}")
        known = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except (TypeError, ValueError) as e:
            raise SchemaError(f"Result for {d.get('probe')!r} is malformed: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> "Result":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise SchemaError(f"not valid JSON: {e}") from e

    def summary_line(self) -> str:
        codes = f" [{', '.join(self.codes)}]" if self.codes else ""
        return f"{self.verdict.upper():5} {self.probe} {self.target}{codes}: {self.message}"


def repeat_suffix(key: str, earlier_keys) -> str:
    """" #n" for the n-th Result under one probe::target key (n >= 2), "" for the first.

    The gate matches Results by key, so a report must hold each key once; two Results of
    one probe on one target (a router in two modes, two stall sums in one test) are told
    apart by their order, which is stable across runs.
    """
    n = sum(k == key or k.rsplit(" #", 1)[0] == key for k in earlier_keys)
    return f" #{n + 1}" if n else ""


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write text to path via a temp file in the same folder and a rename.

    A crash midway leaves the old file (or none), never half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; a report is meant to be read by others, so give it
        # the mode an ordinary open() would (0666 less the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def save_results(path, results: list[Result], **meta) -> Path:
    """Write a report: {"schema_version", "results": [...], **meta}, atomically."""
    doc = {"schema_version": SCHEMA_VERSION, **to_jsonable(meta),
           "results": [r.to_dict() for r in results]}
    return write_atomic(path, json.dumps(doc, indent=2))


def load_results(path) -> tuple[list[Result], dict]:
    """Read a report written by save_results. Raises SchemaError with the path on any fault."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SchemaError(f"report {str(path)!r} does not exist") from None
    except OSError as e:
        raise SchemaError(f"report {str(path)!r} cannot be read: {e}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SchemaError(f"report {str(path)!r} is not valid JSON (truncated?): {e}") from e
    if not isinstance(doc, dict) or "results" not in doc:
        raise SchemaError(f"report {str(path)!r} has no 'results' list")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"report {str(path)!r} has schema_version={version!r}; this trainprobes reads "
            f"{SCHEMA_VERSION}" + (" (written by a newer trainprobes: upgrade to read it)"
                                   if isinstance(version, int) and version > SCHEMA_VERSION else ""))
    try:
        results = [Result.from_dict(r) for r in doc["results"]]
    except SchemaError as e:
        raise SchemaError(f"report {str(path)!r}: {e}") from e
    meta = {k: v for k, v in doc.items() if k not in ("results", "schema_version")}
    return results, meta
