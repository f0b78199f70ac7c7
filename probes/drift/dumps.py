"""Per-stage dumps: save what an engine's residual stream is at every stage, localise two
engines from their saved dumps (any engine that can write safetensors can bring one).

Format (safetensors; `format` "trainprobes.drift.dump/1" in the metadata):
  input_ids              [B, L] int64: the tokens (both dumps must hold the same ones)
  attention_mask         [B, L] (1 = real token; all ones when nothing is padded): required,
                         a missing mask is not guessed
  stage:<name>           [B, L, F] float: the STREAM after stage <name> (module path, e.g.
                         "model.layers.3"), in call order given by metadata "stages"
  stage:<name>:residual  [B, L, F] (residual_convention "vllm", every block): the residual a
                         vLLM decoder layer hands on beside its hidden_states; the stream is
                         stage:<name> + stage:<name>:residual
  router:<name>          [B, L, k] int (optional): the experts router <name> chose per token
  logprobs               [B, L-1] float (optional): the engine's log-prob of token i+1 at i
metadata (all required): "format", "stages" (JSON list of names in call order),
"residual_convention" ("stream": the tensors are the stream already, as HF hands it on; or
"vllm"), "engine" (a name), "dtype" (the engine's nominal dtype, e.g. "bfloat16": it sets the
rounding floor). Under "vllm" a block (a stage whose name ends in ".<index>") without its
":residual" is refused, naming it, and so is a ":residual" under "stream": read the wrong
way, every block differs by the whole residual (nnsight #630).

From dumps alone only free-running errors exist (patching needs the modules), so the
verdict is the first DIVERGENT stage: the first whose free error |B - A| / |A| exceeds
margin x the rounding floor u / sqrt(3) (one rounding of every element at the coarser
nominal precision u; or a measured floor: a third dump of the trainer re-run in another
batch composition). Before it every stage agrees to noise, so it is where the divergence
enters; which op inside it is, and what comes after, needs the modules
(trainprobes.drift.decompose.localize). Routers present in both dumps give the fraction of
tokens whose top-k expert set differs (trainprobes.drift.routing's first figure).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import UNIT_ROUNDOFF, record, rel_error
from trainprobes.drift.routing import sets_differ
from trainprobes.errors import DataFileError, InvalidArgument, MissingDependency

FORMAT = "trainprobes.drift.dump/1"
CONVENTIONS = ("stream", "vllm")
_DTYPES = {str(d).removeprefix("torch."): d for d in UNIT_ROUNDOFF}


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
    routers = [o for ops in lay.ops.values() for o in ops if o.role == "router"]
    rec, logits = record(engine, lay.stages + routers, ids, attention_mask, blocks=blocks)
    B, L = ids.shape
    am = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
    tensors = {"input_ids": ids.to(torch.int64).contiguous(), "attention_mask": am.to(torch.int64).contiguous()}
    rows = call_rows(rec[lay.stages[0].name], ids, engine.name)
    for s in lay.stages:
        tensors[f"stage:{s.name}"] = _by_row([c.out for c in rec[s.name]], rows, s.name, B, L).float().contiguous()
    for r in routers:
        calls = rec.get(r.name) or []
        if calls and all(c.indices is not None for c in calls) and \
                sum(c.indices.shape[0] for c in calls) == B * L:
            tensors[f"router:{r.name}"] = _by_row([c.indices for c in calls], rows, r.name, B, L).to(
                torch.int64).contiguous()
    with torch.no_grad():
        lp = engine.logprobs(logits).double()
    tensors["logprobs"] = lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).float().contiguous()
    meta = {"format": FORMAT, "stages": json.dumps(lay.names), "residual_convention": "stream",
            "engine": engine.name, "dtype": str(engine.dtype).removeprefix("torch.")}
    return tensors, meta


def save_dump(path, engine: Engine, input_ids, attention_mask=None, *, replace: bool = False):
    """Write the dump of `engine` on these tokens to `path` (atomically, never replacing a
    file unless replace)."""
    from trainprobes.result import write_atomic

    tensors, meta = dump_tensors(engine, input_ids, attention_mask)
    return write_atomic(path, _st().save(tensors, metadata=meta), replace=replace)


def call_rows(calls: list, ids: torch.Tensor, who: str) -> list:
    """The rows of input_ids each call of the first stage held: an engine that batches
    internally (a sampler running the batch in parts, in any order) calls every stage once per
    part. Told from the token ids the first stage was called with; an engine whose first stage
    takes none, in more than one call, is refused: its parts cannot be put back in order."""
    B, L = ids.shape
    if len(calls) == 1:
        return [torch.arange(B)]
    used = torch.zeros(B, dtype=torch.bool)
    rows = []
    for c in calls:  # loop over the engine's parts of the batch
        t = next((v for v in c.inputs.values() if not v.is_floating_point() and v.ndim == 2 and v.shape[1] == L),
                 None)
        if t is None:
            raise InvalidArgument(f"the {who} ran the batch in {len(calls)} calls and its first stage takes no "
                                  "token ids [rows, L] to tell which rows each call held: dump a batch it runs "
                                  "in one call")
        same = (t[:, None, :] == ids[None, :, :]).all(-1)   # [rows of the call, B]
        part = []
        for match in same:  # loop over the call's rows: a repeated sequence takes its next copy
            free = (match & ~used).nonzero()
            if not len(free):
                raise InvalidArgument(f"the {who} ran the batch in {len(calls)} calls, and one holds a sequence "
                                      "that is not in input_ids (or more copies of it): its parts cannot be put "
                                      "back in order")
            used[free[0, 0]] = True
            part.append(int(free[0, 0]))
        rows.append(torch.tensor(part, dtype=torch.long))
    if not bool(used.all()):
        raise InvalidArgument(f"the {who}'s {len(calls)} calls held {int(used.sum())} of the {B} rows")
    return rows


def _by_row(parts: list, rows: list, name: str, B: int, L: int) -> torch.Tensor:
    """[B, L, F] from one tensor per call ([rows, L, F] or [rows * L, F]), each put at its rows."""
    if len(parts) != len(rows):
        raise InvalidArgument(f"stage {name!r} was called {len(parts)} times on a batch the first stage took in "
                              f"{len(rows)} calls: the engine does not run each part through every stage")
    if len(parts) == 1:
        return parts[0].reshape(B, L, -1)
    t = [p.reshape(len(r), L, -1) for p, r in zip(parts, rows)]
    full = torch.empty(B, L, t[0].shape[-1], dtype=t[0].dtype)
    for p, r in zip(t, rows):  # loop over the engine's parts of the batch
        full[r] = p
    return full


@dataclass
class Dump:
    path: str
    stages: list
    streams: dict         # name -> [B, L, F] float64
    input_ids: torch.Tensor
    mask: torch.Tensor
    dtype: torch.dtype
    convention: str = "stream"
    routers: dict = None          # name -> [B, L, k] expert ids
    logprobs: torch.Tensor | None = None


def _block_index(name: str) -> bool:
    return name.rpartition(".")[2].isdigit()


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
        stages = None
    if (not isinstance(stages, list) or not stages or not all(isinstance(n, str) for n in stages)
            or len(set(stages)) != len(stages)):
        raise DataFileError(f"{str(path)!r}: metadata stages={meta.get('stages')!r} must be a JSON list of "
                            "distinct stage names in call order, e.g. '[\"model.embed_tokens\", \"model.layers.0\"]'")
    where = repr(str(path))
    conv = meta.get("residual_convention")
    if conv not in CONVENTIONS:
        raise DataFileError(f"{where}: metadata residual_convention={conv!r}; state it, one of {CONVENTIONS} "
                            "('stream': the tensors are the residual stream, as HF hands it on; 'vllm': "
                            "a block's stage:<name> is hidden_states and stage:<name>:residual its residual)")
    name_dtype = meta.get("dtype")
    if name_dtype not in _DTYPES:
        raise DataFileError(f"{where}: metadata dtype={name_dtype!r}; state the engine's nominal dtype, one "
                            f"of {sorted(_DTYPES)} (it sets the rounding floor: not guessed)")
    for key in ("input_ids", "attention_mask"):
        if key not in tensors:
            raise DataFileError(f"{where} has no {key!r}" + (" ([B, L], 1 = real token; all ones when nothing "
                                                             "is padded): a missing mask is not guessed"
                                                             if key == "attention_mask" else ""))
    ids = tensors["input_ids"]
    if ids.ndim != 2 or ids.is_floating_point():
        raise DataFileError(f"{where}: input_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}, expected "
                            "[B, L] integer token ids")
    if tensors["attention_mask"].shape != ids.shape:
        raise DataFileError(f"{where}: attention_mask has shape {tuple(tensors['attention_mask'].shape)}, "
                            f"expected {tuple(ids.shape)} like input_ids")
    mask = tensors["attention_mask"].bool()
    streams = {}
    for name in stages:
        t = tensors.get(f"stage:{name}")
        if t is None:
            raise DataFileError(f"{where} lists stage {name!r} but has no tensor 'stage:{name}'")
        r = tensors.get(f"stage:{name}:residual")
        if conv == "stream" and r is not None:
            raise DataFileError(f"{where}: residual_convention 'stream' but 'stage:{name}:residual' is there: "
                                "a dump in vLLM's convention says residual_convention 'vllm'")
        if conv == "vllm" and r is None and _block_index(name):
            raise DataFileError(f"{where}: residual_convention 'vllm' but block {name!r} has no "
                                f"'stage:{name}:residual': its stream (hidden_states + residual) cannot be "
                                "formed, and hidden_states alone would look divergent at every block")
        if not t.is_floating_point() or r is not None and not r.is_floating_point():
            raise DataFileError(f"{where}: 'stage:{name}' has dtype {t.dtype}"
                                + ("" if r is None else f" and its ':residual' {r.dtype}")
                                + ", expected a float stream")
        t = t.double() if r is None else t.double() + r.double()
        if t.shape[:2] != ids.shape:
            raise DataFileError(f"{str(path)!r}: 'stage:{name}' has shape {tuple(t.shape)}, expected "
                                f"[{ids.shape[0]}, {ids.shape[1]}, F] like input_ids")
        bad = ~torch.isfinite(t[mask])
        if bool(bad.any()):
            raise DataFileError(f"{str(path)!r}: stage {name!r} holds {int(bad.sum())} non-finite values")
        streams[name] = t
    routers = {k[len("router:"):]: v for k, v in tensors.items() if k.startswith("router:")}
    for name, v in routers.items():
        if v.shape[:2] != ids.shape or v.ndim != 3 or v.is_floating_point():
            raise DataFileError(f"{where}: 'router:{name}' has shape {tuple(v.shape)} and dtype {v.dtype}, "
                                f"expected [{ids.shape[0]}, {ids.shape[1]}, k] integer expert ids")
    lp = tensors.get("logprobs")
    if lp is not None and tuple(lp.shape) != (ids.shape[0], ids.shape[1] - 1):
        raise DataFileError(f"{where}: 'logprobs' has shape {tuple(lp.shape)}, expected "
                            f"[{ids.shape[0]}, {ids.shape[1] - 1}] (token i+1 scored at position i)")
    if lp is not None:
        real = mask[:, 1:] & mask[:, :-1]
        bad = not lp.is_floating_point() or bool((lp.isnan() | (lp == float("inf")))[real].any())
        if bad:
            raise DataFileError(f"{where}: 'logprobs' ({lp.dtype}) holds NaN or +inf (or is not float) at a real "
                                "position: a log-prob is finite or -inf (a token the engine cannot emit)")
    return Dump(str(path), stages, streams, ids, mask, _DTYPES[name_dtype], conv, routers,
                None if lp is None else lp.double())


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
    for d in (b,) + (() if noise is None else (noise,)):  # the same inputs, padding included
        if d is not b and (d.input_ids.shape != a.input_ids.shape or not torch.equal(d.input_ids, a.input_ids)):
            raise InvalidArgument(f"the noise dump {d.path!r} holds other tokens than {a.path!r} (shape "
                                  f"{tuple(d.input_ids.shape)} against {tuple(a.input_ids.shape)}): a floor is "
                                  "measured on the same tokens, re-run in another batch composition")
        if not torch.equal(d.mask, a.mask):
            raise InvalidArgument(f"the attention masks of {a.path!r} and {d.path!r} differ at "
                                  f"{int((d.mask != a.mask).sum())} of {a.mask.numel()} positions: the engines "
                                  "must run the same inputs, padding included")
    if not bool(a.mask.any()):
        raise InvalidArgument(f"{a.path!r}: attention_mask holds no real token (all zeros): nothing to judge")
    missing = [s for s in a.stages if s not in b.streams]
    extra = [s for s in b.stages if s not in a.streams]
    if missing or extra:
        raise InvalidArgument(f"the dumps' stages differ: missing from {b.path!r}: {missing}; only in "
                              f"{b.path!r}: {extra}")
    u = max(UNIT_ROUNDOFF[a.dtype], UNIT_ROUNDOFF[b.dtype])
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
            if noise.streams[name].shape != A.shape:
                raise InvalidArgument(f"stage {name!r} has shape {tuple(noise.streams[name].shape)} in the noise "
                                      f"dump {noise.path!r} and {tuple(A.shape)} in {a.path!r}")
            floor = math.hypot(floor, rel_error(noise.streams[name], A)[m].mean().item())
        out.append(DumpStage(name, free, floor, free > margin * floor))
    return out


def dump_routing(a: Dump, b: Dump) -> dict:
    """router name -> fraction of real tokens whose top-k expert set differs, for every router
    both dumps hold (compare_dumps checks the tokens first)."""
    out = {}
    m = a.mask & b.mask
    for name in a.routers or {}:
        ib = (b.routers or {}).get(name)
        if ib is None:
            continue
        ia = a.routers[name]
        if ia.shape != ib.shape:
            raise InvalidArgument(f"router {name!r} chose top-{ia.shape[-1]} in {a.path!r} and top-{ib.shape[-1]} "
                                  f"in {b.path!r}: not the same router")
        out[name] = sets_differ(ia, ib)[m].double().mean().item()
    return out
