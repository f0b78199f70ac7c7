"""Load a user's target ("package.module:attr.sub") with errors that name it."""
from __future__ import annotations

import importlib
from typing import Any

from trainprobes.errors import TargetError


def load_target(spec: str, *, callable_required: bool = True) -> Any:
    """Import "package.module:attr[.attr...]" and return the object.

    A bare "package.module.attr" is accepted too (split at the last dot).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TargetError(f"target={spec!r} must be 'package.module:function'")
    if ":" in spec:
        mod_name, _, attr_path = spec.partition(":")
    else:
        mod_name, _, attr_path = spec.rpartition(".")
    if not mod_name or not attr_path:
        raise TargetError(f"target={spec!r} must be 'package.module:function'")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise TargetError(f"target={spec!r}: module {mod_name!r} cannot be imported ({e})") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"target={spec!r}: {mod_name!r} has no attribute {attr_path!r}") from None
    if callable_required and not callable(obj):
        raise TargetError(f"target={spec!r} is a {type(obj).__name__}, expected a callable")
    return obj
