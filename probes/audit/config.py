"""A user's suite from `[tool.trainprobes]` (pyproject.toml or any TOML file).

Each array-of-tables entry names a target by import path and becomes one Check. Keys the
harness reads are listed per section (HARNESS_KEYS); every other key is passed to the probe
function as a keyword argument, checked against its signature before anything runs, so a
probe's own options and thresholds (alpha, atol, cuts, ...) are configured by their names.
Two generic threshold tables work for every section:
    fail_above = { metric = limit, ... }   fail when a metric exceeds its limit
    fail_below = { metric = limit, ... }   fail when a metric is under its limit
Every value is checked before anything runs: limits name a metric the section's probe
documents (trainprobes.result.PROBES) and are numbers; sizes are positive ints; dtypes are
format names; a backend that cannot run what is asked is refused, never emulated instead.
`name` labels the Result (its target). A Result's key (probe::target) leaves out what a
change varies (dtype, algorithm, world, rounding: those are in its metrics and evidence),
so two variants of a change compare in the gate; an entry that lists several values of an
axis gets them in its targets. See docs/audit.md for the complete schema with an example.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

from trainprobes import _toml
from trainprobes.audit.run import Check
from trainprobes.audit.thresholds import apply_thresholds, check_thresholds
from trainprobes.errors import ConfigError, InvalidArgument, InvalidType
from trainprobes.validation import check_bool, check_choice, check_int, check_number, check_type

__all__ = ["read_config", "find_config", "suite_from_config", "apply_thresholds", "ConfigError"]

TOP_KEYS = {"seed", "out", "history", "defaults", "families", "pythonpath", "causality",
            "bias", "drift", "collectives", "documents", "batch_invariance",
            "transforms"}
COMMON = {"name", "seed", "fail_above", "fail_below"}
HARNESS_KEYS = {
    "causality": COMMON | {"target", "batch", "seq_len", "vocab", "hidden", "inputs"},
    "bias": COMMON | {"target", "reference", "inputs"},
    "drift": COMMON | {"engine", "train", "infer", "rollouts", "intersect_masks", "_base_dir"},
    "collectives": COMMON | {"world", "dtype", "algorithm", "backend", "op", "numel"},
    "documents": COMMON | {"target", "factory", "lengths", "vocab", "hidden"},
    "batch_invariance": COMMON | {"target", "factory", "inputs", "shape", "vocab"},
    "transforms": COMMON | {"target", "transform", "step", "options", "world", "backend", "timeout"},
}


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


def _need(entry, key, where, example):
    if key not in entry:
        raise ConfigError(f"{where} is missing {key!r}, e.g. {key} = {example}")
    return entry[key]


def _int(entry, key, where, default, min=1):
    try:
        return check_int(entry.get(key, default), f"{where} {key}", min=min)
    except InvalidArgument as e:
        raise ConfigError(str(e)) from None


def _common(entry: dict, where: str) -> None:
    """name is a string, seed an int: checked before anything runs."""
    try:
        if "name" in entry:
            check_type(str, entry["name"], f"{where} name", hint="the Result's target")
        if "seed" in entry:
            check_int(entry["seed"], f"{where} seed", min=0)
    except (InvalidArgument, InvalidType) as e:
        raise ConfigError(str(e)) from None


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
    vocab = _int(entry, "vocab", where, 2, min=2) if "vocab" in entry else None
    hidden = _int(entry, "hidden", where, 1) if "hidden" in entry else None
    from trainprobes.causality import check
    kwargs = probe_kwargs(entry, "causality", where, check)
    check_thresholds(entry, "causality.check", where)
    name = entry.get("name", spec)

    def run():
        import torch
        fn = _load(spec, where, "target")
        g = torch.Generator().manual_seed(seed)
        if "inputs" in entry:
            x = _load(entry["inputs"], where, "inputs")(seed)
        elif vocab is not None:
            x = torch.randint(0, vocab, (batch, T), generator=g)
        else:
            x = torch.randn(batch, T, hidden, generator=g)
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
    check_thresholds(entry, "numerics.bias", where)
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
    check_thresholds(entry, "drift.compare", where)
    intersect = entry.get("intersect_masks", False)
    if not isinstance(intersect, bool):
        raise ConfigError(f"{where} intersect_masks={intersect!r} must be true or false")
    name = entry.get("name", entry.get("engine") or entry.get("rollouts") or entry["train"])
    base = entry.get("_base_dir", ".")

    def run():
        from trainprobes.audit.families import drift_result
        from trainprobes.commands.drift import load_pair
        from trainprobes.drift import load_rollouts
        mask, note = None, ""
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
            train, infer, mask, note = load_pair(Path(base) / entry["train"],
                                                 Path(base) / entry["infer"], intersect=intersect)
        r = compare(train, infer, mask=mask, **kwargs, target=name)
        r.seed = seed
        if note:
            r.evidence["masks"] = note
            r.message += f"; {note}"
        return apply_thresholds(drift_result(r), entry, "drift")
    return Check("drift", name, run)


def _listed(entry, key, default):
    v = entry.get(key, default)
    return list(v) if isinstance(v, (list, tuple)) else [v]


def collective_checks(entry: dict, seed: int, where: str) -> list[Check]:
    """[[collectives]]: every combination of world x dtype x algorithm. backend "emulated"
    (the default): the emulated all_reduce against the fp64 reference on gradient-like data;
    "gloo" or "nccl": the real collective on local ranks (one launch each), against fp64 and
    the emulator bit for bit.

    Targets are `name` (default "all_reduce") plus only the axes the entry lists more than
    one value of: changing dtype = "fp32" to "bf16" between two audits keeps the key, so the
    gate compares the two; dtype, algorithm and world stay in each Result's metrics/evidence."""
    from trainprobes.commands.options import check_dtype
    from trainprobes.reference.collectives import OPS
    from trainprobes.reference.schedules import ALGORITHMS

    backend = entry.get("backend", "emulated")
    try:
        check_choice(backend, f"{where} backend", ("emulated", "gloo", "nccl"))
        op = check_choice(entry.get("op", "sum"), f"{where} op", OPS)
    except InvalidArgument as e:
        raise ConfigError(str(e)) from None
    if backend == "emulated":
        from trainprobes.numerics.bias import collective_bias as probe
        family, default_world, default_algorithm, default_numel = "collectives", 8, "ring", 1024
        probe_name, dtypes = "numerics.bias", None
    else:
        from trainprobes.distributed import run_collective as probe
        from trainprobes.distributed.inputs import DTYPES
        family, default_world, default_algorithm, default_numel = "distributed", 4, None, 4096
        probe_name, dtypes = "distributed.collective", list(DTYPES)
        if backend == "nccl":
            import torch
            if not torch.cuda.is_available():
                raise ConfigError(f"{where} backend = 'nccl' needs CUDA GPUs and "
                                  "torch.cuda.is_available() is False here; use backend = "
                                  "'gloo' (CPU ranks) or 'emulated'")
    kwargs = probe_kwargs(entry, "collectives", where, probe)
    check_thresholds(entry, probe_name, where)
    numel = _int(entry, "numel", where, default_numel)
    try:
        worlds = [check_int(w, f"{where} world", min=2, hint="a collective of one rank "
                            "moves nothing") for w in _listed(entry, "world", default_world)]
        names = [check_dtype(d, f"{where} dtype", allowed=dtypes,
                             hint=None if dtypes is None else f"backend {backend!r} cannot "
                             "reduce it (gloo has no float8); use backend = 'emulated'")
                 for d in _listed(entry, "dtype", "bf16")]
        algorithms = [a if a is None else check_choice(a, f"{where} algorithm", ALGORITHMS)
                      for a in _listed(entry, "algorithm", default_algorithm)]
    except (InvalidArgument, InvalidType) as e:
        raise ConfigError(str(e)) from None
    varies = {"dtype": len(names) > 1, "algorithm": len(algorithms) > 1, "world": len(worlds) > 1}

    def measure(world, dtype, algorithm):
        args = dict(world=world, dtype=dtype, algorithm=algorithm, op=op, numel=numel)
        if backend == "emulated":
            from trainprobes.audit.families import bias_result
            return bias_result(probe(**args, **{"seed": seed, **kwargs}))
        return probe(backend=backend, **args, **{"seed": seed, "data": "gradient", **kwargs})

    checks = []
    for world in worlds:
        for dtype in names:
            for algorithm in algorithms:
                # what ran, for the label; what this entry varies, for the key
                ran = ([backend] if backend != "emulated" else []) + [dtype] \
                    + ([algorithm] if algorithm is not None else [])
                tag = ",".join([dtype] * varies["dtype"] + [algorithm] * varies["algorithm"]
                               + [f"w={world}"] * varies["world"])
                target = entry.get("name", "all_reduce") + (f"[{tag}]" if tag else "")

                def run(world=world, dtype=dtype, algorithm=algorithm, target=target):
                    r = measure(world, dtype, algorithm)
                    r.evidence["variant"] = r.target  # the probe's own, full description
                    r.target = target
                    return apply_thresholds(r, entry, "collectives")
                checks.append(Check(family, f"all_reduce {' '.join(ran)} w={world}", run))
    return checks


def _isolation_fn(entry, seed, where):
    """The entry's target: target = "pkg:fn" as it is, or factory = "pkg:make" called with
    the seed (a model factory)."""
    if ("target" in entry) == ("factory" in entry):
        raise ConfigError(f"{where} needs exactly one of target = 'pkg:fn' or factory = "
                          f"'pkg:make' (make(seed) -> the target)")
    if "target" in entry:
        return _load(entry["target"], where, "target")
    return _load(entry["factory"], where, "factory")(seed)


def documents_check(entry: dict, seed: int, where: str) -> Check:
    """[[documents]]: a packed target fn(tokens, packing) -> per-token outputs (target =, or
    factory = "pkg:make" with make(seed) -> target); lengths = [10, 12, 8] (or one list per
    row); token ids from vocab = V, or hidden = D floats (trainprobes.isolation.documents)."""
    from trainprobes.isolation import Packing, documents

    spec = entry.get("target") or _need(entry, "factory", where, '"package.module:make_model"')
    packing = Packing.of(_need(entry, "lengths", where, "[10, 12, 8]"))
    if ("vocab" in entry) == ("hidden" in entry):
        raise ConfigError(f"{where} needs exactly one of vocab = <int> (token ids) or hidden = <int>")
    kwargs = probe_kwargs(entry, "documents", where, documents)
    check_thresholds(entry, "isolation.documents", where)
    size = _int(entry, "vocab" if "vocab" in entry else "hidden", where, 2 if "vocab" in entry else 1)
    name = entry.get("name", spec)

    def run():
        import torch
        fn = _isolation_fn(entry, seed, where)
        g = torch.Generator().manual_seed(seed)
        shape = (packing.batch, packing.length)
        x = (torch.randint(0, size, shape, generator=g) if "vocab" in entry
             else torch.randn(*shape, size, generator=g))
        vocab = entry.get("vocab")
        r = documents(fn, x, packing, **{"seed": seed, "vocab": vocab, **kwargs, "target": name})
        r.evidence["target_spec"] = spec
        return apply_thresholds(r, entry, "documents")
    return Check("isolation", name, run)


def batch_invariance_check(entry: dict, seed: int, where: str) -> Check:
    """[[batch_invariance]]: a row-wise target fn(rows [b, ...]) -> [b, ...] (target =, or
    factory = "pkg:make"); rows from inputs = "pkg:make_inputs" (make(seed) -> [N, ...]), or
    random: shape = [N, D, ...] floats, or with vocab = V token ids [N, L]
    (trainprobes.isolation.batch_invariance: a variant target fails with TP-I2)."""
    from trainprobes.isolation import batch_invariance

    spec = entry.get("target") or _need(entry, "factory", where, '"package.module:make_layer"')
    kwargs = probe_kwargs(entry, "batch_invariance", where, batch_invariance)
    check_thresholds(entry, "isolation.batch_invariance", where)
    vocab = _int(entry, "vocab", where, 2, min=2) if "vocab" in entry else None
    shape = entry.get("shape", [8, 256])
    if not (isinstance(shape, list) and shape and all(isinstance(n, int) and n >= 1 for n in shape)):
        raise ConfigError(f"{where} shape={shape!r} must be a list of positive integers, e.g. [8, 256]")
    name = entry.get("name", spec)

    def run():
        import torch
        fn = _isolation_fn(entry, seed, where)
        g = torch.Generator().manual_seed(seed)
        if "inputs" in entry:
            x = _load(entry["inputs"], where, "inputs")(seed)
        elif "vocab" in entry:
            x = torch.randint(0, vocab, tuple(shape[:2]), generator=g)
        else:
            x = torch.randn(*shape, generator=g)
        r = batch_invariance(fn, x, **{"seed": seed, **kwargs, "target": name})
        r.evidence["target_spec"] = spec
        return apply_thresholds(r, entry, "batch_invariance")
    return Check("isolation", name, run)


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
    check_thresholds(entry, "transforms.equivalence", where)
    try:
        transforms = _user_steps(entry, options, where) if "step" in entry else [
            build_transform(t, options) if ":" not in t else parse_transform(t)
            for t in _listed(entry, "transform", "ddp")]
    except (TrainprobesError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where} {'step' if 'step' in entry else 'transform'}: {e}") from None
    try:
        backend = check_choice(entry.get("backend", "gloo"), f"{where} backend", ("gloo", "nccl"))
        timeout = check_number(entry.get("timeout", 600.0), f"{where} timeout", min=0, min_open=True)
    except (InvalidArgument, InvalidType) as e:
        raise ConfigError(str(e)) from None
    world, name = _int(entry, "world", where, 2), entry.get("name", spec)
    try:  # the probe's own keys (trials, alpha, ...) are checked now, not after ranks start
        probes = [Probe(spec, t, **{"seed": seed, **kwargs},
                        target=name if len(transforms) == 1 else f"{name}[{t.label}]") for t in transforms]
    except (InvalidArgument, InvalidType) as e:
        raise ConfigError(f"{where}: {e}") from None

    def run():
        from trainprobes.transforms import run_probes
        out = run_probes(probes, world=world, backend=backend, timeout=timeout)
        for r in out:
            r.evidence["target_spec"] = spec
        return [apply_thresholds(r, entry, "transforms") for r in out]
    return Check("transforms", name, run)


def _user_steps(entry: dict, options: dict, where: str) -> list:
    """step = "pkg.mod" (or a list): the user's own parallel steps, options = { setup = ...,
    precisions = ["bf16"], param_dtype = ..., partitions = { name = [dim, [ranks]] } }."""
    from trainprobes.transforms.user import UserStep
    if "transform" in entry:
        raise ConfigError(f"{where} has both 'transform' and 'step': one entry probes built-ins "
                          f"or your own step; make two entries")
    known = {"setup": "setup_fn", "precisions": "precisions", "param_dtype": "param_dtype",
             "partitions": "partitions", "title": "title"}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"{where} options has unknown keys {unknown!r} for a step; known: {sorted(known)}")
    kw = {known[k]: v for k, v in options.items()}
    return [UserStep(s, **kw) for s in _listed(entry, "step", None)]


SECTIONS = {"causality": causality_check, "bias": bias_check, "drift": drift_check,
            "collectives": collective_checks, "documents": documents_check,
            "batch_invariance": batch_invariance_check, "transforms": transform_check}


def check_top(cfg) -> None:
    """The [tool.trainprobes] table's own keys and the types of its top-level values, checked
    before anything reads them (a ConfigError naming the key, the value and what works)."""
    top = "[tool.trainprobes]"
    if not isinstance(cfg, dict):
        raise ConfigError(f"{top} must be a table, got {cfg!r}")
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{top} has unknown keys {unknown!r}; known: {sorted(TOP_KEYS)}")
    try:
        if "seed" in cfg:
            check_int(cfg["seed"], f"{top} seed", min=0, hint="e.g. seed = 0; every random "
                      "choice of the suite, recorded in each Result")
        for key in ("out", "history"):
            if key in cfg:
                check_type(str, cfg[key], f"{top} {key}", hint='a folder, e.g. "reports"')
        if "defaults" in cfg:
            check_bool(cfg["defaults"], f"{top} defaults", hint="true also runs the default suite")
        if "families" in cfg:
            fams = cfg["families"]
            for i, name in enumerate(fams if isinstance(fams, list) else [fams]):
                check_type(str, name, f"{top} families" + (f"[{i}]" if isinstance(fams, list) else ""),
                           hint='a list of default-suite families, e.g. ["stall", "reveal"]')
        if "pythonpath" in cfg:
            paths = check_type(list, cfg["pythonpath"], f"{top} pythonpath",
                               hint='a list of folders, e.g. ["src"]')
            for i, p in enumerate(paths):
                check_type(str, p, f"{top} pythonpath[{i}]", hint="a folder, relative to the file")
    except (InvalidArgument, InvalidType) as e:
        raise ConfigError(str(e)) from None


def suite_from_config(cfg: dict, *, seed: int = 0, base_dir=Path("."), quick: bool = False):
    """(checks, skipped) for a [tool.trainprobes] table."""
    from trainprobes.audit.suites import default_suite

    check_top(cfg)
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
            _common(entry, where)
            entry = {**entry, "_base_dir": str(base_dir)} if section == "drift" else entry
            try:
                built = build(entry, int(entry.get("seed", seed)), where)
                checks.extend(built if isinstance(built, list) else [built])
            except ModuleNotFoundError as e:
                skipped[f"{section} #{i}"] = f"probe module {e.name!r} is not installed"
    return checks, skipped
