"""Calling a user's router or model: pick its decision (and scores) out of whatever it
returns, check the shape, count the work, and compare decisions.

Errors name the target and say what was expected, in the manner of hypothesis.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from trainprobes.errors import TargetError
from trainprobes.validation import check_choice

Picker = int | str | Callable[[Any], Any] | None


def pick(output: Any, picker: Picker, what: str, name: str) -> torch.Tensor | None:
    """The part of a target's output named by picker: None (the output itself), an index
    into a tuple/list, a key or attribute name, or a callable applied to the output."""
    try:
        if picker is None:
            part = output
        elif callable(picker):
            part = picker(output)
        elif isinstance(picker, int):
            part = output[picker]
        elif isinstance(output, dict):
            part = output[picker]
        else:
            part = getattr(output, picker)
    except (IndexError, KeyError, AttributeError, TypeError) as e:
        raise TargetError(f"target {name!r}: {what}={picker!r} cannot be taken from its output "
                          f"({type(output).__name__}): {e}") from None
    if not isinstance(part, torch.Tensor):
        hint = (f"; it returned a {type(output).__name__}: pass {what}=0 (an index), a name, "
                f"or a callable that picks the tensor (command line: --{what} 0 or a name)"
                if picker is None else "")
        raise TargetError(f"target {name!r}: {what} is a {type(part).__name__}, expected a "
                          f"Tensor[B, T, ...]{hint}")
    return part


class Target:
    """A callable under probe. `__call__(x)` returns (decision, scores or None) with batch and
    position checked, and counts evaluations and tokens.

    layout="flat": fn takes [T, ...] (one sequence, no batch axis) and returns [T, ...]; the
    probe still works with a [1, T, ...] view.
    """

    def __init__(self, fn: Callable, name: str, *, decision: Picker = None, scores: Picker = None,
                 layout: str = "batched"):
        if not callable(fn):
            raise TargetError(f"target {name!r} is a {type(fn).__name__}, expected a callable")
        check_choice(layout, "layout", ("batched", "flat"),
                     hint="'batched': fn takes [B, T, ...]; 'flat': one sequence [T, ...]")
        self.fn, self.name, self.decision, self.scores, self.layout = fn, name, decision, scores, layout
        self.n_evaluations = 0
        self.tokens_evaluated = 0

    def __call__(self, x: torch.Tensor, fn: Callable | None = None):
        B, T = x.shape[:2]
        arg = x[0] if self.layout == "flat" else x
        version = arg._version  # bumped by every in-place op on arg or a view of it
        try:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    out = (fn or self.fn)(arg)
            else:  # the caller has turned it off for a loop of calls
                out = (fn or self.fn)(arg)
        except Exception as e:
            raise TargetError(f"target {self.name!r} raised {type(e).__name__}: {e} "
                              f"(called on {_describe(arg)})") from e
        if arg._version != version:
            # every later comparison would run on changed inputs: a causal target then looks
            # nondeterministic (TP-C2) or leaky, and the caller's tensor is corrupted
            raise TargetError(f"target {self.name!r} modified its input in place (called on "
                              f"{_describe(arg)}); the probe compares calls on the same "
                              f"inputs: clone inside the target, or pass lambda x: fn(x.clone()) (HF MoE "
                              f"blocks scale their input in place for router jitter in training "
                              f"mode: .eval())")
        self.n_evaluations += 1
        self.tokens_evaluated += B * T
        dec = self._shaped(pick(out, self.decision, "decision", self.name), arg, "decision")
        sc = None
        if self.scores is not None:
            sc = self._shaped(pick(out, self.scores, "scores", self.name), arg, "scores")
            if not sc.is_floating_point():
                raise TargetError(f"target {self.name!r}: scores have dtype {sc.dtype}, expected "
                                  f"floating router scores [B, T, E]")
        # decisions are compared on the CPU: small next to the call, and one place for indexing
        return dec.detach().cpu(), (sc.detach().cpu() if sc is not None else None)

    def _shaped(self, t: torch.Tensor, arg: torch.Tensor, what: str) -> torch.Tensor:
        lead = tuple(arg.shape[:1 if self.layout == "flat" else 2])
        if (self.layout == "batched" and t.dim() >= 1 and tuple(t.shape[:2]) != lead
                and t.shape[0] == lead[0] * lead[1]):
            # token-flattened [B*T, ...], as HF Mixtral/DeepSeek MoE blocks return router
            # logits and top-k ids: rows are tokens in (batch, position) order
            t = t.reshape(*lead, *t.shape[1:])
        if tuple(t.shape[:len(lead)]) != lead:
            axes = "[T, ...]" if self.layout == "flat" else "[B, T, ...]"
            extra = ""
            if self.layout == "batched" and t.dim() >= 1 and t.shape[0] != arg.shape[0]:
                extra = f" (the batch size changed from {arg.shape[0]} to {t.shape[0]})"
            raise TargetError(f"target {self.name!r} returned {what} of shape {tuple(t.shape)!r} "
                              f"for input of shape {tuple(arg.shape)!r}{extra}; expected "
                              f"{axes} starting with {lead!r}: one decision per input token")
        return t[None] if self.layout == "flat" else t

    def fp64(self, spec) -> Callable | None:
        """The fp64 twin of the target: spec is a callable (used as given), False (none), or
        None (auto: an nn.Module is copied and cast to float64; a plain function is called on
        float64 inputs). Whether it really ran in fp64 is checked on first use (check.py)."""
        if spec is False:
            return None
        if callable(spec) and spec is not True:
            return spec
        if isinstance(self.fn, torch.nn.Module):
            twin = copy.deepcopy(self.fn).double()
            return lambda x: twin(x.double() if x.is_floating_point() else x)
        return lambda x: self.fn(x.double() if x.is_floating_point() else x)


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} tensor of shape {tuple(x.shape)!r}"


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| in float64, as `differs` sees equality: equal values (infinities
    of one sign included) and NaN beside NaN are 0 apart; NaN beside a number, or an
    infinity beside anything else, is infinitely far (never the largest finite float)."""
    a64, b64 = a.double(), b.double()
    d = (a64 - b64).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    return torch.where((a64 == b64) | (a64.isnan() & b64.isnan()), 0.0, d)


def differs(a: torch.Tensor, b: torch.Tensor, atol: float) -> torch.Tensor:
    """[B, T] bool: where two decision tensors [B, T, ...] differ. Integers and bools exactly,
    floats beyond atol (NaN equals NaN: a NaN that stays a NaN is not a flip)."""
    if a.shape != b.shape:
        raise TargetError(f"decisions changed shape from {tuple(a.shape)!r} to {tuple(b.shape)!r} "
                          f"between calls with the same batch and length")
    d = a != b
    if a.is_floating_point() or b.is_floating_point():
        if atol > 0:
            # beyond atol in float64 (a float32 difference could round to exactly atol)
            a64, b64 = a.double(), b.double()
            d = ((a64 - b64).abs() > atol) | (a64.isnan() != b64.isnan())
        # atol 0: a != b is the same test in the inputs' own dtype (two distinct floats
        # differ in float64 too, equal infinities are equal), at a quarter of the passes;
        # a NaN beside a NaN is no change either way
        d &= (a == a) | (b == b)
    return d.reshape(*d.shape[:2], -1).any(-1) if d.dim() > 2 else d


def differs_each(a: torch.Tensor, b: torch.Tensor, atol: float) -> torch.Tensor:
    """[n] bool: where decision i of a differs from decision i of b (each [n, ...]), as
    `differs` judges one position."""
    return differs(a[:, None], b[:, None], atol)[:, 0]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether differs(a, b, atol) is False everywhere, for any atol, told in one pass without
    allocating (torch.equal: equal values, so a NaN anywhere says no and the caller looks
    closer with differs)."""
    return a.shape == b.shape and torch.equal(a, b)
