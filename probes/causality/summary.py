"""From what a check found to its Result: tallies, verdict, metrics, evidence, message.

Kinds (classify.Kind): a structural flip is a leak; an unconfirmed one (a packed flip past
the verification budget, after earlier packed flips of this target were confirmed) counts as
a leak too; an unverified one (a same-shape flip at a near-tie that no fp64 twin could settle)
is neither a leak nor excused (verdict warn); a numerical one is excused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from trainprobes.causality.classify import Kind, margins
from trainprobes.causality.records import Findings
from trainprobes.result import Result

N_KINDS = len(Kind)


@dataclass
class Tally:
    """Decision flips or score changes, counted by kind; records for the first max_leaks."""
    counts: list                                   # per Kind value
    leaks: list = field(default_factory=list)      # records of leaks (and unverified flips)
    excused: list = field(default_factory=list)    # records of numerical flips
    leak_map: dict = field(default_factory=dict)   # (cut, position) -> count
    distances: dict = field(default_factory=dict)  # cut + 1 - position -> count
    by_position: torch.Tensor | None = None        # leaks per position
    n_inference: int = 0                           # flips at the cut itself (truncate)

    def __getitem__(self, kind: Kind) -> int:
        return self.counts[kind]


def _add(counter: dict, keys: torch.Tensor, offset=None) -> None:
    """counter[key] += how often each key occurs (keys prefixed with offset if given)."""
    for k, n in zip(*torch.unique(keys, return_counts=True)):
        key = int(k) if offset is None else (offset, int(k))
        counter[key] = counter.get(key, 0) + int(n)


def tally_flips(found: Findings, T: int, max_leaks: int) -> Tally:
    y0, s0 = found.base
    mg = margins(s0, y0) if s0 is not None else None
    counts = torch.zeros(N_KINDS, dtype=torch.long)
    tally = Tally(counts=[], by_position=torch.zeros(T, dtype=torch.long))
    for f in sorted(found.flips, key=lambda f: (f.cut, f.trial)):  # as cuts were given
        counts += torch.bincount(f.kind, minlength=N_KINDS)
        tally.n_inference += int((f.position == f.cut).sum())
        leak = (f.kind == Kind.STRUCTURAL) | (f.kind == Kind.UNCONFIRMED)  # map, distances, rate
        t = f.position[leak]
        tally.by_position += torch.bincount(t, minlength=T)
        _add(tally.distances, f.cut + 1 - t)
        _add(tally.leak_map, t, offset=f.cut)
        real = f.kind != Kind.NUMERICAL  # recorded with the leaks, unverified ones too
        for dest, sel in ((tally.leaks, real), (tally.excused, ~real)):
            # records for the first max_leaks of each list only (a loop over cuts, not elements)
            for k in sel.nonzero().flatten()[:max_leaks - len(dest)].tolist():
                b, p = int(f.batch[k]), int(f.position[k])
                dest.append({"batch": b, "position": p, "cut": f.cut, "trial": f.trial,
                             "distance": f.cut + 1 - p, "before": y0[b, p].tolist(),
                             "after": f.after[k].tolist(), "kind": Kind(int(f.kind[k])).label,
                             "margin": float(mg[b, p]) if mg is not None else None})
    tally.leaks.sort(key=lambda r: (r["cut"], r["trial"], r["batch"], r["position"]))
    tally.counts = [int(v) for v in counts]
    return tally


def tally_scores(found: Findings, max_leaks: int) -> Tally:
    counts = torch.zeros(N_KINDS, dtype=torch.long)
    tally = Tally(counts=[])
    for s in sorted(found.score_changes, key=lambda s: (s.cut, s.trial)):
        counts += torch.bincount(s.kind, minlength=N_KINDS)
        _add(tally.leak_map, s.position[s.kind == Kind.STRUCTURAL], offset=s.cut)
        for k in (s.kind != Kind.NUMERICAL).nonzero().flatten()[:max_leaks - len(tally.leaks)].tolist():
            p = int(s.position[k])
            tally.leaks.append({"batch": int(s.batch[k]), "position": p, "cut": s.cut,
                                "trial": s.trial, "distance": s.cut + 1 - p,
                                "change": float(s.change[k]), "kind": Kind(int(s.kind[k])).label})
    tally.counts = [int(v) for v in counts]
    return tally


@dataclass
class Setup:
    """How the check was asked for: what the summary reports besides the findings."""
    mode: str
    layout: str
    atol: float
    shape: list
    input_dtype: str
    cuts: list
    trials: int
    max_leaks: int


def compared_per_position(setup: Setup) -> torch.Tensor:
    """[T] decisions compared at each position: every (cut >= t, trial, row)."""
    B, T = setup.shape[:2]
    cuts = torch.tensor(setup.cuts)
    return B * setup.trials * (cuts[None, :] >= torch.arange(T)[:, None]).sum(1)


def summarise(common: dict, setup: Setup, found: Findings) -> Result:
    """The Result of a check that ran to the end (nondeterministic targets: `nondeterministic`)."""
    T = setup.shape[1]
    flips = tally_flips(found, T, setup.max_leaks)
    scores = tally_scores(found, setup.max_leaks)
    compared = compared_per_position(setup)
    ties = found.near_ties
    tie_leaks = ties.leaks if ties is not None else 0
    n_unver = (flips[Kind.UNVERIFIED] + scores[Kind.UNVERIFIED] + found.isolation.unverified
               + (ties.unverified if ties is not None else 0))
    n_leaks = flips[Kind.STRUCTURAL] + flips[Kind.UNCONFIRMED]
    causal = n_leaks == 0 and scores[Kind.STRUCTURAL] == 0 and tie_leaks == 0
    codes = [] if causal else ["TP-C1"]
    if found.isolation.isolated is False:
        codes.append("TP-C3")
    # a NaN that stays a NaN is no flip, so NaN decisions (uninitialised weights: HF blocks
    # built alone start from torch.empty) are never compared: no pass can rest on them
    n_nan = _nan_decisions(found)
    n_decisions = found.base.decision.shape[0] * T
    # every value of every baseline decision NaN and none moved: nothing was compared, so
    # nothing was judged (fail closed: causal None, cannot judge, never a pass or a warn); a
    # decision with one finite feature was compared on it
    y0 = found.base.decision
    unjudged = (y0.numel() > 0 and y0.is_floating_point() and bool(y0.isnan().all())
                and causal and not n_unver)
    if unjudged:
        causal, codes = None, ["TP-C1"]
    verdict = "fail" if codes else ("warn" if n_unver or n_nan else "pass")
    # what stayed unsettled names its check: flips and scores TP-C1, batch moves TP-C3
    if n_unver - found.isolation.unverified and "TP-C1" not in codes:
        codes.append("TP-C1")
    if found.isolation.unverified and "TP-C3" not in codes:
        codes.append("TP-C3")
    metrics = _metrics(setup, found, flips, scores, compared, causal=causal, n_unver=n_unver)
    evidence = _evidence(setup, found, flips, scores, compared)
    evidence["nan_decisions"] = n_nan
    evidence["near_tie_search"] = _tie_evidence(ties)
    message = _message(setup, found, flips, scores, metrics) + _tie_message(found, metrics)
    if unjudged:
        message = (f"cannot judge: all {n_decisions} baseline decisions are NaN and none changed "
                   "when later tokens did (a NaN that stays a NaN shows no flip), so no decision "
                   "was judged; are the weights initialised? (HF blocks built alone start from "
                   "torch.empty)")
    elif n_nan:
        message += (f"; {n_nan} of {found.base.decision.shape[0] * T} baseline decisions are NaN "
                    f"and cannot show a flip (are the weights initialised?)")
    return Result(**common, verdict=verdict, codes=codes, metrics=metrics, evidence=evidence,
                  message=message)


def _nan_decisions(found: Findings) -> int:
    """(batch, position) whose baseline decision holds a NaN."""
    y0 = found.base.decision
    if not y0.is_floating_point():
        return 0
    return int(y0.isnan().reshape(*y0.shape[:2], -1).any(-1).sum())


def _metrics(setup, found: Findings, flips: Tally, scores: Tally, compared, *, causal, n_unver) -> dict:
    n_compared = int(compared.sum())
    n_leaks = flips[Kind.STRUCTURAL] + flips[Kind.UNCONFIRMED]
    n_flips = n_leaks + flips[Kind.NUMERICAL] + flips[Kind.UNVERIFIED]
    metrics = {
        "causal": causal, "n_leaks": n_leaks, "n_structural": flips[Kind.STRUCTURAL],
        "n_numerical": flips[Kind.NUMERICAL], "n_unverified": n_unver,
        "n_unconfirmed": flips[Kind.UNCONFIRMED], "n_flips": n_flips,
        "n_score_leaks": scores[Kind.STRUCTURAL], "n_score_numerical": scores[Kind.NUMERICAL],
        "flip_rate": n_leaks / n_compared if n_compared else 0.0,
        "n_compared": n_compared, "n_cuts": len(setup.cuts), "trials": setup.trials,
        "deterministic": True, "batch_isolated": found.isolation.isolated,
        "batch_invariant": found.batch_invariant,
        "packed": found.packed and found.batch_invariant,
        "n_evaluations": found.n_evaluations, "n_confirmations": found.n_confirmations,
        "tokens_evaluated": found.tokens_evaluated,
        "evaluations_to_first_flip": found.first_flip_eval,
        # from the counts, not the records: those stop at max_leaks and hold unverified flips
        "first_leak_position": (int(flips.by_position.nonzero()[0]) if flips.by_position.any()
                                else None),
        "min_leak_distance": min(flips.distances, default=None),
        "max_leak_distance": max(flips.distances, default=None),
        "fp64": found.fp64_status,
        "n_near_ties": found.near_ties.reached if found.near_ties is not None else None,
        "n_near_tie_leaks": found.near_ties.leaks if found.near_ties is not None else 0,
    }
    if setup.mode == "truncate":
        metrics["mismatch_rate"] = n_flips / n_compared if n_compared else 0.0
        metrics["inference_mismatch_rate"] = flips.n_inference / (setup.shape[0] * len(setup.cuts))
    return metrics


def _evidence(setup: Setup, found: Findings, flips: Tally, scores: Tally, compared) -> dict:
    rate = (flips.by_position.double() / compared.clamp_min(1)).where(compared > 0, torch.nan)
    return {
        "mode": setup.mode, "layout": setup.layout, "atol": setup.atol, "shape": setup.shape,
        "input_dtype": setup.input_dtype, "decision_shape": list(found.base.decision.shape),
        "cuts": setup.cuts, "leaks": flips.leaks, "numerical_flips": flips.excused,
        "flip_rate_by_position": [None if math.isnan(v) else v for v in rate.tolist()],
        "leak_distances": {str(k): v for k, v in sorted(flips.distances.items())},
        "leak_map": [[c, p, n] for (c, p), n in sorted(flips.leak_map.items())],
        "batch_isolation_moved": found.isolation.moved,
        "batch_isolation_numerical": found.isolation.numerical,
        "batch_isolation_unverified": found.isolation.unverified,
        "packing_error": found.packing_error, "packing": found.packing,
        "score_leaks": scores.leaks,
        "score_leak_map": [[c, p, n] for (c, p), n in sorted(scores.leak_map.items())],
    }


def _message(setup: Setup, found: Findings, flips: Tally, scores: Tally, metrics: dict) -> str:
    what = ("future-dependent decisions" if setup.mode == "perturb" else
            "decisions that differ in the inference view (prefix only)")
    n_leaks, n_compared = metrics["n_leaks"], metrics["n_compared"]
    if not metrics["causal"] and not n_leaks and metrics["n_score_leaks"]:
        sl = _first_leak(scores.leaks)
        msg = (f"routing scores at {metrics['n_score_leaks']} (batch, position, cut) depend on "
               f"later tokens though no decision flipped in this sample (it will at a near-tie)"
               + (f"; first at position {sl['position']} (cut {sl['cut']}, batch {sl['batch']}), "
                  f"change {sl['change']:.3g}" if sl else ""))
    elif n_leaks:
        first = _first_leak(flips.leaks)
        n_unconf = metrics["n_unconfirmed"]
        msg = (f"{n_leaks} {what} of {n_compared} compared"
               + (f"; first at position {first['position']} (cut {first['cut']}, batch "
                  f"{first['batch']}): {brief(first['before'])} -> {brief(first['after'])}"
                  if first else "")
               + (f"; {n_unconf} from packed calls not re-confirmed" if n_unconf else ""))
    else:
        n_num = metrics["n_numerical"]
        if setup.mode == "truncate" and metrics["n_flips"]:
            # the inference view's decisions do differ (mismatch_rate counts every one): say
            # that none differs beyond rounding noise, not that none differs
            msg = (f"no decisions that differ beyond rounding noise in the inference view (prefix "
                   f"only); {metrics['n_flips']} of {n_compared} compared over {len(setup.cuts)} "
                   f"cuts differ (mismatch_rate {metrics['mismatch_rate']:.4g})"
                   + (f", {n_num} of them within rounding noise (numerical, not a leak)" if n_num else ""))
        else:
            msg = (f"no {what} in {n_compared} compared over {len(setup.cuts)} cuts"
                   + (f" ({n_num} flips within rounding noise of a tie, excused by re-runs)"
                      if n_num else ""))
        n_moves = found.isolation.unverified
        n_flips = metrics["n_unverified"] - n_moves - (found.near_ties.unverified if found.near_ties else 0)
        unsettled = [f"{n_flips} flips at near-ties"] if n_flips else []
        unsettled += [f"{n_moves} moves of a row when other rows changed, within rounding "
                      f"noise"] if n_moves else []
        if unsettled:
            msg += (f"; {' and '.join(unsettled)} could not be settled (no fp64 twin: pass "
                    f"fp64= or scores=)")
    if found.isolation.isolated is False:
        msg += (f"; decisions of one sequence change with another in the batch "
                f"(at {found.isolation.moved[:3]})")
    return msg


def _tie_evidence(ties) -> dict | None:
    if ties is None:
        return None
    from trainprobes.causality.near_tie import REACH_FACTOR
    return {"tried": ties.tried, "windows": ties.windows, "reached": ties.reached,
            "held": ties.held, "width": ties.width,
            "noise_reach": ties.noise_reach, "reach_factor": REACH_FACTOR,
            "kinds": {Kind(k).label: n for k, n in enumerate(ties.kinds)}, "flips": ties.flips,
            "records": ties.records, "evaluations": ties.evaluations, "reason": ties.reason,
            "one_row": ties.one_row, "length": ties.length, "moved": ties.moved,
            "confirm_calls": ties.confirm_calls, "rebracketed": ties.rebracketed,
            "assumption": "a tie moved by reordered reductions moves by max(32, T) ulps of the "
                          "input segment (scores of the order of their spread along it)",
            "covers": "ties in windows of consecutive positions ending at a cut (cuts spread "
                      "evenly), bisected together in one row (one_row: copies of row 0, so "
                      "each window's past holds the earlier windows' ties) or, for windows "
                      "that overlap, one row per window; each tie's future is what follows "
                      "its window's cut"}


def _tie_message(found: Findings, metrics: dict) -> str:
    """What the near-tie search found, or what a decision-only check could not rule out."""
    ties = found.near_ties
    if ties is None:
        return ""
    if ties.leaks:
        # the records keep the first flips only: a structural one may lie beyond them
        r = next((r for r in ties.records if r["kind"] == "structural"), None)
        return (f"; {ties.leaks} of {ties.reached} decisions brought to a near-tie (bisection on "
                f"the input at a cut, brackets within {ties.width:.2g} of the input segment) "
                f"flipped when only later positions changed"
                + (f", first at position {r['position']} (batch {r['batch']}): "
                   f"{brief(r['before'])} -> {brief(r['after'])}, still flipped "
                   f"{r['reach']:.2g} from the tie" if r else "")
                + ": a future leak too small to flip a choice at random inputs' margins")
    if ties.unverified:
        return (f"; {ties.unverified} near-tie decisions flipped when later positions changed, "
                f"but not far enough from the tie to rule out reordered rounding and with no "
                f"fp64 twin to settle it: pass fp64= (a float64 copy) or scores=")
    if ties.reached and metrics["causal"]:
        return (f"; {ties.reached} decisions brought within {ties.width:.2g} of a tie (of the "
                f"input segment) did not move either: a leak that shifts a decision boundary "
                f"by more than that would have flipped one")
    if ties.reason and metrics["causal"]:
        return (f"; decisions only, no near-tie search ({ties.reason}): a leak that moves the "
                f"scores by less than these inputs' margins would not be seen; return the "
                f"router scores too (scores=, --scores) so that any score that moves is judged")
    return ""


def _first_leak(records: list) -> dict | None:
    """The first record of a leak (records hold unverified changes too, and may be none at
    all: max_leaks=0)."""
    return next((r for r in records if r["kind"] in ("structural", "unconfirmed")), None)


def brief(v) -> str:
    """A decision for a message: ids and masks (up to 16) whole, float vectors abridged."""
    if isinstance(v, list) and (len(v) > 16 or len(v) > 4 and any(isinstance(u, float) for u in v)):
        return "[" + ", ".join(f"{u:.4g}" if isinstance(u, float) else str(u) for u in v[:3]) + \
            f", ...] ({len(v)} values)"
    return str(v)


def nondeterministic(common: dict, setup: Setup, name: str, where: list, count: int,
                     n_evaluations: int, tokens_evaluated: int) -> Result:
    """TP-C2: the same input gave different outputs; no flip can then be told from a leak."""
    return Result(**common, verdict="fail", codes=["TP-C2"],
                  metrics={"causal": None, "deterministic": False, "n_nondeterministic": count,
                           "n_evaluations": n_evaluations, "tokens_evaluated": tokens_evaluated},
                  evidence={"nondeterministic_positions": where, "mode": setup.mode,
                            "shape": setup.shape},
                  message=f"{name} gave different outputs on the same input at {count} "
                          f"token{'s' if count != 1 else ''} (first (batch, position): {where[:3]}); nondeterminism "
                          f"is not a causality verdict: make the target deterministic "
                          f"(.eval() for dropout and router jitter, fixed seeds, "
                          f"torch.use_deterministic_algorithms) and probe again")
