"""The zoo family of the audit (not in the default run: transformers' import alone costs
seconds): a small fixed subset of the zoo map whose verdicts are known, each the Result of the
probe behind its cell, carried as a control with its known verdict.

  llama   sdpa, a block-diagonal 4-D mask               isolated        (expected pass)
  llama   sdpa, restarting position ids, no cache       isolated        (expected pass)
  mixtral its own top-2 router, perturbed future        causal          (expected pass)
  mixtral an expert-choice router in the gate's place   non-causal      (expected fail)
  each confirmed zoo finding (trainprobes.zoo.findings) its verdict     (expected fail)
  (a bug and a by-design leak alike), or, once fixed upstream, isolated (expected pass,
  the fix named as news in the message)
A transformers upgrade that changes one shows as news where the finding records the fix, or
where another finding of the same probe still reproduces; a release it was recorded on that
no longer reproduces it is a missed control.
"""
from __future__ import annotations

from trainprobes.audit.run import Check

__all__ = ["zoo_checks"]


def _control(cell, expected: str, why: str):
    r = cell.result
    if r is None:  # the cell could not run its probe: an error, never a pass
        return cell.unmeasured(f"zoo cell not measured: {cell.reason}", expected)
    r.expected = expected
    r.message = f"control, {why}: {r.message}"
    return r


def zoo_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    def isolation():
        import torch
        from trainprobes.zoo.cells import isolation_cell
        from trainprobes.zoo.shrink import build
        model = build("llama", attn_implementation="sdpa", seed=seed).model
        with torch.no_grad():
            return [_control(isolation_cell("llama", model, "sdpa", conv, seed), "pass", why)
                    for conv, why in (("mask_4d", "a block-diagonal mask isolates"),
                                      ("position_ids_no_cache", "masking_utils reads packed position ids"))]

    def routers():
        import torch
        from trainprobes.reference.models.hf_routers import ExpertChoiceRouter, patch_gates
        from trainprobes.zoo.cells import router_cells
        from trainprobes.zoo.shrink import build
        out = []
        with torch.no_grad():
            cell, = router_cells("mixtral", build("mixtral", seed=seed).model, seed, modes=("perturb",))
            out.append(_control(cell, "pass", "Mixtral's token-choice top-2 router is causal"))
            model = build("mixtral", seed=seed).model
            patch_gates(model, ExpertChoiceRouter)
            cell, = router_cells("mixtral", model, seed, modes=("perturb",))
            out.append(_control(cell, "fail", "expert choice reads the whole call, the future included"))
        return out

    def findings():
        from trainprobes.zoo.confirm import control, judge, measure
        from trainprobes.zoo.findings import FINDINGS
        # one finding per reproduction, call and fix (the same cause in 18 model types is one
        # check; a family fixed upstream is one more); its life on this transformers release
        # sets its known verdict: the recorded one while it reproduces, the clean one once fixed
        firsts = list({(f.script, f.call, f.fixed): f for f in reversed(FINDINGS)}.values())[::-1]
        cells = [measure(f, seed) for f in firsts]
        return [control(s, c) for s, c in zip(judge(firsts, cells), cells)]

    checks = [Check("zoo", "llama packed documents (sdpa)", isolation, control=True),
              Check("zoo", "mixtral router, own and expert choice", routers, control=True)]
    if not quick:
        checks.append(Check("zoo", "confirmed zoo findings", findings, control=True))
    return checks
