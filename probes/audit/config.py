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
from pathlib import Path

from trainprobes import _toml
from trainprobes.audit.run import Check
from trainprobes.errors import ConfigError

TOP_KEYS = {"seed", "out", "history", "defaults", "families", "pythonpath", "causality",
            "bias", "drift", "collectives", "transforms"}
COMMON = {"name", "seed", "fail_above", "fail_below"}
HARNESS_KEYS = {
    "causality": COMMON | {"target", "batch", "seq_len", "vocab", "hidden", "inputs"},
    "bias": COMMON | {"target", "reference", "inputs"},
    "drift": COMMON | {"engine", "train", "infer", "rollouts", "_base_dir"},
    "collectives": COMMON | {"world", "dtype", "algorithm", "backend", "op", "numel"},
    "transforms": COMMON | {"target", "transform", "options", "world", "backend", "timeout"},
}
# The code a threshold failure carries, per section.
THRESHOLD_CODE = {"causality": "TP-C1", "bias": "TP-B1", "drift": "TP-D3",
                  "collectives": "TP-B1", "transforms": "TP-T3"}


def read_config(path) -> dict | None:
    """The [tool.trainprobes] table of a TOML file (or its top level when it has no tool table)."""
    path = Path(path)
    try:
        doc = _toml.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {str(path)!r} does not exist") from None
    except _toml.TOMLDecodeError as e:
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
    from trainprobes.targets import TargetError, load_target
    try:
        return load_target(spec)
    except TargetError as e:
        raise ConfigError(f"{where} {key}: {e}") from None


# --- sections ----------------------------------------------------------------------------

def causality_check(entry: dict, seed: int, where: str) -> Check:
    """[[causality]]: target(x) -> decisions; x is token ids [batch, seq_len] (vocab=) or
    hidden states [batch, seq_len, hidden] (hidden=), or inputs = "pkg:fn" (fn(seed) -> x)."""
    from trainprobes.audit.families import causality_result

    spec = _need(entry, "target", where, '"package.module:router"')
    batch, T = _int(entry, "batch", where, 2), _int(entry, "seq_len", where, 64)
    if "inputs" not in entry and ("vocab" in entry) == ("hidden" in entry):
        raise ConfigError(f"{where} needs exactly one of vocab = <int> (token ids) or "
                          f"hidden = <int> (float hidden states), or inputs = 'pkg:fn'")
    from trainprobes.causality import check
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


def bias_check(entry: dict, seed: int, where: str) -> Check:
    """[[bias]]: target(inputs) in low precision vs reference(inputs) in fp64, over seeded
    trials; inputs = "pkg:make" with make(generator) -> inputs (trainprobes.numerics.bias)."""
    from trainprobes.numerics.bias import bias_probe

    spec = _need(entry, "target", where, '"package.module:bf16_sum"')
    ref_spec = _need(entry, "reference", where, '"package.module:fp64_sum"')
    make_spec = _need(entry, "inputs", where, '"package.module:make_inputs"')
    kwargs = probe_kwargs(entry, "bias", where, bias_probe)
    name = entry.get("name", spec)

    def run():
        from trainprobes.audit.families import bias_result
        fn, ref = _load(spec, where, "target"), _load(ref_spec, where, "reference")
        make = _load(make_spec, where, "inputs")
        r = bias_result(bias_probe(fn, ref, make, **{"seed": seed, **kwargs}, target=name))
        r.evidence.update({"target_spec": spec, "reference_spec": ref_spec})
        return apply_thresholds(r, entry, "bias")
    return Check("numerics", name, run)


def drift_check(entry: dict, seed: int, where: str) -> Check:
    """[[drift]]: engine = "pkg:fn" with fn(seed) -> (train_lp, infer_lp[, mask]); or files:
    train = "a.npz" and infer = "b.npz", or rollouts = "r.jsonl" holding both sides."""
    from trainprobes.drift import compare

    sources = [k for k in ("engine", "rollouts", "train") if k in entry]
    if len(sources) != 1 or (("train" in entry) != ("infer" in entry)):
        raise ConfigError(f"{where} needs exactly one source: engine = 'pkg:fn', "
                          f"rollouts = 'file.jsonl', or train = 'a.npz' with infer = 'b.npz'")
    kwargs = probe_kwargs(entry, "drift", where, compare)
    name = entry.get("name", entry.get("engine") or entry.get("rollouts") or entry["train"])
    base = entry.get("_base_dir", ".")

    def run():
        from trainprobes.audit.families import drift_result
        from trainprobes.drift import load_logprobs, load_rollouts
        mask = None
        if "engine" in entry:
            out = _load(entry["engine"], where, "engine")(seed)
            train, infer, mask = (tuple(out) + (None,))[:3]
        elif "rollouts" in entry:
            ro = load_rollouts(Path(base) / entry["rollouts"])
            if ro.train_logprobs is None:
                raise ConfigError(f"{where} rollouts {entry['rollouts']!r} hold no "
                                  f"train_logprobs; recompute them first (docs/drift.md)")
            train, infer, mask = ro.train_logprobs, ro.infer_logprobs, ro.mask
        else:
            train, mask = load_logprobs(Path(base) / entry["train"])
            infer, infer_mask = load_logprobs(Path(base) / entry["infer"])
            mask = infer_mask if mask is None else mask
        r = compare(train, infer, mask=mask, **kwargs, target=name)
        r.seed = seed
        return apply_thresholds(drift_result(r), entry, "drift")
    return Check("drift", name, run)


def _listed(entry, key, default):
    v = entry.get(key, default)
    return list(v) if isinstance(v, (list, tuple)) else [v]


def collective_checks(entry: dict, seed: int, where: str) -> list[Check]:
    """[[collectives]]: every combination of world x dtype x algorithm. backend "emulated"
    (the default): the emulated all_reduce against the fp64 reference on gradient-like data;
    "gloo" or "nccl": the real collective on local ranks (one launch each), against fp64 and
    the emulator bit for bit."""
    backend = entry.get("backend", "emulated")
    if backend == "emulated":
        from trainprobes.numerics.bias import collective_bias as probe
        family, default_world, default_algorithm, default_numel = "collectives", 8, "ring", 1024
    elif backend in ("gloo", "nccl"):
        from trainprobes.distributed import run_collective as probe
        family, default_world, default_algorithm, default_numel = "distributed", 4, None, 4096
    else:
        raise ConfigError(f"{where} backend={backend!r} must be 'emulated', 'gloo' or 'nccl'")
    kwargs = probe_kwargs(entry, "collectives", where, probe)

    def measure(world, dtype, algorithm):
        args = dict(world=int(world), dtype=dtype, algorithm=algorithm, op=entry.get("op", "sum"),
                    numel=int(entry.get("numel", default_numel)))
        if backend == "emulated":
            from trainprobes.audit.families import bias_result
            return bias_result(probe(**args, **{"seed": seed, **kwargs}))
        return probe(backend=backend, **args, **{"seed": seed, "data": "gradient", **kwargs})

    checks = []
    for world in _listed(entry, "world", default_world):
        for dtype in _listed(entry, "dtype", "bf16"):
            for algorithm in _listed(entry, "algorithm", default_algorithm):
                # ["bf16", "ring"] emulated; ["gloo", "bf16"] real, in the backend's own order
                parts = ([backend] if backend != "emulated" else []) + [dtype] \
                    + ([algorithm] if algorithm is not None else [])

                def run(world=world, dtype=dtype, algorithm=algorithm, tag=",".join(parts)):
                    r = measure(world, dtype, algorithm)
                    if "name" in entry:
                        r.target = f"{entry['name']}[{tag},w={world}]"
                    return apply_thresholds(r, entry, "collectives")
                checks.append(Check(family, f"all_reduce {' '.join(parts)} w={world}", run))
    return checks


def transform_check(entry: dict, seed: int, where: str) -> Check:
    """[[transforms]]: target = "pkg.mod:step" (a trainprobes.transforms.TrainingStep or a
    function returning one); transform = "fsdp2" (or a list of names, or "fsdp2:reduce_dtype=bf16")
    with options = {...} for every one; world, backend, timeout; the probe's own keys (trials,
    alpha, min_effect, noise_tol, replica_tol). All transforms of an entry run on one set of
    ranks; with one transform the Result's target is `name` (so variants compare in the gate)."""
    from trainprobes.errors import TrainprobesError
    from trainprobes.transforms import Probe, build_transform, parse_transform

    spec = _need(entry, "target", where, '"package.module:step"')
    options = entry.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{where} options={options!r} must be a table, e.g. {{ reduce_dtype = 'bf16' }}")
    kwargs = probe_kwargs(entry, "transforms", where, Probe)
    try:
        transforms = [build_transform(t, options) if ":" not in t else parse_transform(t)
                      for t in _listed(entry, "transform", "ddp")]
    except (TrainprobesError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where} transform: {e}") from None
    world, name = _int(entry, "world", where, 2), entry.get("name", spec)
    backend, timeout = entry.get("backend", "gloo"), entry.get("timeout", 600.0)

    def run():
        from trainprobes.transforms import run_probes
        probes = [Probe(spec, t, **{"seed": seed, **kwargs},
                        target=name if len(transforms) == 1 else f"{name}[{t.label}]") for t in transforms]
        out = run_probes(probes, world=world, backend=backend, timeout=timeout)
        for r in out:
            r.evidence["target_spec"] = spec
        return [apply_thresholds(r, entry, "transforms") for r in out]
    return Check("transforms", name, run)


SECTIONS = {"causality": causality_check, "bias": bias_check, "drift": drift_check,
            "collectives": collective_checks, "transforms": transform_check}


def suite_from_config(cfg: dict, *, seed: int = 0, base_dir=Path("."), quick: bool = False):
    """(checks, skipped) for a [tool.trainprobes] table."""
    from trainprobes.audit.suites import default_suite

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
            entry = {**entry, "_base_dir": str(base_dir)} if section == "drift" else entry
            try:
                built = build(entry, int(entry.get("seed", seed)), where)
                checks.extend(built if isinstance(built, list) else [built])
            except ModuleNotFoundError as e:
                skipped[f"{section} #{i}"] = f"probe module {e.name!r} is not installed"
    return checks, skipped
