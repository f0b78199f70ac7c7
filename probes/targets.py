"""Load a user's target ("package.module:attr.sub") with errors that name it and say the fix."""
from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any

from trainprobes.errors import TargetError


def _importable(name: str, spec: str, label: str = "target"):
    """The module, or None when `name` (or a parent package) does not exist. A module
    that exists but fails to import (a missing dependency, a SyntaxError) is a TargetError
    saying so, not "cannot be found"."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise TargetError(f"{label}={spec!r}: module {name!r} was found, but importing it "
                          f"failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # the user's module raised while importing
        raise TargetError(f"{label}={spec!r}: module {name!r} was found, but importing it "
                          f"raised {type(e).__name__}: {e}") from e


def _resolve(obj, attr_path: str, spec: str, mod_name: str, label: str = "target"):
    for i, part in enumerate(attr_path.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            have = [a for a in dir(obj) if not a.startswith("_")]
            close = difflib.get_close_matches(part, have, n=3)
            where = mod_name if i == 0 else f"{mod_name}:{'.'.join(attr_path.split('.')[:i])}"
            raise TargetError(f"{label}={spec!r}: {where!r} has no attribute {part!r}"
                              + (f"; did you mean {', '.join(repr(c) for c in close)}?"
                                 if close else f" (it has: {', '.join(have[:8])}"
                                 + (", ..." if len(have) > 8 else "") + ")")) from None
    return obj


def _not_found(spec: str, mod_name: str, label: str = "target") -> TargetError:
    head = mod_name.split(".")[0]
    hint = []
    if mod_name.endswith(".py") or "/" in mod_name or "\\" in mod_name:
        stem = os.path.splitext(mod_name.replace("\\", "/").rsplit("/", 1)[-1])[0]
        hint.append(f"name the module, not the file: e.g. '{stem}:function' run from that "
                    "file's folder")
    elif mod_name.startswith("."):
        hint.append("a relative module name cannot be imported on its own: give its full "
                    "dotted name (package.module)")
    elif os.path.exists(f"{head}.py") or os.path.isdir(head):
        hint.append(f"{head!r} is in the current directory but not on sys.path: run "
                    f"`python -m trainprobes ...` there, or set PYTHONPATH=.")
    else:
        hint.append("it must be importable: install its package (pip install -e .), run "
                    "from the folder that holds it, or add that folder to PYTHONPATH")
    return TargetError(f"{label}={spec!r}: module {mod_name!r} cannot be imported (no such "
                       "module on sys.path); " + "; ".join(hint))


def search_cwd() -> None:
    """Put the current directory first on sys.path, as `python -m` does (a face calls it for
    the user's --target and --step; a library call leaves sys.path alone)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def load_target(spec: str, *, callable_required: bool = True, from_cwd: bool = False,
                label: str = "target") -> Any:
    """Import "package.module:attr[.attr...]" and return the object.

    Without a colon, "package.module.attr" is split at the longest importable module
    ("pkg.mod.Class.method" works too). from_cwd: search the current directory first, as
    `python -m` does (the command line passes it; a library call leaves sys.path alone).
    label: what the messages call spec ("target", "step", "setup").
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TargetError(f"{label}={spec!r} must be 'package.module:function'")
    spec = spec.strip()
    module_part = spec.rpartition(":")[0] or spec
    if "/" in module_part or "\\" in module_part or module_part.startswith("."):
        # a file's path or a relative name: importlib's own errors (a relative import
        # needs a package; a drive letter's colon) say nothing of the fix
        raise _not_found(spec, module_part, label)
    if spec.count(":") > 1:
        raise TargetError(f"{label}={spec!r} must be 'package.module:function'")
    if from_cwd:
        search_cwd()
    if ":" in spec:
        mod_name, _, attr_path = spec.partition(":")
        if not mod_name or not attr_path:
            raise TargetError(f"{label}={spec!r} must be 'package.module:function'")
        module = _importable(mod_name, spec, label)
        if module is None:
            raise _not_found(spec, mod_name, label)
        obj = _resolve(module, attr_path, spec, mod_name, label)
    else:
        parts = spec.split(".")
        if len(parts) < 2:
            raise TargetError(f"{label}={spec!r} must be 'package.module:function' (a module "
                              "and the callable in it)")
        obj = None
        for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            mod_name = ".".join(parts[:i])
            module = _importable(mod_name, spec, label)
            if module is not None:
                obj = _resolve(module, ".".join(parts[i:]), spec, mod_name, label)
                break
        if module is None:
            raise _not_found(spec, parts[0], label)
    if callable_required and not callable(obj):
        raise TargetError(f"{label}={spec!r} is a {type(obj).__name__}, expected a callable"
                          + (" (a module: name the function in it, 'module:function')"
                             if type(obj).__name__ == "module" else ""))
    return obj


def call_target(fn, spec: str, *args, what: str = "calling it", label: str = "target"):
    """fn(*args) for a user's target or factory: whatever the user's code raises is bad usage
    (TargetError, exit 2) naming the target, never an internal error. trainprobes' own
    refusals pass through unchanged."""
    from trainprobes.errors import TrainprobesError
    try:
        return fn(*args)
    except TrainprobesError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: any failure is theirs to fix
        raise TargetError(f"{label}={spec!r}: {what} raised {type(e).__name__}: {e}") from e
