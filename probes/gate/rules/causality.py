"""The rule of trainprobes.causality: leak counts, near-ties and the verdict read against each other."""
from __future__ import annotations

from trainprobes.gate.rules.base import Counts, Reader, deterministic


def _causality(rd: Reader) -> None:
    """trainprobes.causality.summary: every leak is a flip, flips are bounded by what was
    compared, flip_rate is n_leaks / n_compared, a pass has nothing unverified. (causal
    against n_leaks, n_leaks as a sum: COUNTS and SUMS below.)"""
    n_leaks = rd.count("n_leaks", optional=True)
    flips, num = rd.count("n_flips", optional=True), rd.count("n_numerical", optional=True)
    unver = rd.count("n_unverified", optional=True)
    if None not in (n_leaks, flips, num, unver) and not n_leaks + num <= flips <= n_leaks + num + unver:
        rd.fail(f"n_flips={flips} is not n_leaks + n_numerical ({n_leaks} + {num}) plus at most "
                f"n_unverified={unver} flips, as the probe counts them")
    compared = rd.count("n_compared", optional=True)
    if None not in (compared, flips) and flips > compared:
        rd.fail(f"n_flips={flips} exceeds n_compared={compared}")
    rate = rd.opt("flip_rate")
    if None not in (compared, n_leaks, rate):
        rd.agree("flip_rate", rate, n_leaks / compared if compared else 0.0, "n_leaks / n_compared")
    if unver and rd.r.verdict == "pass":
        rd.fail(f"verdict 'pass' beside n_unverified={unver}: unverified flips warn")
    first = rd.opt("first_leak_position")
    if n_leaks is not None and "first_leak_position" in rd.m and (first is None) != (n_leaks == 0):
        rd.fail(f"first_leak_position={first!r} beside n_leaks={n_leaks}")
    lo, hi = rd.count("min_leak_distance", optional=True), rd.count("max_leak_distance", optional=True)
    if None not in (lo, hi) and lo > hi:
        rd.fail(f"min_leak_distance={lo} > max_leak_distance={hi}")
    evals = rd.count("n_evaluations", optional=True)
    for name in ("n_confirmations", "evaluations_to_first_flip"):
        v = rd.count(name, optional=True)
        if None not in (v, evals) and v > evals:
            rd.fail(f"{name}={v} exceeds n_evaluations={evals}")
    _near_ties(rd)
    if rd.flag("packed", optional=True) and rd.flag("batch_invariant", optional=True) is False:
        rd.fail("packed=True beside batch_invariant=False: the probe packs only a batch-invariant "
                "target")
    deterministic(rd, "causal")


def _near_ties(rd: Reader) -> None:
    """causality.near_tie: the counts are those of the search's evidence (older Results,
    from before the search, carry neither)."""
    reached, leaks = rd.count("n_near_ties", optional=True), rd.count("n_near_tie_leaks", optional=True)
    ev = rd.evidence("near_tie_search", dict, optional=True)
    if ev is None:
        if reached or leaks:
            rd.fail(f"n_near_ties={reached}, n_near_tie_leaks={leaks} without the search's "
                    "evidence['near_tie_search']")
        return
    if reached != rd.as_count(rd.field(ev, "reached", "near_tie_search"), "near_tie_search.reached"):
        rd.fail(f"n_near_ties={reached} is not near_tie_search.reached={ev.get('reached')!r}")
    kinds = ev.get("kinds")
    found = rd.field(kinds, "structural", "near_tie_search.kinds") if isinstance(kinds, dict) else None
    if found is None or leaks != found:
        rd.fail(f"n_near_tie_leaks={leaks} is not near_tie_search.kinds.structural={found!r}")
    if leaks > reached:
        rd.fail(f"n_near_tie_leaks={leaks} exceeds n_near_ties={reached}")


# causality.summary: causal = no leak at random inputs, in the scores, or at near-ties;
# n_leaks = structural + unconfirmed flips (the CLI shows all three side by side);
# batch_isolated False -> TP-C3 (fail)
COUNTS = {"causality.check": Counts(("n_leaks", "n_score_leaks", "n_near_tie_leaks"),
                                    ("n_leaks", "n_score_leaks", "n_near_tie_leaks"),
                                    optional=("n_near_tie_leaks",))}
SUMS = (("causality.check", "n_leaks", ("n_structural", "n_unconfirmed")),)
SIDE_FLAGS = {"causality.check": (("batch_isolated", False, "TP-C3"),)}
RULES = {"causality.check": _causality}
