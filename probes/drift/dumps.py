"""Per-stage dumps: save what an engine's residual stream is at every stage, localise two
engines from their saved dumps (any engine that can write safetensors can bring one).

Format (safetensors; `format` "trainprobes.drift.dump/1" in the metadata):
  input_ids              [B, L] int64: the tokens (both dumps must hold the same ones)
  attention_mask         [B, L] (optional; 1 = real token)
  stage:<name>           [B, L, F] float: the STREAM after stage <name> (module path, e.g.
                         "model.layers.3"), in call order given by metadata "stages"
  stage:<name>:residual  [B, L, F] (only with residual_convention "vllm"): the residual a
                         vLLM layer hands on beside its hidden_states; the stream is
                         stage:<name> + stage:<name>:residual
metadata: "stages" (JSON list of names in call order), "residual_convention" ("stream":
the tensors are the stream already, as HF hands it on; or "vllm"), "engine" (a name),
"dtype" (the engine's nominal dtype, e.g. "bfloat16").

From dumps alone only free-running errors exist (patching needs the modules), so the
verdict is the first DIVERGENT stage: the first whose free error |B - A| / |A| exceeds
margin x the rounding floor u / sqrt(3) (one rounding of every element at the coarser
nominal precision u; or a measured floor: a third dump of the trainer re-run in another
batch composition). Before it every stage agrees to noise, so it is where the divergence
enters; which op inside it is, and what comes after, needs the modules
(trainprobes.drift.decompose.localize).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import UNIT_ROUNDOFF, record, rel_error
from trainprobes.errors import DataFileError, InvalidArgument, MissingDependency

FORMAT = "trainprobes.drift.dump/1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


def _st():
    try:
        import safetensors.torch as st
    except ImportError:
        raise MissingDependency("dumps need safetensors: pip install safetensors") from None
    return st


def dump_tensors(engine: Engine, input_ids, attention_mask=None) -> tuple:
    """(tensors, metadata) of one engine's free run: the stream after every stage."""
    from trainprobes.drift.engines import discover

    ids = torch.as_tensor(input_ids)
    lay = discover(engine, ids, attention_mask)
    blocks = frozenset(s.name for s in lay.stages if s.role == "block")
    rec, _ = record(engine, lay.stages, ids, attention_mask, blocks=blocks)
    B, L = ids.shape
    tensors = {"input_ids": ids.to(torch.int64).contiguous()}
    if attention_mask is not None:
        tensors["attention_mask"] = torch.as_tensor(attention_mask).to(torch.int64).contiguous()
    for s in lay.stages:
        tensors[f"stage:{s.name}"] = rec[s.name][0].out.reshape(B, L, -1).float().contiguous()
    meta = {"format": FORMAT, "stages": json.dumps(lay.names), "residual_convention": "stream",
            "engine": engine.name, "dtype": str(engine.dtype).removeprefix("torch.")}
    return tensors, meta


def save_dump(path, engine: Engine, input_ids, attention_mask=None, *, replace: bool = False):
    """Write the dump of `engine` on these tokens to `path` (atomically, never replacing a
    file unless replace)."""
    from trainprobes.result import write_atomic

    tensors, meta = dump_tensors(engine, input_ids, attention_mask)
    return write_atomic(path, _st().save(tensors, metadata=meta), replace=replace)


@dataclass
class Dump:
    path: str
    stages: list
    streams: dict         # name -> [B, L, F] float64
    input_ids: torch.Tensor
    mask: torch.Tensor
    dtype: torch.dtype


def load_dump(path) -> Dump:
    st = _st()
    try:
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = st.load_file(str(path))
    except (OSError, ValueError, RuntimeError) as e:
        raise DataFileError(f"{str(path)!r} is not a readable safetensors dump ({e})") from None
    if meta.get("format") != FORMAT:
        raise DataFileError(f"{str(path)!r}: metadata format={meta.get('format')!r}, expected {FORMAT!r}")
    try:
        stages = json.loads(meta["stages"])
    except (KeyError, ValueError):
        raise DataFileError(f"{str(path)!r}: metadata 'stages' must be a JSON list of stage names") from None
    conv = meta.get("residual_convention", "stream")
    if conv not in ("stream", "vllm"):
        raise DataFileError(f"{str(path)!r}: residual_convention={conv!r}, expected 'stream' or 'vllm'")
    if "input_ids" not in tensors:
        raise DataFileError(f"{str(path)!r} has no 'input_ids'")
    ids = tensors["input_ids"]
    mask = tensors.get("attention_mask", torch.ones_like(ids)).bool()
    streams = {}
    for name in stages:
        t = tensors.get(f"stage:{name}")
        if t is None:
            raise DataFileError(f"{str(path)!r} lists stage {name!r} but has no tensor 'stage:{name}'")
        r = tensors.get(f"stage:{name}:residual")
        if conv == "vllm" and r is not None:
            t = t.double() + r.double()
        t = t.double()
        if t.shape[:2] != ids.shape:
            raise DataFileError(f"{str(path)!r}: 'stage:{name}' has shape {tuple(t.shape)}, expected "
                                f"[{ids.shape[0]}, {ids.shape[1]}, F] like input_ids")
        bad = ~torch.isfinite(t[mask])
        if bool(bad.any()):
            raise DataFileError(f"{str(path)!r}: stage {name!r} holds {int(bad.sum())} non-finite values")
        streams[name] = t
    dtype = _DTYPES.get(meta.get("dtype", "float32"), torch.float32)
    return Dump(str(path), stages, streams, ids, mask, dtype)


@dataclass
class DumpStage:
    name: str
    free_error: float
    noise_floor: float
    divergent: bool


def compare_dumps(a: Dump, b: Dump, noise: Dump | None = None, *, margin: float = 8.0) -> list:
    """[DumpStage] in a's stage order (module doc)."""
    if a.input_ids.shape != b.input_ids.shape:
        raise InvalidArgument(f"the dumps hold tokens of different shapes: {a.path!r} "
                              f"{tuple(a.input_ids.shape)}, {b.path!r} {tuple(b.input_ids.shape)}: "
                              "localise on the same tokens")
    if not torch.equal(a.input_ids, b.input_ids):
        n = int((a.input_ids != b.input_ids).sum())
        raise InvalidArgument(f"the dumps hold different tokens ({n} of {a.input_ids.numel()} ids "
                              "differ): both engines must run the same token ids (same tokenizer)")
    missing = [s for s in a.stages if s not in b.streams]
    extra = [s for s in b.stages if s not in a.streams]
    if missing or extra:
        raise InvalidArgument(f"the dumps' stages differ: missing from {b.path!r}: {missing}; only in "
                              f"{b.path!r}: {extra}")
    u = max(UNIT_ROUNDOFF.get(a.dtype, 2.0 ** -24), UNIT_ROUNDOFF.get(b.dtype, 2.0 ** -24))
    m = a.mask & b.mask
    out = []
    for name in a.stages:
        A, B = a.streams[name], b.streams[name]
        if A.shape != B.shape:
            raise InvalidArgument(f"stage {name!r} has shape {tuple(A.shape)} in {a.path!r} and "
                                  f"{tuple(B.shape)} in {b.path!r}")
        free = rel_error(B, A)[m].mean().item()
        floor = u / math.sqrt(3)
        if noise is not None and name in noise.streams:
            floor = math.hypot(floor, rel_error(noise.streams[name], A)[m].mean().item())
        out.append(DumpStage(name, free, floor, free > margin * floor))
    return out
