"""fail_above / fail_below limits of a user suite: checked against the metrics each probe
documents (trainprobes.result.PROBES) before anything runs, applied to each Result after.

A typo or a limit on a label is a configuration error naming the key and the known metrics,
never a finding; a limited metric the Result does not report makes it an error (TP-E1),
never a pass.
"""
from __future__ import annotations

from trainprobes.display import format_number
from trainprobes.errors import ConfigError, InvalidArgument, InvalidType
from trainprobes.result import PROBES
from trainprobes.validation import check_number, check_type

# The code a threshold failure carries, per section.
THRESHOLD_CODE = {"causality": "TP-C1", "bias": "TP-B1", "drift": "TP-D3",
                  "collectives": "TP-B1", "documents": "TP-I1", "batch_invariance": "TP-I2",
                  "transforms": "TP-T3"}


def check_thresholds(entry: dict, probe: str, where: str) -> None:
    """fail_above / fail_below: tables of documented numeric metrics of `probe` to numbers.
    A typo is a configuration error naming the key and the known ones, never a finding."""
    import difflib
    spec = PROBES[probe]
    for table in ("fail_above", "fail_below"):
        if table not in entry:
            continue
        limits = entry[table]
        if not isinstance(limits, dict):
            raise ConfigError(f"{where} {table}={limits!r} must be a table, e.g. "
                              f"{table} = {{ {spec.numbers[0]} = 0.01 }}")
        for metric, limit in limits.items():
            if not spec.is_number(metric):
                close = difflib.get_close_matches(metric, spec.numbers, n=1)
                what = ("is not a number (a label or the verdict boolean)"
                        if spec.documents(metric) else "is not a metric")
                raise ConfigError(f"{where} {table}.{metric} {what} of {probe}"
                                  + (f"; did you mean {close[0]!r}?" if close else "")
                                  + f"; its numeric metrics: {', '.join(spec.numbers)}")
            try:  # a TOML string "0.5" is mistyped, not a number
                check_type((int, float), limit, f"{where} {table}.{metric}", hint="a number")
                check_number(limit, f"{where} {table}.{metric}")
            except (InvalidArgument, InvalidType) as e:
                raise ConfigError(str(e)) from None


def apply_thresholds(result, entry: dict, section: str):
    """Fail a Result whose metrics cross the entry's fail_above / fail_below limits.

    A limited metric the Result does not report (one the probe writes only in some modes,
    e.g. mismatch_rate in mode = "truncate") cannot be checked: the Result becomes an
    error (TP-E1), never a pass, and not a finding either."""
    broken, unchecked = [], []
    for table, worse in (("fail_above", lambda v, lim: v > lim),
                         ("fail_below", lambda v, lim: v < lim)):
        for metric, limit in (entry.get(table) or {}).items():
            value = result.metrics.get(metric)
            if value is None or isinstance(value, (bool, str)):
                unchecked.append(f"{metric} ({table}) is not in this Result")
            elif value != value or worse(value, limit):  # NaN crosses every limit
                broken.append(f"{metric} = {format_number(value)} {'>' if table == 'fail_above' else '<'} "
                              f"{limit:g} ({table})")
    if entry.get("fail_above") or entry.get("fail_below"):
        result.evidence["thresholds"] = {"fail_above": entry.get("fail_above", {}),
                                         "fail_below": entry.get("fail_below", {}),
                                         "broken": broken, "unchecked": unchecked}
    # the message starts with what decided the verdict: a limit's FAIL after a probe's own
    # "noise: ..." reading read as a contradiction
    own = f"; the probe's own reading: {result.message}" if result.message else ""
    if unchecked:
        result.verdict = "error"
        result.codes = ["TP-E1"]
        result.message = "cannot check the configured limits: " + ", ".join(unchecked) + own
    elif broken:
        code = THRESHOLD_CODE[section]
        result.verdict = "fail" if result.verdict != "error" else "error"
        if code not in result.codes:
            result.codes.append(code)
        result.message = "over the configured threshold: " + ", ".join(broken) + own
    return result
