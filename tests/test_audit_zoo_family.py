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


@pytest.mark.slow
def test_a_finding_fixed_upstream_is_a_reproduced_control_and_news_in_the_summary():
    """transformers 5.25.0 fixed the BERT family's mask: on 5.25+ its control expects the clean
    verdict and the audit's summary prints the fix as news; before 5.25 it reproduces the leak."""
    import types

    import transformers
    from packaging.version import Version
    from trainprobes.commands.audit import render
    check, = [c for c in zoo_checks() if c.name == "confirmed zoo findings"]
    results = check.run()
    bert = [r for r in results if r.target.startswith("bert[")]
    assert len(bert) == 1 and bert[0].reproduced, [(r.target, r.verdict, r.expected) for r in results]
    life = bert[0].evidence["finding"]
    if Version(transformers.__version__) >= Version("5.25.0"):
        assert life["outcome"] == "fixed upstream" and bert[0].expected == "pass"
        outcome = types.SimpleNamespace(results=results, skipped={}, seconds=1.0, paths={"html": "r.html"})
        text = render(outcome)
        assert "News from upstream" in text and "fixed upstream in transformers 5.25.0" in text
    else:
        assert life["outcome"] == "reproduced" and bert[0].expected == "fail"
