"""The per-op batch-invariance map of this machine's torch build and device.

Each op runs on a pool of rows at several batch sizes (trainprobes.isolation.batch), in the
manner of batch_invariant_ops' test (`mm(a[:1], b)` vs `mm(a, b)[:1]`, bit for bit): a row
alone against the same row inside batches. One Result per op x shape x dtype, with the
batch sizes at which the op stops being invariant. What the map shows is a fact about this
torch build and device (oneDNN/MKL, cuBLAS, the CPU's vector width), not a bug: an op that
is variant here makes an engine's log-probs depend on the batch a sequence lands in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from trainprobes.isolation.batch import DEFAULT_SIZES, batch_invariance
from trainprobes.reference.formats import get_format
from trainprobes.validation import check_choice

__all__ = ["OpCase", "op_cases", "op_map", "OP_NAMES"]


@dataclass(frozen=True)
class OpCase:
    """One op at one shape: make(generator, rows, dtype, device) -> (pool [rows, ...], fn)."""
    op: str
    shape: str
    make: Callable

    def target(self, dtype: str, device: str) -> str:
        return f"torch.{self.op}[{self.shape},{dtype},{device}]"


def _mm(K, M, kind):
    def make(g, n, dtype, dev):
        x = torch.randn(n, K, generator=g).to(dtype=dtype, device=dev)
        w = torch.randn(K, M, generator=g).to(dtype=dtype, device=dev) / K ** 0.5
        b = torch.randn(M, generator=g).to(dtype=dtype, device=dev)
        if kind == "mm":
            return x, lambda a: torch.mm(a, w)
        if kind == "addmm":
            return x, lambda a: torch.addmm(b, a, w)
        return x, lambda a: F.linear(a, w.t().contiguous(), b)  # a contiguous [M, K] weight
    return make


def _bmm(T, K, M):
    def make(g, n, dtype, dev):
        x = torch.randn(n, T, K, generator=g).to(dtype=dtype, device=dev)
        w = torch.randn(K, M, generator=g).to(dtype=dtype, device=dev) / K ** 0.5
        return x, lambda a: torch.bmm(a, w.expand(a.shape[0], K, M))
    return make


def _rowwise(D, op):
    def make(g, n, dtype, dev):
        x = torch.randn(n, D, generator=g).to(dtype=dtype, device=dev)
        w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype=dtype, device=dev)
        fns = {"softmax": lambda a: torch.softmax(a, -1),
               "log_softmax": lambda a: torch.log_softmax(a, -1),
               "layer_norm": lambda a: F.layer_norm(a, (D,), w, None, 1e-5),
               "rms_norm": lambda a: F.rms_norm(a, (D,), w, 1e-6),
               "sum": lambda a: a.sum(-1), "mean": lambda a: a.mean(-1)}
        return x, fns[op]
    return make


def _sdpa(H, T, d):
    def make(g, n, dtype, dev):
        x = torch.randn(n, 3, H, T, d, generator=g).to(dtype=dtype, device=dev)
        return x, lambda a: F.scaled_dot_product_attention(a[:, 0], a[:, 1], a[:, 2], is_causal=True)
    return make


def _embedding(V, T, D):
    def make(g, n, dtype, dev):
        ids = torch.randint(V, (n, T), generator=g).to(dev)
        table = torch.randn(V, D, generator=g).to(dtype=dtype, device=dev)
        return ids, lambda a: F.embedding(a, table)
    return make


def op_cases(quick: bool = False) -> list[OpCase]:
    """The ops of the map at their shapes; quick keeps the small shapes only."""
    mm_shapes = ((64, 64), (256, 256)) + (() if quick else ((1024, 1024), (4096, 4096)))
    row_dims = (256, 4096) if not quick else (256,)
    cases = []
    for kind in ("mm", "addmm", "linear"):
        cases += [OpCase(kind, f"K={K},N={M}", _mm(K, M, kind)) for K, M in mm_shapes]
    cases += [OpCase("bmm", f"T={T},K={K},N={M}", _bmm(T, K, M))
              for T, K, M in ((16, 64, 64), (16, 512, 512))[:1 if quick else 2]]
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm", "sum", "mean"):
        cases += [OpCase(op, f"D={D}", _rowwise(D, op)) for D in row_dims]
    cases += [OpCase("scaled_dot_product_attention", f"H={H},T={T},d={d}", _sdpa(H, T, d))
              for H, T, d in ((4, 64, 32), (4, 512, 64))[:1 if quick else 2]]
    cases.append(OpCase("embedding", "V=1024,T=16,D=256", _embedding(1024, 16, 256)))
    return cases


OP_NAMES = tuple(dict.fromkeys(c.op for c in op_cases()))


def _as_map_entry(r):
    """A batch_invariance Result as an entry of the machine's map (probe isolation.op_map,
    advisory in result.PROBES): a variant op is a watch-out about this torch build and
    device (warn, TP-I2), not a failure of the user's code; anything else (a
    nondeterministic op, TP-C2) keeps its verdict."""
    r.probe = "isolation.op_map"
    if r.metrics.get("batch_invariant") is False and r.verdict == "fail" and r.codes == ["TP-I2"]:
        r.verdict = "warn"
    return r


def op_map(ops=None, *, dtypes=("fp32", "bf16"), sizes=DEFAULT_SIZES, rows: int = 8,
           trials: int = 3, seed: int = 0, device: str = "cpu", quick: bool = False,
           progress: Callable[[int, int, str], None] | None = None) -> list:
    """One batch-invariance Result per op x shape x dtype on `device`.

    ops: op names to include (default all, see OP_NAMES); dtypes: format names
    (trainprobes.reference.formats); rows: pool rows per op (the batches draw from them).
    progress(done, total, target) is called before each op x shape x dtype.
    """
    names = OP_NAMES if ops is None else tuple(ops)
    for op in names:
        check_choice(op, "ops[...]", OP_NAMES)
    torch_dtypes = [(get_format(d).name, get_format(d).torch_dtype) for d in dtypes]
    cases = [c for c in op_cases(quick) if c.op in names]
    results = []
    for case in cases:
        for label, dt in torch_dtypes:
            target = case.target(label, device)
            if progress is not None:
                progress(len(results), len(cases) * len(torch_dtypes), target)
            g = torch.Generator().manual_seed(seed)
            x, fn = case.make(g, rows, dt, device)
            r = batch_invariance(fn, x, sizes=sizes, trials=trials, seed=seed, target=target)
            r.evidence.update({"op": case.op, "shape": case.shape, "dtype": label, "device": device})
            results.append(_as_map_entry(r))
    return results
