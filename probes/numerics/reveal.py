"""Accumulator reveal: what a black-box reduction really does, from crafted inputs.

`fn` takes a 1-D tensor of n values in `dtype` (on `device`) and returns their reduction: a
scalar, or a tensor whose first element is a reduction of all n values (a matmul against
ones, a collective). Nothing else about fn is assumed but these three things:
  A1. its order of additions is a fixed tree that does not depend on the values (no
      sorting, no data-dependent splitting), and it is deterministic;
  A2. zeros are harmless: adding 0 to a partial sum leaves it unchanged;
  A3. x + (-x) == 0 exactly in its accumulator (true of every binary float format).

1. ORDER (FPRev, Xie et al. 2024). Put a big M at i, -M at j and a tiny d everywhere else.
   Every d summed into a partial sum holding +-M before +M meets -M is absorbed; the others
   survive exactly. So fn returns (n - size(subtree joining i and j)) * d: one call per pair
   gives the size of the lowest common subtree of every i, j, and merging by size rebuilds
   the tree. A node that joins more than two subtrees at once is a fused multi-term add
   (tensor cores: Fasi, Higham, Mikaitis and Pranesh 2021).
2. PRECISION. Take two leaves i, j that are summed first (a cherry of the tree) and a leaf
   l outside their subtree: x[i] = 2^(t+s), x[j] = d = 2^t, x[l] = -2^(t+s). The result is d
   while 2^(t+s) + d is exact in the accumulator, i.e. for s <= m_acc mantissa bits, and 0
   at s = m_acc + 1 (d is then half a spacing, a tie, and ties go to the even 2^(t+s)). The
   first s that loses d gives m_acc; if none does within the input format's range, m_acc is
   at least the largest s tried (reported as a lower bound).
3. ROUNDING of the accumulator: with d = 0.75 spacing, round to nearest gives one spacing,
   truncation gives 0.
rounds_per_add: the accumulator is no wider than the output format, so every partial sum
is rounded to the output format (fp16 adds in fp16); otherwise partial sums are wider and
the output is rounded once at the end (CPU torch.sum of fp16 accumulates in fp32).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.reference.formats import Format, get_format
from trainprobes.result import Result
from trainprobes.validation import check_int


def _call(fn, x: torch.Tensor) -> float:
    out = fn(x)
    out = torch.as_tensor(out)
    if out.numel() == 0:
        raise TargetError("fn returned an empty tensor; it must return the reduction of its input")
    return out.reshape(-1)[0].double().item()


def _vector(fmt: Format, n: int, device, fill: float = 0.0, at: dict | None = None) -> torch.Tensor:
    """n values (`fill`, and at[i] at index i), built in float64 on the CPU and converted once:
    every crafted value is exact in fmt, so the conversion is exact on any device, and no
    element-wise write touches a device tensor of a type (fp8) that may lack one."""
    x = torch.full((n,), fill, dtype=torch.float64)
    for i, v in (at or {}).items():
        x[i] = v
    return x.to(device=device, dtype=fmt.torch_dtype or torch.float64)


def _span(fn, fmt: Format, out_fmt: Format, n: int, device, max_exponent=None) -> tuple[int, int]:
    """(t, s): d = 2^t is the smallest power of two that fn returns unchanged on its own (the
    accumulator may flush or underflow below the input format's tiniest value), and 2^(t+s)
    the largest that the input and output formats hold, fn cancels to a finite 0 against its
    negative, and (when given) is at most 2^max_exponent."""
    t = max(fmt.min_exponent - fmt.mantissa_bits, out_fmt.min_exponent - out_fmt.mantissa_bits)
    top = min(math.floor(math.log2(fmt.max_finite)), math.floor(math.log2(out_fmt.max_finite)))
    if max_exponent is not None:
        top = min(top, int(max_exponent))
    while t < top:
        if _call(fn, _vector(fmt, n, device, at={0: 2.0 ** t})) == 2.0 ** t:
            break
        t += 1
    while top > t:
        if _call(fn, _vector(fmt, n, device, at={0: 2.0 ** top, n - 1: -(2.0 ** top)})) == 0.0:
            break
        top -= 1
    if top - t < 2:
        raise TargetError(f"fn keeps no useful range of powers of two (2^{t} .. 2^{top}); "
                         f"max_exponent={max_exponent!r}")
    return t, top - t


def reveal_order(fn: Callable, n: int, *, dtype="fp16", device="cpu", output_dtype=None,
                 max_exponent=None) -> dict:
    """Rebuild fn's summation tree over n inputs (step 1 of the module docstring).

    Returns {"observable", "tree" (nested lists of leaf indices), "sizes" (n x n matrix of
    the subtree size joining i and j), "fan_in" (largest number of children of a node),
    "depth", "shape" (a name: sequential, reverse_sequential, pairwise, strided, tree)}.
    observable is False when no d is ever absorbed: the accumulator is too wide for the
    input format's range to see the order (the tree is then None).
    """
    fmt = get_format(dtype)
    check_int(n, "n", min=3, hint="the length of the crafted vectors")
    out_fmt = _output_format(fn, fmt, n, device, output_dtype)
    t, s = _span(fn, fmt, out_fmt, n, device, max_exponent)
    d, M = 2.0 ** t, 2.0 ** (t + s)
    if n - 2 > 2 ** (out_fmt.mantissa_bits + 1):
        raise InvalidArgument(f"n={n!r} is too large: {n - 2} * d must be exact in the output "
                         f"{out_fmt.name}; use n <= {2 ** (out_fmt.mantissa_bits + 1) + 2}")
    sizes = torch.zeros(n, n, dtype=torch.int64)
    for i in range(n):
        for j in range(i + 1, n):
            out = _call(fn, _vector(fmt, n, device, d, at={i: M, j: -M}))
            if not math.isfinite(out):
                raise TargetError(f"fn returned {out!r} for x[{i}]=2^{t + s}, x[{j}]=-2^{t + s}: its "
                                 f"accumulator overflowed (narrower range than {fmt.name}); pass "
                                 "max_exponent=<k> to keep the crafted values below 2^k")
            sizes[i, j] = sizes[j, i] = round(n - out / d)
    if (sizes + torch.eye(n, dtype=torch.int64) * 2 == 2).all():
        return {"observable": False, "tree": None, "sizes": sizes.tolist(), "fan_in": None,
                "depth": None, "shape": "unobservable"}
    tree, fan_in, depth, consistent = _build_tree(sizes)
    return {"observable": True, "consistent": consistent, "tree": tree, "sizes": sizes.tolist(),
            "fan_in": fan_in, "depth": depth, "shape": _shape(tree, n) if consistent else "inconsistent"}


def _build_tree(sizes: torch.Tensor):
    """Merge leaves by increasing joint-subtree size (union-find); each merge is a node."""
    n = sizes.shape[0]
    parent = list(range(n))
    node = {i: i for i in range(n)}       # component root -> its subtree (nested lists)
    count = {i: 1 for i in range(n)}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    fan_in, consistent = 2, True
    depth = {i: 0 for i in range(n)}
    for s in sorted(set(sizes[sizes > 0].tolist())):
        groups: dict[int, set] = {}
        ii, jj = torch.nonzero(torch.triu(sizes == s, 1), as_tuple=True)
        pairs = [(find(int(a)), find(int(b))) for a, b in zip(ii, jj)]
        # components linked at this size form one node each
        link = {}
        for a, b in pairs:
            if a == b:
                continue
            ra, rb = link.get(a, a), link.get(b, b)
            while link.get(ra, ra) != ra:
                ra = link[ra]
            while link.get(rb, rb) != rb:
                rb = link[rb]
            if ra != rb:
                link[rb] = ra
        for c in {a for p in pairs for a in p}:
            r = c
            while link.get(r, r) != r:
                r = link[r]
            groups.setdefault(r, set()).add(c)
        for members in groups.values():
            if len(members) < 2:
                continue
            members = sorted(members, key=lambda c: min(_leaves(node[c])))
            total = sum(count[c] for c in members)
            consistent &= total == s
            fan_in = max(fan_in, len(members))
            root = members[0]
            new = [node[c] for c in members]
            dep = 1 + max(depth[c] for c in members)
            for c in members[1:]:
                parent[c] = root
            node[root], count[root], depth[root] = new, total, dep
    roots = {find(i) for i in range(n)}
    consistent &= len(roots) == 1
    r = find(0)
    return node[r], fan_in, depth[r], consistent


def _leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else [leaf for c in tree for leaf in _leaves(c)]


def _chain(tree):
    """The order of a left-deep chain (each node adds one leaf), bottom pair first as a set;
    None if the tree is not a chain."""
    added = []
    while isinstance(tree, list):
        if len(tree) != 2:
            return None
        a, b = tree
        if isinstance(a, int) and isinstance(b, int):
            return {a, b}, added[::-1]
        if isinstance(a, int):
            added.append(a)
            tree = b
        elif isinstance(b, int):
            added.append(b)
            tree = a
        else:
            return None
    return None


def _shape(tree, n: int) -> str:
    """A name for common trees: sequential (from k: a ring chunk), pairwise, strided, tree."""
    ch = _chain(tree)
    if ch is not None:
        bottom, rest = ch
        for k in range(n):  # a chain in index order from k, wrapping around
            for step, name in ((1, "sequential"), (-1, "reverse_sequential")):
                want = [(k + step * i) % n for i in range(n)]
                if set(want[:2]) == bottom and want[2:] == rest:
                    return name if k == (0 if step == 1 else n - 1) else f"{name} from {k}"

    widest = max((len(t) for t in _subtrees(tree) if isinstance(t, list)), default=2)
    if widest > 2:  # a fused multi-term add (or a value-dependent order: see the docs)
        return f"fused({widest}-term adds)"

    def balanced(t):
        if isinstance(t, int):
            return True
        ls = [_leaves(c) for c in t]
        sizes = [len(x) for x in ls]
        contiguous = all(sorted(x) == list(range(min(x), max(x) + 1)) for x in ls)
        return contiguous and max(sizes) - min(sizes) <= 1 and all(balanced(c) for c in t)

    if balanced(tree):
        return "pairwise"
    # strided lanes: the first merges join leaves a fixed stride apart
    first = [c for c in _subtrees(tree) if isinstance(c, list) and all(isinstance(x, int) for x in c)]
    strides = {abs(c[1] - c[0]) for c in first if len(c) == 2}
    if len(strides) == 1 and strides != {1}:
        return f"strided({strides.pop()} lanes)"
    return "tree"


def _subtrees(t):
    yield t
    if isinstance(t, list):
        for c in t:
            yield from _subtrees(c)


def _output_format(fn, fmt: Format, n: int, device, output_dtype=None) -> Format:
    """The format fn's result is held in: output_dtype if given, else its torch dtype."""
    if output_dtype is not None:
        return get_format(output_dtype)
    try:
        out = torch.as_tensor(fn(_vector(fmt, n, device, 0.0)))
    except (NotImplementedError, RuntimeError, TypeError) as e:
        raise TargetError(f"fn cannot reduce a {fmt.name} tensor of {n} elements on device={str(device)!r}: "
                         f"{e}") from e
    try:
        return get_format(out.dtype)
    except ValueError:
        return fmt


def reveal_precision(fn: Callable, n: int, *, dtype="fp16", device="cpu", positions=None,
                     output_dtype=None, max_exponent=None) -> dict:
    """Effective accumulator mantissa bits and rounding (steps 2 and 3 of the docstring).

    positions: (i, j, l): i and j summed first, l outside their subtree; default (0, 1, n-1).
    Returns {"mantissa_bits", "lower_bound" (True: at least that many), "rounding",
    "output_format", "trace" (s -> result / d)}.
    """
    fmt = get_format(dtype)
    out_fmt = _output_format(fn, fmt, n, device, output_dtype)
    i, j, l = positions or (0, 1, n - 1)
    t, s_max = _span(fn, fmt, out_fmt, n, device, max_exponent)
    d = 2.0 ** t
    trace, m_acc = {}, None
    for s in range(1, s_max + 1):
        r = _call(fn, _vector(fmt, n, device, at={i: 2.0 ** (t + s), j: d, l: -(2.0 ** (t + s))})) / d
        trace[s] = r
        if not math.isfinite(r):  # the accumulator's range ends here: a lower bound
            s_max = s - 1
            break
        if r != 1.0:
            m_acc = s - 1
            break
    lower = m_acc is None
    if lower:
        m_acc = s_max
    rounding = "unknown"
    if not lower:
        # d = 0.75 spacing of 2^E with E = t' + m_acc + 2 (d = 3 * 2^t'): nearest -> spacing, truncation -> 0
        tp = t
        E = tp + m_acc + 2
        if E <= math.floor(math.log2(fmt.max_finite)):
            r = _call(fn, _vector(fmt, n, device, at={i: 2.0 ** E, j: 3 * 2.0 ** tp, l: -(2.0 ** E)}))
            spacing = 2.0 ** (E - m_acc)
            rounding = "nearest" if r == spacing else "toward_zero" if r == 0 else f"other({r!r})"
    return {"mantissa_bits": m_acc, "lower_bound": lower, "rounding": rounding,
            "output_format": out_fmt.name, "trace": trace}


def reveal(fn: Callable, *, n: int = 16, dtype="fp16", device="cpu", target: str = "callable",
           output_dtype=None, max_exponent=None, expected_mantissa_bits: int | None = None) -> Result:
    """Order, accumulator precision and rounding of a black-box reduction, as a Result.

    output_dtype: the format fn's result holds (default: its torch dtype; pass it when fn
    returns float64 tensors holding narrower values, as trainprobes.reference.collectives does).
    max_exponent: keep crafted values below 2^max_exponent (an accumulator with a narrower
    range than the input format would overflow).
    metrics: accumulator_mantissa_bits (what a gate compares: lower is a regression),
    accumulator_bits_lower_bound, rounds_per_add, rounding, order_shape, fan_in.
    expected_mantissa_bits: if given, fewer bits than this fails with TP-B3.
    """
    fmt = get_format(dtype)
    order = reveal_order(fn, n, dtype=fmt, device=device, output_dtype=output_dtype,
                         max_exponent=max_exponent)
    positions = None
    if order["observable"] and order.get("consistent"):
        cherry = next((c for c in _subtrees(order["tree"])
                       if isinstance(c, list) and sum(isinstance(x, int) for x in c) >= 2), None)
        outside = [k for k in range(n) if cherry is not None and k not in _leaves(cherry)]
        if outside:
            i, j = [x for x in cherry if isinstance(x, int)][:2]
            positions = (i, j, outside[0])
    prec = reveal_precision(fn, n, dtype=fmt, device=device, positions=positions,
                            output_dtype=output_dtype, max_exponent=max_exponent)
    out_fmt = get_format(prec["output_format"])
    m = prec["mantissa_bits"]
    per_add = (not prec["lower_bound"]) and m <= out_fmt.mantissa_bits
    named = {52: "fp64", 23: "fp32", 10: "fp16", 7: "bf16", 3: "fp8 e4m3", 2: "fp8 e5m2"}
    like = named.get(m, f"{m + 1}-bit significand")
    acc = f"at least {m} mantissa bits" if prec["lower_bound"] else f"{m} mantissa bits (like {like})"
    how = (f"rounds to {out_fmt.name} after every add" if per_add else
           f"keeps partial sums wider than the {out_fmt.name} output and rounds once at the end")
    shape = order["shape"]
    msg = f"{fmt.name} inputs: accumulator has {acc}, {how}; order {shape}"
    if prec["rounding"] != "unknown":
        msg += f", accumulator rounds {prec['rounding'].replace('_', ' ')}"
    verdict, codes = "pass", []
    if expected_mantissa_bits is not None and m < expected_mantissa_bits:
        verdict, codes = "fail", ["TP-B3"]
        msg += f"; expected at least {expected_mantissa_bits} bits"
    metrics = {"accumulator_mantissa_bits": m, "accumulator_bits_lower_bound": prec["lower_bound"],
               "rounds_per_add": per_add, "rounding": prec["rounding"], "order_shape": shape,
               "fan_in": order["fan_in"], "n": n, "input_format": fmt.name,
               "output_format": out_fmt.name}
    evidence = {"tree": order["tree"], "sizes": order["sizes"], "precision_trace": prec["trace"],
                "positions": positions, "device": str(device),
                "assumptions": "fixed value-independent order; zeros harmless; x + -x == 0"}
    return Result(probe="numerics.reveal", target=target, verdict=verdict, metrics=metrics,
                  evidence=evidence, codes=codes, message=msg)


# Adapters: a reduction of one 1-D vector, from common kernels and collectives.

def matmul_reduction(width: int = 8):
    """fn(x) = (x as a 1 x n row) @ ones(n, width): each output element reduces all of x."""
    def fn(x):
        return x.reshape(1, -1) @ torch.ones(x.numel(), width, dtype=x.dtype, device=x.device)
    return fn


def scaled_mm_reduction(out_dtype=torch.bfloat16, width: int = 16):
    """fp8 GEMM via torch._scaled_mm (CUDA, sm89+): x (fp8, n a multiple of 16) as row 0 of
    a 16 x n matrix against fp8 ones, unit scales. Untested on CPU (needs a GPU)."""
    def fn(x):
        n = x.numel()
        if n % 16:
            raise InvalidArgument(f"n={n!r}: torch._scaled_mm needs a multiple of 16")
        a = torch.zeros(16, n, dtype=torch.float32, device=x.device)
        a[0] = x.float()  # exact: x holds fp8 values; build in fp32, convert once
        a = a.to(x.dtype)
        b = torch.ones(width, n, dtype=torch.float32, device=x.device).to(x.dtype).t()  # column-major
        one = torch.ones((), dtype=torch.float32, device=x.device)
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype)[0]
    return fn


def collective_reduction(dtype="bf16", **all_reduce_kwargs):
    """fn(x) = all_reduce over len(x) ranks, rank r holding x[r] (trainprobes.reference.collectives);
    pass output_dtype=dtype to reveal(), since the collective returns float64 values."""
    from trainprobes.reference.collectives import all_reduce

    def fn(x):
        ranks = list(x.double().cpu().reshape(-1, 1).unbind(0))
        return all_reduce(ranks, dtype=dtype, **all_reduce_kwargs)[0]
    return fn
