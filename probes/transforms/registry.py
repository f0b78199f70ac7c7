"""Transforms by name, with options from text: what the CLI, the audit and torchrun take.

    parse_transform("fsdp2:param_dtype=bf16,reduce_dtype=bf16")   -> FSDP2(...)
    parse_transform('tp:{"plan": {"1": "colwise", "3": "rowwise"}}') -> TensorParallel(...)
    build_transform("pp", {"schedule": "gpipe", "micro_batches": 4})

Options after the colon are key=value pairs separated by commas (values: none/null, true/false,
integers, numbers, else text; a plan as name:style;name:style; a pipeline split as
a+b|c+d), or one JSON object.
"""
from __future__ import annotations

import dataclasses
import difflib
import json

from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.transforms.context import ContextParallel
from trainprobes.transforms.data_parallel import DDP, Accumulation
from trainprobes.transforms.experts import ExpertParallel
from trainprobes.transforms.pipeline import Pipeline
from trainprobes.transforms.sharded import FSDP2
from trainprobes.transforms.tensor_parallel import TensorParallel
from trainprobes.validation import check_choice

TRANSFORMS = {"ddp": DDP, "accumulation": Accumulation, "fsdp2": FSDP2, "tp": TensorParallel,
              "pp": Pipeline, "cp": ContextParallel, "ep": ExpertParallel}
ALIASES = {"fsdp": "fsdp2", "dp": "ddp", "accum": "accumulation", "ga": "accumulation",
           "pipeline": "pp", "tensor-parallel": "tp", "context-parallel": "cp", "expert-parallel": "ep"}

__all__ = ["TRANSFORMS", "parse_transform", "build_transform"]


def _value(text: str):
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def _special(key: str, text: str):
    if key == "plan" and ":" in text:
        return dict(item.split(":", 1) for item in text.split(";") if item)
    if key == "split" and ("+" in text or "|" in text):
        return [stage.split("+") for stage in text.split("|")]
    return _value(text)


def build_transform(name: str, options: dict | None = None):
    """The transform called name (or an alias) with options, each checked by the class."""
    low = name.strip().lower() if isinstance(name, str) else name
    key = ALIASES.get(low, low)
    check_choice(key, "transform", tuple(TRANSFORMS), hint="see trainprobes.transforms")
    cls = TRANSFORMS[key]
    options = dict(options or {})
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        maybe = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidArgument(f"transform {key!r} has no option {unknown[0]!r}{maybe}; its options: {known}")
    try:
        return cls(**options)
    except TypeError as e:
        raise InvalidType(f"transform {key!r}: {e}") from None


def parse_transform(text: str):
    """name[:options] (module docstring) -> a transform."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"transform={text!r} must name a transform, e.g. 'fsdp2:reduce_dtype=bf16'")
    name, _, rest = text.strip().partition(":")
    rest = rest.strip()
    if rest.startswith("{"):
        def once(pairs):
            keys = [k for k, _ in pairs]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise InvalidArgument(f"transform={text!r} sets {twice[0]!r} twice; give each option once")
            return dict(pairs)
        try:
            options = json.loads(rest, object_pairs_hook=once)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"transform={text!r}: the options are not a JSON object ({e})") from None
        if not isinstance(options, dict):
            raise InvalidArgument(f"transform={text!r}: the options must be a JSON object")
    else:
        options = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise InvalidArgument(f"transform={text!r}: option {item!r} is not key=value, e.g. "
                                      f"'{name}:micro_batches=4'")
            if key.strip() in options:
                raise InvalidArgument(f"transform={text!r} sets {key.strip()!r} twice; give each "
                                      f"option once (for two variants, pass two --transform)")
            options[key.strip()] = _special(key.strip(), value)
    return build_transform(name.strip(), options)
