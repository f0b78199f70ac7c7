"""A user's suite from `[tool.trainprobes]` (pyproject.toml or any TOML file).

Each array-of-tables entry names a target by import path and becomes one Check. Keys the
harness reads are listed per section (HARNESS_KEYS); every other key is passed to the probe
function as a keyword argument, checked against its signature before anything runs, so a
probe's own options and thresholds (alpha, atol, cuts, ...) are configured by their names.
Two generic threshold tables work for every section:
    fail_above = { metric = limit, ... }   fail when a metric exceeds its limit
    fail_below = { metric = limit, ... }   fail when a metric is under its limit
`name` labels the Result (its target), so variants of a change compare in the gate.
See docs/audit.md for the complete schema with an example.
"""
from __future__ import annotations

import inspect
import sys
import tomllib
from pathlib import Path

from probes.audit.run import Check

TOP_KEYS = {"seed", "out", "history", "defaults", "families", "pythonpath", "causality",
            "bias", "drift", "collectives"}
COMMON = {"name", "seed", "fail_above", "fail_below"}
HARNESS_KEYS = {
    "causality": COMMON | {"target", "batch", "seq_len", "vocab", "hidden", "inputs"},
    "bias": COMMON | {"target", "reference", "inputs"},
    "drift": COMMON | {"engine", "train", "infer", "rollouts"},
    "collectives": COMMON | {"world", "dtype", "algorithm", "backend", "op", "numel",
                             "distribution"},
}
# The code a threshold failure carries, per section.
THRESHOLD_CODE = {"causality": "TP-C1", "bias": "TP-B1", "drift": "TP-D3",
                  "collectives": "TP-B1"}


class ConfigError(ValueError):
    """A [tool.trainprobes] table that cannot be turned into a suite."""


def read_config(path) -> dict | None:
    """The [tool.trainprobes] table of a TOML file (or its top level when it has no tool table)."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {str(path)!r} is not valid TOML: {e}") from e
    if "tool" in doc or path.name == "pyproject.toml":
        return doc.get("tool", {}).get("trainprobes")
    return doc  # a standalone suite file: the table itself


def find_config(path=None) -> tuple[dict | None, Path | None]:
    """(config, path): --config FILE, else ./pyproject.toml's table, else (None, None)."""
    if path is not None:
        cfg = read_config(path)
        if cfg is None:
            raise ConfigError(f"config {str(path)!r} has no [tool.trainprobes] table")
        return cfg, Path(path).resolve()
    here = Path("pyproject.toml")
    if here.exists():
        cfg = read_config(here)
        if cfg:
            return cfg, here.resolve()
    return None, None


# --- helpers -----------------------------------------------------------------------------

def probe_kwargs(entry: dict, section: str, where: str, fn) -> dict:
    """Entry keys that are not harness keys, checked against the probe's signature."""
    extra = {k: v for k, v in entry.items() if k not in HARNESS_KEYS[section]}
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return extra
    unknown = sorted(set(extra) - set(params))
    if unknown:
        options = sorted(HARNESS_KEYS[section] | {p for p, v in params.items()
                                                   if v.kind is v.KEYWORD_ONLY})
        raise ConfigError(f"{where} has unknown keys {unknown!r}; known for [[{section}]]: "
                          f"{options}")
    return extra


def apply_thresholds(result, entry: dict, section: str):
    """Fail a Result whose metrics cross the entry's fail_above / fail_below limits."""
    broken = []
    for table, worse in (("fail_above", lambda v, lim: v > lim),
                         ("fail_below", lambda v, lim: v < lim)):
        for metric, limit in (entry.get(table) or {}).items():
            value = result.metrics.get(metric)
            if value is None or isinstance(value, (bool, str)):
                broken.append(f"{metric} missing from the Result ({table})")
            elif worse(value, limit):
                broken.append(f"{metric} = {value:.4g} {'>' if table == 'fail_above' else '<'} "
                              f"{limit:g} ({table})")
    if entry.get("fail_above") or entry.get("fail_below"):
        result.evidence["thresholds"] = {"fail_above": entry.get("fail_above", {}),
                                         "fail_below": entry.get("fail_below", {}),
                                         "broken": broken}
    if broken:
        code = THRESHOLD_CODE[section]
        result.verdict = "fail" if result.verdict != "error" else "error"
        if code not in result.codes:
            result.codes.append(code)
        result.message = (result.message + "; " if result.message else "") + \
            "over threshold: " + ", ".join(broken)
    return result


def _need(entry, key, where, example):
    if key not in entry:
        raise ConfigError(f"{where} is missing {key!r}, e.g. {key} = {example}")
    return entry[key]


def _int(entry, key, where, default):
    v = entry.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{where} {key}={v!r} must be a positive integer")
    return v


def _load(spec, where, key):
    from probes.targets import TargetError, load_target
    try:
        return load_target(spec)
    except TargetError as e:
        raise ConfigError(f"{where} {key}: {e}") from None


# --- sections ----------------------------------------------------------------------------

def causality_check(entry: dict, seed: int, where: str) -> Check:
    """[[causality]]: target(x) -> decisions; x is token ids [batch, seq_len] (vocab=) or
    hidden states [batch, seq_len, hidden] (hidden=), or inputs = "pkg:fn" (fn(seed) -> x)."""
    from probes.audit.families import causality_result

    spec = _need(entry, "target", where, '"package.module:router"')
    batch, T = _int(entry, "batch", where, 2), _int(entry, "seq_len", where, 64)
    if "inputs" not in entry and ("vocab" in entry) == ("hidden" in entry):
        raise ConfigError(f"{where} needs exactly one of vocab = <int> (token ids) or "
                          f"hidden = <int> (float hidden states), or inputs = 'pkg:fn'")
    from probes.causality import check
    kwargs = probe_kwargs(entry, "causality", where, check)
    name = entry.get("name", spec)

    def run():
        import torch
        fn = _load(spec, where, "target")
        g = torch.Generator().manual_seed(seed)
        if "inputs" in entry:
            x = _load(entry["inputs"], where, "inputs")(seed)
        elif "vocab" in entry:
            x = torch.randint(0, _int(entry, "vocab", where, 1), (batch, T), generator=g)
        else:
            x = torch.randn(batch, T, _int(entry, "hidden", where, 1), generator=g)
        r = causality_result(check(fn, x, **{"seed": seed, **kwargs}), T)
        r.target, r.evidence["target_spec"] = name, spec
        return apply_thresholds(r, entry, "causality")
    return Check("causality", name, run)


SECTIONS = {"causality": causality_check}


def suite_from_config(cfg: dict, *, seed: int = 0, base_dir=Path("."), quick: bool = False):
    """(checks, skipped) for a [tool.trainprobes] table."""
    from probes.audit.suites import default_suite

    if not isinstance(cfg, dict):
        raise ConfigError(f"[tool.trainprobes] must be a table, got {cfg!r}")
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"[tool.trainprobes] has unknown keys {unknown!r}; "
                          f"known: {sorted(TOP_KEYS)}")
    for p in reversed(cfg.get("pythonpath", [])):  # like pytest's pythonpath, relative to the file
        p = str((Path(base_dir) / p).resolve())
        if p not in sys.path:
            sys.path.insert(0, p)
    checks, skipped = [], {}
    if cfg.get("defaults"):
        checks, skipped = default_suite(seed=seed, quick=quick, families=cfg.get("families"))
    for section, build in SECTIONS.items():
        entries = cfg.get(section, [])
        if isinstance(entries, dict):
            entries = [entries]
        for i, entry in enumerate(entries):
            where = f"[[tool.trainprobes.{section}]] #{i}"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} = {entry!r} must be a table")
            try:
                checks.append(build(entry, int(entry.get("seed", seed)), where))
            except ModuleNotFoundError as e:
                skipped[f"{section} #{i}"] = f"probe module {e.name!r} is not installed"
    return checks, skipped
