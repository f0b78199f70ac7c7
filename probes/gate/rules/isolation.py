"""The rules of trainprobes.isolation: packed documents, batch invariance, op maps and end-to-end runs."""
from __future__ import annotations

from trainprobes.gate.rules.base import REL, Counts, Reader, deterministic, fmt


def _documents(rd: Reader) -> None:
    """trainprobes.isolation.documents: a structural leak has a size (max_leak); its
    within-document causality check fails with TP-C1 exactly when causal is false."""
    deterministic(rd, "isolated")
    causal = rd.flag("causal", optional=True)
    if causal is not None:
        rd.codes_agree("TP-C1", causal is False, f"causal={causal}")
    n_leaks, worst = rd.count("n_leaks", optional=True), rd.opt("max_leak")
    if None not in (n_leaks, worst) and (n_leaks > 0) != (worst > 0):
        rd.fail(f"max_leak={fmt(worst)} beside n_leaks={n_leaks}: leaks have a size, and only leaks")
    docs = rd.count("n_documents", optional=True)
    if docs is not None and docs < 1:
        rd.fail("n_documents=0")


def _batch(rd: Reader) -> None:
    """trainprobes.isolation.batch: the figures over every batch are those of evidence
    by_size; a row differs when some output moves by more than atol."""
    deterministic(rd, "batch_invariant")
    if rd.flag("companion_dependent", optional=True) and rd.m.get("batch_invariant") is True:
        rd.fail("companion_dependent=True beside batch_invariant=True: a row that changes with "
                "its companions differs from itself alone")
    mx, mean = rd.opt("max_abs_diff"), rd.opt("mean_abs_diff")
    frac_rows, frac_out = rd.opt("frac_rows_differ"), rd.opt("frac_outputs_differ")
    atol = rd.opt("atol") or 0.0
    if None not in (mx, mean) and not 0 <= mean <= mx * (1 + REL):
        rd.fail(f"mean_abs_diff={fmt(mean)} beside max_abs_diff={fmt(mx)}")
    for name, frac in (("frac_rows_differ", frac_rows), ("frac_outputs_differ", frac_out)):
        if frac is not None and not 0 <= frac <= 1:
            rd.fail(f"metric {name}={fmt(frac)} is not a fraction")
        if frac is not None and mx is not None and (frac > 0) != (mx > atol):
            rd.fail(f"{name}={fmt(frac)} beside max_abs_diff={fmt(mx)} (atol {fmt(atol)}): "
                    "an output differs exactly when it moves by more than atol")
    breaking = rd.m.get("breaking_sizes")
    if isinstance(breaking, list) and "first_breaking_size" in rd.m:
        first = rd.m["first_breaking_size"]
        if first != (breaking[0] if breaking else None):
            rd.fail(f"first_breaking_size={first!r} is not the first of breaking_sizes {breaking}")
    by_size = rd.evidence("by_size", list, optional=True)
    if by_size is None or frac_rows is None or not isinstance(breaking, list):
        return
    rows = [(rd.field(s, "rows", "by_size"), rd.field(s, "rows_differ", "by_size"),
             rd.field(s, "max_abs_diff", "by_size"), rd.field(s, "max_ulps", "by_size"),
             rd.field(s, "frac_outputs_differ", "by_size"), rd.field(s, "mean_abs_diff", "by_size"),
             s.get("size")) for s in by_size]
    total = sum(r[0] for r in rows)
    rd.agree("frac_rows_differ", frac_rows, sum(r[1] for r in rows) / total if total else 0.0,
             "the rows that differ over the rows of evidence by_size")
    if mx is not None:
        rd.agree("max_abs_diff", mx, max((r[2] for r in rows), default=0.0),
                 "the largest of evidence by_size")
    ulps = rd.opt("max_ulps")
    if ulps is not None:
        rd.agree("max_ulps", ulps, max((r[3] for r in rows), default=0.0), "the largest of by_size")
    for name, v, k in (("frac_outputs_differ", frac_out, 4), ("mean_abs_diff", mean, 5)):
        if v is not None and rows and not (min(r[k] for r in rows) * (1 - REL) <= v
                                           <= max(r[k] for r in rows) * (1 + REL)):
            rd.fail(f"metric {name}={fmt(v)} is outside the range of its values per size in "
                    "evidence by_size, of which it is a weighted mean")
    if breaking != [r[6] for r in rows if r[1]]:
        rd.fail(f"breaking_sizes={breaking} are not the sizes of evidence by_size whose rows differ")


def _end_to_end(rd: Reader) -> None:
    """trainprobes.isolation.end_to_end: a token differs exactly when its output moves."""
    frac, mx = rd.opt("frac_tokens_differ"), rd.opt("max_abs_diff")
    if frac is not None and not 0 <= frac <= 1:
        rd.fail(f"metric frac_tokens_differ={fmt(frac)} is not a fraction")
    if None not in (frac, mx) and (frac > 0) != (mx > 0):
        rd.fail(f"frac_tokens_differ={fmt(frac)} beside max_abs_diff={fmt(mx)}: a token differs "
                "exactly when its output moves")


_BATCH = Counts(("frac_rows_differ", "breaking_sizes"), ("frac_rows_differ", "breaking_sizes"))
COUNTS = {
    # isolation.documents: isolated = False if n_leaks, None if n_unverified or
    # n_blind_tokens, else True
    "isolation.documents": Counts(("n_leaks", "n_unverified", "n_blind_tokens"), ("n_leaks",)),
    # isolation.batch: batch_invariant = no batch size at which a row differs (breaking_sizes)
    "isolation.batch_invariance": _BATCH, "isolation.op_map": _BATCH,
    # isolation.end_to_end: invariant = no token differs at any size (d > 0, no atol); the
    # Result shows the largest size only, so a variant one need not show it
    "isolation.end_to_end": Counts(("frac_tokens_differ", "max_abs_diff")),
}
# isolation.documents: causal False (its within-document causality check leaked) -> TP-C1
SIDE_FLAGS = {"isolation.documents": (("causal", False, "TP-C1"),)}
RULES = {"isolation.documents": _documents, "isolation.batch_invariance": _batch,
         "isolation.op_map": _batch, "isolation.end_to_end": _end_to_end}
