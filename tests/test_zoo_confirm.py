"""A confirmed zoo finding's life across transformers releases (trainprobes.zoo.confirm.judge):
reproduced, fixed upstream (news, the control's known verdict becomes the clean one), changed
upstream (news to record), missed on a release it was recorded on (the harness failed), and
cannot judge where the cell could not be measured or no finding of the same probe reproduced
in the run (the harness could not tell a fix from its own failure)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from trainprobes.result import Result  # noqa: E402
from trainprobes.zoo.cells import Cell  # noqa: E402
from trainprobes.zoo.confirm import Outcome, control, judge  # noqa: E402
from trainprobes.zoo.findings import BUG, FINDINGS, Finding, Fix, Versions  # noqa: E402

OLD, NEW = Versions("5.24.0", "2.13.0"), "5.25.0"


def _finding(mt, probe="isolation", *, fixed=None, checked=()):
    return Finding(mt, probe, "eager,position_ids_no_cache" if probe == "isolation" else "perturb",
                   "leaky" if probe == "isolation" else "non-causal", BUG, "cause", "why", "script.py",
                   measured_on=OLD, checked_on=checked, fixed=fixed)


def _cell(f, verdict):
    ok = verdict in ("isolated", "causal")
    r = Result(probe="isolation.documents", target=f.model_type, verdict="pass" if ok else "fail", message="m")
    return Cell(f.model_type, f.probe, f.variant, verdict, None, "", "reason", result=r)


def _outcomes(pairs, version):
    fs = [f for f, _ in pairs]
    return [s.outcome for s in judge(fs, [_cell(f, v) for f, v in pairs], version)]


def test_a_recorded_fix_is_news_and_a_still_leaky_finding_keeps_the_probe_trusted():
    fixed = _finding("bert", fixed=Fix(NEW, "passes position_ids"))
    still = _finding("opt")
    assert _outcomes([(fixed, "isolated"), (still, "leaky")], NEW) == [Outcome.FIXED, Outcome.REPRODUCED]
    # on the release it was measured on, the same clean cell is the harness's failure
    assert _outcomes([(fixed, "isolated"), (still, "leaky")], OLD.transformers) == [Outcome.MISSED, Outcome.REPRODUCED]


def test_a_fix_is_not_news_when_no_finding_of_its_probe_reproduced():
    fixed = _finding("bert", fixed=Fix(NEW, "passes position_ids"))
    other = _finding("doge", "router")           # another probe catching proves nothing here
    s = judge([fixed, other], [_cell(fixed, "isolated"), _cell(other, "non-causal")], NEW)
    assert s[0].outcome is Outcome.UNJUDGED and "cannot tell a fix upstream from its own failure" in s[0].news


def test_an_unrecorded_change_on_a_new_release_is_news_to_record_not_a_pass_of_a_recorded_release():
    a, b = _finding("gpt_oss", checked=(NEW,)), _finding("opt", checked=(NEW,))
    assert _outcomes([(a, "isolated"), (b, "leaky")], "5.26.0") == [Outcome.CHANGED, Outcome.REPRODUCED]
    assert _outcomes([(a, "isolated"), (b, "leaky")], NEW) == [Outcome.MISSED, Outcome.REPRODUCED]
    s = judge([a, b], [_cell(a, "isolated"), _cell(b, "leaky")], "5.26.0")[0]
    assert "record it as the finding's Fix" in s.news and "5.24.0, 5.25.0" in s.news


def test_a_cell_that_cannot_be_measured_is_cannot_judge_and_a_fixed_bug_that_returns_is_news():
    a, b = _finding("gpt_oss"), _finding("bert", fixed=Fix(NEW, "x"))
    s = judge([a, b], [_cell(a, "error"), _cell(b, "leaky")], "5.26.0")
    assert s[0].outcome is Outcome.UNJUDGED
    assert s[1].outcome is Outcome.REPRODUCED and "reproduces again" in s[1].news


def test_the_control_result_expects_the_clean_verdict_once_fixed_and_carries_the_versions():
    fixed, still = _finding("bert", fixed=Fix(NEW, "passes position_ids")), _finding("opt")
    cells = [_cell(fixed, "isolated"), _cell(still, "leaky")]
    r_fixed, r_still = [control(s, c) for s, c in zip(judge([fixed, still], cells, NEW), cells)]
    assert r_fixed.expected == "pass" and r_fixed.reproduced and r_fixed.message.startswith("fixed upstream in")
    assert r_fixed.evidence["finding"]["fixed"]["version"] == NEW
    assert r_still.expected == "fail" and r_still.reproduced
    assert r_still.evidence["finding"]["measured_on"] == {"transformers": "5.24.0", "torch": "2.13.0"}
    # missed on a recorded release: the control's known verdict stays the recorded one
    missed = control(judge([fixed, still], cells, "5.24.0")[0], _cell(fixed, "isolated"))
    assert missed.expected == "fail" and not missed.reproduced


def test_every_finding_records_where_it_was_measured_and_fixed_ones_name_the_change():
    for f in FINDINGS:
        assert f.measured_on.transformers and f.measured_on.torch, f
        assert f.fixed is None or (f.fixed.version and f.fixed.change), f
        assert not (f.fixed and f.fixed.version in f.checked_on), f   # fixed where it reproduced?
    assert {f.model_type for f in FINDINGS if f.fixed} >= {"bert", "roberta", "xmod"}


def test_an_older_release_is_not_a_change_upstream_and_a_pre_release_of_the_fix_counts_as_the_fix():
    bert, opt = _finding("bert", fixed=Fix(NEW, "passes position_ids")), _finding("opt")
    # clean on a release older than the one measured on: the bug came later, not news of a change
    s = judge([bert, opt], [_cell(bert, "isolated"), _cell(opt, "leaky")], "5.23.0")
    assert [x.outcome for x in s] == [Outcome.OLDER, Outcome.REPRODUCED] and "came in a later release" in s[0].news
    assert control(s[0], _cell(bert, "isolated")).expected == "pass"
    # a release candidate of the fix's release carries the fix
    assert _outcomes([(bert, "isolated"), (opt, "leaky")], "5.25.0rc1") == [Outcome.FIXED, Outcome.REPRODUCED]
    assert _outcomes([(bert, "isolated"), (opt, "leaky")], "5.26.0.dev0") == [Outcome.FIXED, Outcome.REPRODUCED]
    # an older release is vouched for only by a finding of the same probe that reproduced
    s = judge([bert, opt], [_cell(bert, "isolated"), _cell(opt, "isolated")], "5.23.0")
    assert s[0].outcome is Outcome.UNJUDGED


def test_a_version_that_is_not_a_release_number_cannot_be_judged_and_never_raises():
    bert, opt = _finding("bert", fixed=Fix(NEW, "x")), _finding("opt")
    s = judge([bert, opt], [_cell(bert, "isolated"), _cell(opt, "leaky")], "main-branch")
    assert [x.outcome for x in s] == [Outcome.UNJUDGED, Outcome.UNJUDGED]
    assert "not a release number" in s[0].news
