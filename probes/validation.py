"""Argument checks, one way, in the manner of hypothesis' internal/validation.py.

Each check names the argument, shows the value with !r and says what would work:

    >>> check_int(0, "world", min=1, hint="the number of ranks")
    InvalidArgument: world=0 must be an int >= 1 (the number of ranks)

and returns the value (normalised: an int for check_int, a float for check_number) so a
caller can write `world = check_int(world, "world", min=1)`. The parse_* factories turn the
same checks into argparse `type=` callables (as pytest-benchmark's parse_* helpers), so a
command line refuses a bad option before any work, with argparse's usage line and exit 2.

Imports nothing of trainprobes but its errors: reference/ and the probes both use it.
"""
from __future__ import annotations

import argparse
import difflib
import math
import operator
from collections.abc import Callable, Iterable, Mapping

from trainprobes.errors import InvalidArgument, InvalidType

__all__ = ["check_type", "check_int", "check_number", "check_choice", "check_bool",
           "check_seed", "check_tensor", "parse_int", "parse_number", "parse_choice", "parse_with"]


def _named(name: str, value) -> str:
    return f"{name}={value!r}"


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return ""


def _suffix(hint: str | None) -> str:
    return f" ({hint})" if hint else ""


def check_type(types, value, name: str, *, hint: str | None = None):
    """value must be an instance of types (a bool is never accepted as an int)."""
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        what = " or ".join(t.__name__ for t in types)
        raise InvalidType(f"{_named(name, value)} must be {what}, not "
                          f"{type(value).__name__}{_suffix(hint)}")
    return value


def check_int(value, name: str, *, min: int | None = None, max: int | None = None,
              hint: str | None = None) -> int:
    """An integer (numpy and torch integer scalars too; never a bool or a float) in [min, max]."""
    if isinstance(value, bool) or isinstance(value, float):
        ok = False
    else:
        try:
            value = operator.index(value)
            ok = True
        except TypeError:
            ok = False
    bounds = _bounds(min, max, False, False)
    want = f"an int{' ' + bounds if bounds else ''}"
    if not ok:
        raise InvalidArgument(f"{_named(name, value)} must be {want}{_suffix(hint)}")
    if (min is not None and value < min) or (max is not None and value > max):
        raise InvalidArgument(f"{_named(name, value)} must be {want}{_suffix(hint)}")
    return value


def check_number(value, name: str, *, min: float | None = None, max: float | None = None,
                 min_open: bool = False, max_open: bool = False, finite: bool = True,
                 hint: str | None = None) -> float:
    """A real number (int or float; never a bool), finite unless finite=False, in the bounds.

    NaN is always refused: it compares false with every bound and would pass them silently.
    """
    bounds = _bounds(min, max, min_open, max_open)
    want = f"a {'finite ' if finite else ''}number{' ' + bounds if bounds else ''}"
    if isinstance(value, bool):
        raise InvalidArgument(f"{_named(name, value)} must be {want}{_suffix(hint)}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{_named(name, value)} must be {want}{_suffix(hint)}") from None
    if (math.isnan(x) or (finite and math.isinf(x))
            or (min is not None and (x <= min if min_open else x < min))
            or (max is not None and (x >= max if max_open else x > max))):
        raise InvalidArgument(f"{_named(name, value)} must be {want}{_suffix(hint)}")
    return x


def check_bool(value, name: str, *, hint: str | None = None) -> bool:
    """True or False exactly (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise InvalidType(f"{_named(name, value)} must be True or False{_suffix(hint)}")
    return value


def check_choice(value, name: str, choices: Iterable, *, hint: str | None = None,
                 spellings: Mapping | None = None, normalise: Callable[[str], str] | None = None):
    """One of choices; the message suggests the closest when it looks like a typo.

    spellings: other accepted spellings -> the choice each stands for (keys in the form
    normalise gives, when given); value may be one of them, and the did-you-mean searches
    them too, so 'flaot16' suggests 'fp16' through 'float16'. Returns the choice meant.
    """
    choices = tuple(choices)
    spellings = spellings or {}
    key = normalise(str(value)) if normalise is not None and isinstance(value, str) else value
    try:
        if value in choices:
            return value
        if key in spellings:
            return spellings[key]
    except TypeError:  # an unhashable value against a set, say
        pass
    close = difflib.get_close_matches(str(key), [str(c) for c in choices] + list(spellings), n=1)
    meant = spellings.get(close[0], close[0]) if close else None
    maybe = f"; did you mean {meant!r}?" if close else ""
    # a short name for a family ('h200' for the h200-* presets): the choices it begins
    starts = [str(c) for c in choices if str(key) and str(c).startswith(str(key))]
    if starts:
        maybe = f"; did you mean {' or '.join(map(repr, starts))}?"
    raise InvalidArgument(f"{_named(name, value)} must be one of {choices!r}{maybe}{_suffix(hint)}")


# torch.Generator.manual_seed takes any int in [-2**63, 2**64); outside it torch raises
# "Overflow when unpacking long long" deep inside a run.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


def check_seed(value, name: str = "seed", *, hint: str | None = None) -> int:
    """An int a torch.Generator accepts as its seed (numpy/torch integer scalars too)."""
    hint = hint or "a torch.Generator seed"
    value = check_int(value, name, hint=hint)
    if not SEED_MIN <= value <= SEED_MAX:
        raise InvalidArgument(f"{_named(name, value)} is out of range: must be an int in "
                              f"[-2**63, 2**64){_suffix(hint)}")
    return value


_KINDS = {
    "floating": ("a floating-point", lambda t: t.is_floating_point()),
    "integer": ("an integer", lambda t: not (t.is_floating_point() or t.is_complex()
                                             or t.dtype == _torch().bool)),
    "real": ("a real (floating-point or integer)", lambda t: not (t.is_complex()
                                                                  or t.dtype == _torch().bool)),
}


def _torch():
    import torch  # imported here: a test session without probes must not pay for torch
    return torch


def check_tensor(value, name: str, *, kind: str | None = None, ndim: int | None = None,
                 shape: tuple | None = None, like: tuple | None = None,
                 hint: str | None = None):
    """A torch.Tensor of a kind ("floating", "integer", "real") with ndim dims or exactly
    `shape` (None entries are free: (None, None, 8) is [B, T, 8]).

    like=(tensor, its name): the same shape, dtype and device as that tensor, as in
    "inputs[3] has shape (7,), expected (8,) like inputs[0]". A value that is not a
    tensor, or of the wrong kind of dtype, raises InvalidType; a wrong shape, dtype or
    device next to `like` raises InvalidArgument.
    """
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise InvalidType(f"{name} has type {type(value).__name__}, expected a torch.Tensor"
                          f"{_suffix(hint)}")
    if kind is not None:
        what, ok = _KINDS[check_choice(kind, "kind", _KINDS)]
        if not ok(value):
            raise InvalidType(f"{name} has dtype {value.dtype}, expected {what} tensor"
                              f"{_suffix(hint)}")
    got = tuple(value.shape)
    if ndim is not None and value.dim() != ndim:
        raise InvalidArgument(f"{name} has shape {got}, expected {ndim} dimensions"
                              f"{_suffix(hint)}")
    if shape is not None and (len(got) != len(shape)
                              or any(w is not None and g != w for g, w in zip(got, shape))):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + \
            ("," if len(shape) == 1 else "") + ")"
        raise InvalidArgument(f"{name} has shape {got}, expected {want}{_suffix(hint)}")
    if like is not None:
        other, other_name = like
        for attr, show in (("shape", tuple), ("dtype", str), ("device", str)):
            if getattr(value, attr) != getattr(other, attr):
                raise InvalidArgument(f"{name} has {attr} {show(getattr(value, attr))}, expected "
                                      f"{show(getattr(other, attr))} like {other_name}"
                                      f"{_suffix(hint)}")
    return value


# --- argparse type= callables ----------------------------------------------------------

def parse_with(convert: Callable[[str], object], check: Callable, metavar: str, **kwargs):
    """A `type=` callable: convert the text, then check(value, metavar, **kwargs).

    argparse turns the ArgumentTypeError into "argument --world: world=0 must be ..."
    and exit 2, before any work starts.
    """
    def parse(text: str):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            value = text
        try:
            return check(value, metavar, **kwargs)
        except (InvalidArgument, InvalidType) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = metavar  # argparse names the type in some messages
    return parse


def _to_int(text: str) -> int:
    return int(text.strip())


def parse_int(metavar: str, **kwargs):
    """`type=parse_int("world", min=1)`: an integer option checked by check_int."""
    return parse_with(_to_int, check_int, metavar, **kwargs)


def parse_number(metavar: str, **kwargs):
    """`type=parse_number("rel_tol", min=0)`: a real option checked by check_number."""
    return parse_with(float, check_number, metavar, **kwargs)


def parse_choice(metavar: str, choices: Iterable, **kwargs):
    """A choice with the typo hint of check_choice (argparse's own choices= has none)."""
    return parse_with(str, check_choice, metavar, choices=tuple(choices), **kwargs)
