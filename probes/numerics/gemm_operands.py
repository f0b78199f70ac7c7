"""A user's own GEMM operands from files, never unpickling (`trainprobes gemm --load`).

C = A B^T, A (M, K) and B (N, K), K the reduction axis last in both (numerics.gemm):
  one file   holds both tensors under two names (--a-key, --b-key; default "A", "B");
  two files  hold one operand each: the only tensor in the file, or the one named by the key.
Formats:
  .pt           torch.save of a tensor or a dict of tensors, read with weights_only=True
  .npz          numpy.savez arrays, read with allow_pickle=False (numpy has no bf16 or fp8:
                save those as .pt or .safetensors)
  .safetensors  safetensors tensors (the safetensors package, trainprobes[hf])
Every fault names the file, the key and what works (DataFileError: exit 2).
"""
from __future__ import annotations

import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from trainprobes.datafiles import read_npz
from trainprobes.errors import DataFileError

SUFFIXES = (".pt", ".npz", ".safetensors")
DEFAULT_KEYS = ("A", "B")
# dtypes a tensor core's GEMM takes, as torch names them
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2)


@dataclass(frozen=True)
class Operand:
    """One operand as read: the tensor, and where it came from ("file:key")."""

    tensor: torch.Tensor
    source: str


def _read_pt(path: Path) -> dict:
    try:
        got = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:  # a class or function that weights_only refuses to run
            raise DataFileError(f"{str(path)!r} holds a {found.group(1)} object, which loading would "
                                "have to unpickle (refused); torch.save a tensor or a dict of "
                                "tensors") from None
        raise DataFileError(f"{str(path)!r} is not a readable .pt file (not a torch.save archive, or "
                            "truncated); write it with torch.save({'A': a, 'B': b}, path)") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        detail = re.sub(r"\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(e))
        detail = (detail.splitlines() or ["no detail"])[0].split(". ")[0]  # torch's first sentence
        raise DataFileError(f"{str(path)!r} is not a readable .pt file ({type(e).__name__}: "
                            f"{detail}); was it written completely? (torch.save)") from None
    if torch.is_tensor(got):
        return {None: got}
    if isinstance(got, dict):
        return dict(got)
    raise DataFileError(f"{str(path)!r} holds a {type(got).__name__}; expected a tensor or a dict "
                        "of named tensors (torch.save({'A': a, 'B': b}, path))")


def _read_npz(path: Path) -> dict:
    arrays = read_npz(path, "numpy.savez(path, A=a, B=b)")
    out = {}
    for k, v in arrays.items():
        if v.dtype.kind not in "fiub":  # bf16 / fp8 saved through ml_dtypes read back as void
            raise DataFileError(f"{str(path)!r}: array {k!r} has numpy dtype {v.dtype}, not a "
                                "number numpy knows (numpy has no bf16 or fp8: save those with "
                                "torch.save as .pt, or as .safetensors)")
        out[k] = torch.from_numpy(v)
    return out


def _read_safetensors(path: Path) -> dict:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise DataFileError(f"{str(path)!r}: reading .safetensors needs the safetensors package "
                            "(pip install 'trainprobes[hf]'), or save as .pt or .npz") from None
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types (SafetensorError)
        raise DataFileError(f"{str(path)!r} is not a readable .safetensors file ({e}); was it "
                            "written completely? (safetensors.torch.save_file)") from None


def read_tensors(path) -> dict:
    """Every tensor in the file: {name: tensor} ({None: t} for a .pt holding a bare tensor)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataFileError(f"{str(path)!r} has suffix {suffix or '(none)'!r}; expected one of "
                            f"{', '.join(SUFFIXES)}")
    if not path.is_file():
        raise DataFileError(f"{str(path)!r} does not exist" if not path.exists() else
                            f"{str(path)!r} is not a file")
    return {".pt": _read_pt, ".npz": _read_npz, ".safetensors": _read_safetensors}[suffix](path)


def _pick(path: str, tensors: dict, key: str | None, flag: str, one_file: bool) -> Operand:
    names = [k for k in tensors if k is not None]
    if key is None:  # a file per operand, no key named: its only tensor
        if len(tensors) == 1:
            (k, t), = tensors.items()
            return _check(Operand(t, path if k is None else f"{path}:{k}"))
        raise DataFileError(f"{path!r} holds {len(tensors)} tensors ({', '.join(map(repr, names))}); "
                            f"name the operand's with {flag}")
    if key not in tensors:
        held = ", ".join(map(repr, names)) if names else "one unnamed tensor"
        hint = "name them with --a-key and --b-key" if one_file else f"name it with {flag}"
        raise DataFileError(f"{path!r} holds no tensor {key!r} ({flag}); it holds {held}: {hint}")
    return _check(Operand(tensors[key], f"{path}:{key}"))


def _check(op: Operand) -> Operand:
    t = op.tensor
    if not torch.is_tensor(t):
        raise DataFileError(f"{op.source} is a {type(t).__name__}, not a tensor")
    if t.dtype not in FLOATS:
        raise DataFileError(f"{op.source} has dtype {t.dtype}; expected a floating tensor, one of "
                            f"{', '.join(str(d).removeprefix('torch.') for d in FLOATS)}")
    if t.dim() != 2 or 0 in t.shape:
        raise DataFileError(f"{op.source} has shape {tuple(t.shape)}; expected a non-empty 2-D "
                            "(rows, K) matrix, K the reduction axis")
    finite = torch.isfinite(t.float() if t.element_size() == 1 else t)
    if not bool(finite.all()):
        first = tuple(int(i) for i in torch.nonzero(~finite)[0])
        raise DataFileError(f"{op.source} holds {int((~finite).sum())} non-finite value(s), the first "
                            f"at {first}: a GEMM of them has no relative error to judge; find the "
                            "overflow upstream")
    if not bool(t.float().abs().amax() > 0 if t.element_size() == 1 else t.abs().amax() > 0):
        raise DataFileError(f"{op.source} is all zeros: every output is 0, so no relative error "
                            "exists to judge")
    return op


def load_operands(paths, a_key: str | None = None, b_key: str | None = None) -> tuple[Operand, Operand]:
    """(A, B) from one file holding both or from a file per operand (module docstring), each
    checked: a floating 2-D tensor, finite; A and B share K (their last axis)."""
    paths = [str(p) for p in paths]
    if len(paths) not in (1, 2):
        raise DataFileError(f"--load takes one file (A and B in it) or two (one operand each), "
                            f"got {len(paths)}: {paths!r}")
    if len(paths) == 1:
        tensors = read_tensors(paths[0])
        a = _pick(paths[0], tensors, a_key or DEFAULT_KEYS[0], "--a-key", True)
        b = _pick(paths[0], tensors, b_key or DEFAULT_KEYS[1], "--b-key", True)
    else:
        a = _pick(paths[0], read_tensors(paths[0]), a_key, "--a-key", False)
        b = _pick(paths[1], read_tensors(paths[1]), b_key, "--b-key", False)
    if a.tensor.shape[1] != b.tensor.shape[1]:
        raise DataFileError(f"A ({a.source}) has shape {tuple(a.tensor.shape)} and B ({b.source}) "
                            f"{tuple(b.tensor.shape)}: C = A B^T needs the same K, the last axis of "
                            "both (A (M, K), B (N, K)); for a weight gradient dW = dY^T X pass "
                            "A = dY^T (out, tokens) and B = X^T (in, tokens)")
    return a, b
