"""A confirmed zoo finding measured again, and what its new measurement means on the
transformers release installed (trainprobes.zoo.findings holds the findings; this module runs
their cells, so the findings' data never imports the cells that annotate with it).

Steps of `judge(findings, cells, version)`, one Status per finding:
  1. a cell that could not be measured (an error, an unknown verdict): cannot judge, the
     harness cannot handle this release yet;
  2. the recorded verdict again: reproduced (a finding recorded as fixed that reproduces is
     news too: it came back);
  3. another verdict on a release the finding was recorded reproducing on: missed, a failure
     of the harness, not of the library;
  4. another verdict elsewhere: on a release older than the one it was measured on, not in
     this release (it came later); fixed upstream where a Fix records this release or an
     earlier one (a pre-release of the fix's release counts as that release); otherwise changed
     upstream (news, to be recorded). Each is news only while another finding of the same probe
     reproduces in the same run; without one the harness cannot tell a change upstream from its
     own failure: cannot judge. A version string that is not a release (PEP 440) cannot be
     ordered against the recorded ones: cannot judge.
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from trainprobes.zoo.findings import Finding

__all__ = ["Outcome", "Status", "control", "judge", "measure", "transformers_version"]


class Outcome(str, Enum):
    REPRODUCED = "reproduced"
    FIXED = "fixed upstream"
    CHANGED = "changed upstream"
    OLDER = "not yet in this release"
    MISSED = "missed"
    UNJUDGED = "cannot judge"


class Status(NamedTuple):
    finding: Finding
    outcome: Outcome
    transformers: str     # the release it was measured on now
    now: str              # the cell's verdict and reason now
    news: str             # what changed, for a reader ("" where nothing did)


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def _release(version: str):
    """The release numbers (5, 25, 0) of a PEP 440 version; None where it is not one. A
    pre-release or dev build of 5.25.0 counts as 5.25.0: it carries what 5.25.0 will."""
    from packaging.version import InvalidVersion, Version
    try:
        return Version(version).release
    except InvalidVersion:
        return None


def _at_least(version: str, floor: str) -> bool:
    return _release(version) >= _release(floor)


def measure(f: Finding, seed: int = 0):
    """The finding's cell measured now (a Cell; verdict 'error' where the model cannot be built)."""
    import torch
    from trainprobes.zoo.cells import Cell, batch_cell, isolation_cell, router_cells
    from trainprobes.zoo.shrink import Failure, build
    impl = f.variant.split(",")[0] if f.probe == "isolation" else None
    b = build(f.model_type, attn_implementation=impl, seed=seed)
    if isinstance(b, Failure):
        return Cell(f.model_type, f.probe, f.variant, "error", None, "", f"cannot build: {b.reason}")
    with torch.no_grad():
        if f.probe == "isolation":
            return isolation_cell(f.model_type, b.model, impl, f.variant.split(",")[1], seed)
        if f.probe == "router":
            return router_cells(f.model_type, b.model, seed, modes=(f.variant,))[0]
        if f.probe == "batch":
            return batch_cell(f.model_type, b.model, seed)
    raise NotImplementedError(f"a {f.probe} finding cannot be measured again")


def _one(f: Finding, cell, version: str) -> Status:
    now = f"{cell.verdict}: {cell.reason}"
    if _release(version) is None:
        return Status(f, Outcome.UNJUDGED, version, now,
                      f"transformers {version!r} is not a release number (PEP 440): it cannot be ordered against "
                      f"the releases this finding was recorded on")
    if cell.verdict in ("error", "unknown"):
        return Status(f, Outcome.UNJUDGED, version, now,
                      f"cannot be measured on transformers {version}: the harness cannot handle it yet")
    if cell.verdict == f.verdict:
        if f.fixed is not None and _at_least(version, f.fixed.version):
            return Status(f, Outcome.REPRODUCED, version, now,
                          f"reproduces again on transformers {version}, after its fix in {f.fixed.version}")
        new = "" if f.recorded_reproducing(version) else f"still reproduces on transformers {version} (not yet recorded)"
        return Status(f, Outcome.REPRODUCED, version, now, new)
    if f.recorded_reproducing(version):
        return Status(f, Outcome.MISSED, version, now,
                      f"recorded {f.verdict} on transformers {version}, measured {cell.verdict}: the harness missed it")
    if not _at_least(version, f.measured_on.transformers):
        return Status(f, Outcome.OLDER, version, now,
                      f"not {f.verdict} on transformers {version}, older than {f.measured_on.transformers} where it was "
                      f"measured: it came in a later release")
    if f.fixed is not None and _at_least(version, f.fixed.version):
        return Status(f, Outcome.FIXED, version, now, f"fixed upstream in transformers {f.fixed.version}: {f.fixed.change}")
    seen = ", ".join((f.measured_on.transformers, *f.checked_on))
    return Status(f, Outcome.CHANGED, version, now,
                  f"no longer {f.verdict} on transformers {version} (recorded on {seen}): find the change upstream "
                  f"and record it as the finding's Fix")


_NEWS = (Outcome.FIXED, Outcome.CHANGED, Outcome.OLDER)   # the cell's clean verdict is right, if the probe works


def judge(findings, cells, version: str | None = None) -> list[Status]:
    """One Status per finding, from its cell measured now on transformers `version` (the
    installed one by default). See the module's steps."""
    version = version or transformers_version()
    out = [_one(f, c, version) for f, c in zip(findings, cells, strict=True)]
    # the same probe under the same set-up (attention implementation and packing convention):
    # a harness broken for one set-up must not be vouched for by a finding measured under another
    caught = {(s.finding.probe, s.finding.variant) for s in out if s.outcome is Outcome.REPRODUCED}
    return [s if s.outcome not in _NEWS or (s.finding.probe, s.finding.variant) in caught
            else s._replace(outcome=Outcome.UNJUDGED,
                       news=f"{s.news}; but no other {s.finding.probe} {s.finding.variant} finding reproduced in this run, so the "
                            f"harness cannot tell a fix upstream from its own failure")
            for s in out]


_FAILING = ("leaky", "non-causal", "variant")   # the cell verdicts a probe reports as "fail"


def control(s: Status, cell):
    """The finding's Result as a control, its known verdict (`expected`) set from its life: the
    recorded verdict while it reproduces (or was recorded reproducing on this release), the
    clean one once fixed or changed upstream; an error where it cannot be judged. The news
    leads the message; the status is in evidence["finding"]."""
    f = s.finding
    recorded = "fail" if f.verdict in _FAILING else "pass"
    expected = "pass" if s.outcome in _NEWS else recorded
    r = cell.result
    if r is None:
        r = cell.unmeasured(f"zoo finding not judged: {s.news or s.now}")
    elif s.outcome is Outcome.UNJUDGED:   # its probe and target kept: the gate pairs it with a judged run
        r.verdict, r.message = "error", f"zoo finding not judged: {s.news or s.now}"
    r.expected = expected
    lead = f"{s.news}. " if s.news and s.outcome is not Outcome.UNJUDGED else ""
    r.message = f"{lead}confirmed zoo finding ({f.call}: {f.cause}): {r.message}"
    r.evidence["finding"] = {"outcome": s.outcome.value, "transformers": s.transformers, "news": s.news,
                             "measured_on": f.measured_on._asdict(), "checked_on": list(f.checked_on),
                             "fixed": None if f.fixed is None else f.fixed._asdict()}
    return r
