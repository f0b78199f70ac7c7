"""Read log-probs and rollouts from files, never unpickling.

Formats (fields; * = required):
  .npz          numpy.savez arrays, loaded with allow_pickle=False
  .safetensors  safetensors tensors (safetensors package)
      a log-prob file:  `logprobs`* (or the only array) [N] or [B, T], `mask` (optional)
      a rollout file:   `infer_logprobs`*, `train_logprobs`, `mask`, `token_ids` ([B, T])
  .jsonl        one JSON object per line = one sequence:
      {"token_ids": [int]*, "infer_logprobs": [float]*, "train_logprobs": [float],
       "mask": [0/1 or bool], "prompt_ids": [int]}
      every list as long as token_ids (the completion); rows are padded into [B, T].
Every fault names the file, the record (line or row) and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from trainprobes.datafiles import read_npz
from trainprobes.drift.inputs import POSITIVE_TOLERANCE
from trainprobes.errors import DataFileError

SUFFIXES = (".npz", ".safetensors", ".jsonl")


# A file that cannot be read as log-probs or rollouts; the message says where and why.
DriftFileError = DataFileError


@dataclass
class Rollouts:
    """Sequences from a file: [B, T] tensors padded past each row's length (mask False)."""

    infer_logprobs: torch.Tensor
    mask: torch.Tensor
    train_logprobs: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    prompt_ids: list | None = None
    source: str = ""


def _arrays(path: Path) -> dict:
    if not path.exists():
        raise DriftFileError(f"{str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return read_npz(path)
    if suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise DriftFileError(f"{str(path)!r}: reading .safetensors needs the safetensors package "
                                 f"(pip install safetensors), or save as .npz") from None
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise DriftFileError(f"{str(path)!r} is not a readable .safetensors file: {e}") from None
    raise DriftFileError(f"{str(path)!r} has suffix {suffix!r}; expected one of {SUFFIXES}")


def _check_values(where: str, field: str, lp: np.ndarray, mask: np.ndarray | None) -> None:
    if lp.dtype.kind not in "fiu":
        raise DriftFileError(f"{where}: field {field!r} has dtype {lp.dtype}, expected floats")
    view = lp if mask is None else np.where(mask, lp, -1.0)
    bad = ~np.isfinite(view) | (view > POSITIVE_TOLERANCE)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        rec = f"record {idx[0]}" + (f", position {idx[1]}" if len(idx) > 1 else "")
        raise DriftFileError(f"{where}: {rec}, field {field!r} = {float(lp[idx])!r} is not a log-probability "
                             f"(finite and <= 0); {int(bad.sum())} such entries")


def _mask(where: str, arrays: dict, shape) -> np.ndarray | None:
    if "mask" not in arrays:
        return None
    m = arrays["mask"]
    if m.shape != shape:
        raise DriftFileError(f"{where}: field 'mask' has shape {m.shape}, expected {shape} like the log-probs")
    if m.dtype != bool and not np.isin(m, (0, 1)).all():
        raise DriftFileError(f"{where}: field 'mask' must be boolean or 0/1")
    return m.astype(bool)


def load_logprobs(path) -> tuple:
    """One side's log-probs from .npz/.safetensors: (logprobs tensor, mask tensor or None)."""
    path = Path(path)
    arrays = _arrays(path)
    where = repr(str(path))
    if "logprobs" in arrays:
        field = "logprobs"
    else:
        others = [k for k in arrays if k != "mask"]
        if len(others) != 1:
            raise DriftFileError(f"{where}: no field 'logprobs' and {len(others)} other arrays "
                                 f"{others!r}; name the array 'logprobs'")
        field = others[0]
    lp = arrays[field]
    if lp.ndim not in (1, 2) or lp.size == 0:
        raise DriftFileError(f"{where}: field {field!r} has shape {lp.shape}, expected [N] or [B, T]")
    mask = _mask(where, arrays, lp.shape)
    _check_values(where, field, lp, mask)
    return (torch.from_numpy(np.ascontiguousarray(lp, dtype=np.float32)),
            None if mask is None else torch.from_numpy(mask))


def load_rollouts(path) -> Rollouts:
    """Rollouts from .jsonl, .npz or .safetensors (fields in the module doc)."""
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        return _load_jsonl(path)
    arrays = _arrays(path)
    where = repr(str(path))
    if "infer_logprobs" not in arrays:
        raise DriftFileError(f"{where}: missing field 'infer_logprobs' (has {sorted(arrays)!r})")
    infer = arrays["infer_logprobs"]
    if infer.ndim != 2 or infer.size == 0:
        raise DriftFileError(f"{where}: field 'infer_logprobs' has shape {infer.shape}, expected [B, T]")
    mask = _mask(where, arrays, infer.shape)
    _check_values(where, "infer_logprobs", infer, mask)
    out = Rollouts(torch.from_numpy(np.ascontiguousarray(infer, dtype=np.float32)),
                   torch.ones(infer.shape, dtype=torch.bool) if mask is None else torch.from_numpy(mask),
                   source=str(path))
    if "train_logprobs" in arrays:
        train = arrays["train_logprobs"]
        if train.shape != infer.shape:
            raise DriftFileError(f"{where}: field 'train_logprobs' has shape {train.shape}, expected "
                                 f"{infer.shape} like infer_logprobs")
        _check_values(where, "train_logprobs", train, mask)
        out.train_logprobs = torch.from_numpy(np.ascontiguousarray(train, dtype=np.float32))
    if "token_ids" in arrays:
        ids = arrays["token_ids"]
        if ids.shape != infer.shape or ids.dtype.kind not in "iu":
            raise DriftFileError(f"{where}: field 'token_ids' has shape {ids.shape} dtype {ids.dtype}, "
                                 f"expected integers of shape {infer.shape}")
        out.token_ids = torch.from_numpy(ids.astype(np.int64))
    return out


def _load_jsonl(path: Path) -> Rollouts:
    if not path.exists():
        raise DriftFileError(f"{str(path)!r} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{str(path)!r} line {line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DriftFileError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise DriftFileError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
            rows.append(_record(where, rec))
    if not rows:
        raise DriftFileError(f"{str(path)!r} has no records")
    with_train = [r["train_logprobs"] is not None for r in rows]
    if any(with_train) and not all(with_train):
        first = with_train.index(not with_train[0]) + 1
        raise DriftFileError(f"{str(path)!r}: field 'train_logprobs' is in some records and not in others "
                             f"(record {first} differs from record 1); give it in all or none")
    B, T = len(rows), max(len(r["token_ids"]) for r in rows)

    def grid(field, dtype, fill):
        g = torch.full((B, T), fill, dtype=dtype)
        for b, r in enumerate(rows):  # loop over records, not elements
            g[b, :len(r[field])] = torch.as_tensor(r[field], dtype=dtype)
        return g

    return Rollouts(infer_logprobs=grid("infer_logprobs", torch.float32, 0.0),
                    mask=grid("mask", torch.bool, False),
                    train_logprobs=grid("train_logprobs", torch.float32, 0.0) if with_train[0] else None,
                    token_ids=grid("token_ids", torch.long, 0),
                    prompt_ids=[r["prompt_ids"] for r in rows] if all(r["prompt_ids"] is not None for r in rows) else None,
                    source=str(path))


def _record(where: str, rec: dict) -> dict:
    for field in ("token_ids", "infer_logprobs"):
        if field not in rec:
            raise DriftFileError(f"{where}: missing field {field!r} (has {sorted(rec)!r})")
    ids = rec["token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise DriftFileError(f"{where}: field 'token_ids' must be a non-empty list of token ids >= 0")
    n = len(ids)
    out = {"token_ids": ids, "prompt_ids": rec.get("prompt_ids")}
    mask = rec.get("mask")
    if mask is None:
        mask = [True] * n
    elif not isinstance(mask, list) or len(mask) != n or not all(v in (0, 1) for v in mask):
        raise DriftFileError(f"{where}: field 'mask' must be a list of {n} values 0/1 or booleans "
                             f"(one per token id)")
    out["mask"] = [bool(v) for v in mask]
    for field in ("infer_logprobs", "train_logprobs"):
        v = rec.get(field)
        if v is None:
            if field == "train_logprobs":
                out[field] = None
                continue
        if not isinstance(v, list) or len(v) != n:
            got = f"{len(v)} values" if isinstance(v, list) else type(v).__name__
            raise DriftFileError(f"{where}: field {field!r} has {got}, expected {n} (one per token id)")
        if any(isinstance(x, (bool, str)) or x is None for x in v):  # json types, not values
            i = next(i for i, x in enumerate(v) if isinstance(x, (bool, str)) or x is None)
            raise DriftFileError(f"{where}: field {field!r}[{i}] = {v[i]!r} is not a number")
        try:
            arr = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise DriftFileError(f"{where}: field {field!r} must be a flat list of numbers") from None
        bad = np.asarray(out["mask"]) & ~(np.isfinite(arr) & (arr <= POSITIVE_TOLERANCE))
        if bad.any():
            i = int(np.argmax(bad))
            raise DriftFileError(f"{where}: field {field!r}[{i}] = {v[i]!r} is not a log-probability "
                                 f"(finite and <= 0)")
        out[field] = v
    return out
