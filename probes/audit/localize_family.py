"""The audit family "drift_localize": the localisation demo's engine pairs (tiny random HF
Llama and Qwen2-MoE, trainprobes.drift.localize_demo) as controls. Each injected fault must be
found at its stage, op and kind (Result.reproduced reads metrics matches_known_verdict), each
noise pair must blame nothing. Each Result carries its per-stage plot
(trainprobes.drift.stage_plot). Not in the default audit: importing transformers and 15
localisations take ~15 s of a 10-second audit (`trainprobes audit --families drift_localize`).
"""
from __future__ import annotations

from trainprobes.audit.run import Check


def localize_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """One control per demo case (trainprobes.drift.localize_demo.CASES); quick mode runs the
    same cases (each is already a few tenths of a second)."""
    from trainprobes.drift.localize_demo import CASES

    def one(case):
        def run():
            from trainprobes.drift.localize_demo import run_case
            return run_case(case, seed=seed)
        return Check("drift_localize", case.name, run, control=True)
    return [one(c) for c in CASES]
