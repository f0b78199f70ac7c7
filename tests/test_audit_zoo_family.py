"""The audit's zoo family: its fixed subset comes back as controls with their known verdicts
(llama's packed documents isolated, Mixtral's router causal, an expert-choice router in its
place non-causal, each confirmed finding reproduced), and a cell that could not run its
probe is an error, never a pass."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from trainprobes.audit.suites import FAMILIES  # noqa: E402
from trainprobes.audit.zoo_family import _control, zoo_checks  # noqa: E402
from trainprobes.zoo.cells import Cell  # noqa: E402


def test_the_family_is_registered_off_by_default():
    fam = FAMILIES["zoo"]
    assert fam.default is False and fam.build is zoo_checks
    assert [c.name for c in zoo_checks(quick=True)] == ["llama packed documents (sdpa)",
                                                         "mixtral router, own and expert choice"]
    assert all(c.control for c in zoo_checks())


def test_a_cell_without_a_result_is_an_error_control():
    r = _control(Cell("x", "router", "perturb", "error", None, "", "RuntimeError: boom"), "pass", "why")
    assert r.verdict == "error" and r.reproduced is False and "boom" in r.message


@pytest.mark.slow
def test_every_control_of_the_family_is_reproduced():
    results = [r for c in zoo_checks() for r in (lambda out: out if isinstance(out, list) else [out])(c.run())]
    assert len(results) >= 8
    missed = [(r.target, r.verdict, r.expected, r.message[:120]) for r in results if not r.reproduced]
    assert not missed, missed
    assert {r.expected for r in results} == {"pass", "fail"}     # both kinds of control present
