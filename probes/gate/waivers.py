"""The gate's waivers: a code, a target (exact, or an fnmatch pattern that names something)
and a reason, with an expiry; read from TOML ([[waiver]] tables) or JSON. docs/gate.md,
"Waivers"."""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date
from fnmatch import fnmatchcase
from pathlib import Path

from trainprobes.errors import CannotJudge
from trainprobes.result import CODES, strict_json


@dataclass(frozen=True)
class Waiver:
    code: str
    target: str
    reason: str
    expires: date

    def matches(self, code: str, result_key: str, target: str) -> bool:
        # Equality first: targets like "all_reduce[bf16,ring]" hold fnmatch's [...] classes.
        return code == self.code and (self.target in (target, result_key)
                                      or fnmatchcase(target, self.target)
                                      or fnmatchcase(result_key, self.target))


def waiver_dict(w: Waiver) -> dict:
    return {"code": w.code, "target": w.target, "reason": w.reason,
            "expires": w.expires.isoformat()}


def parse_waivers(doc, source: str = "waivers") -> list[Waiver]:
    """Waivers from a parsed document: {"waiver": [{code, target, reason, expires}, ...]}.

    A bare list of waiver objects is accepted too. Every field is required: a waiver
    without an expiry is a permanent hole in the gate.
    """
    if isinstance(doc, dict):
        items = doc.get("waiver", doc.get("waivers"))
        if items is None:
            raise ValueError(f"{source}: expected a [[waiver]] table list (TOML) or "
                             f'{{"waivers": [...]}} (JSON), found keys {sorted(doc)!r}')
    else:
        items = doc
    if not isinstance(items, list):
        raise ValueError(f"{source}: waivers={items!r} must be a list of tables")
    out = []
    for i, w in enumerate(items):
        where = f"{source}: waiver[{i}]"
        if not isinstance(w, dict):
            raise ValueError(f"{where}={w!r} must be a table with code, target, reason, expires")
        missing = [k for k in ("code", "target", "reason", "expires") if not w.get(k)]
        if missing:
            raise ValueError(f"{where} is missing {missing!r}; every waiver needs code, "
                             "target, reason and expires (YYYY-MM-DD)")
        if w["code"] not in CODES:
            raise ValueError(f"{where} code={w['code']!r} is not a known code; "
                             f"known: {', '.join(sorted(CODES))}")
        if not _names_something(str(w["target"])):
            raise ValueError(f"{where} target={w['target']!r} matches every target: a waiver "
                             "names what it excuses (an exact target or a pattern with a name "
                             "in it, e.g. 'all_reduce[bf16*')")
        exp = w["expires"]
        if isinstance(exp, str):
            try:
                exp = date.fromisoformat(exp)
            except ValueError:
                raise ValueError(f"{where} expires={w['expires']!r} is not a date; "
                                 "write YYYY-MM-DD") from None
        if not isinstance(exp, date):
            raise ValueError(f"{where} expires={exp!r} is not a date; write YYYY-MM-DD")
        if hasattr(exp, "date"):  # a TOML datetime: keep the day
            exp = exp.date()
        out.append(Waiver(str(w["code"]), str(w["target"]), str(w["reason"]), exp))
    return out


def _names_something(pattern: str) -> bool:
    """Whether a waiver's target holds a letter or digit outside fnmatch's wildcards and
    [...] classes. "*:*", "*.*", "*::*" or "[a-z]*" name nothing, yet match every
    probe::target key (Waiver.matches tries the key too), so they would excuse anything.
    Without * or ? it is a name (a target may be "[x]") and matches one length only."""
    if "*" not in pattern and "?" not in pattern:
        return bool(pattern.strip())
    return any(ch.isalnum() for ch in re.sub(r"\[!?\]?[^\]]*\]|[*?]", "", pattern))


def load_waivers(path) -> list[Waiver]:
    """Read waivers from a .toml or .json file. Raises CannotJudge when it cannot."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CannotJudge(f"waivers file {str(path)!r} cannot be read: {e}") from e
    try:
        if path.suffix == ".json":
            doc = strict_json(text)
        else:
            from trainprobes import _toml
            doc = _toml.loads(text)
    except Exception as e:  # json.JSONDecodeError, DuplicateKeys, TOMLDecodeError
        raise CannotJudge(f"waivers file {str(path)!r} is not valid "
                          f"{'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from e
    try:
        return parse_waivers(doc, source=str(path))
    except ValueError as e:
        raise CannotJudge(str(e)) from e
