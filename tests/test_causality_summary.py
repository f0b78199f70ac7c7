"""trainprobes.causality.summary: how kinds are tallied into the verdict, metrics and message."""
import torch
from trainprobes.causality.classify import Kind, Outputs
from trainprobes.causality.records import Findings, Flips, Isolation, ScoreChanges
from trainprobes.causality.summary import Setup, brief, summarise

T = 6
BASE = Outputs(torch.zeros(2, T, dtype=torch.long), None)
COMMON = dict(probe="causality.check", target="t", seed=0)


def setup(cuts=(2, 4)):
    return Setup(mode="perturb", layout="batched", atol=0.0, shape=[2, T], input_dtype="torch.int64",
                 cuts=list(cuts), trials=1, max_leaks=200)


def flips(cut, kinds, positions):
    k = torch.tensor([int(v) for v in kinds])
    n = len(k)
    return Flips(cut, 0, torch.zeros(n, dtype=torch.long), torch.tensor(positions), torch.ones(n, dtype=torch.long), k)


def test_every_kind_is_counted_where_it_belongs():
    f = flips(4, [Kind.STRUCTURAL, Kind.NUMERICAL, Kind.UNVERIFIED, Kind.UNCONFIRMED], [0, 1, 2, 4])
    res = summarise(COMMON, setup(), Findings(base=BASE, isolation=Isolation(True, []), flips=[f]))
    m = res.metrics
    assert (m["n_leaks"], m["n_structural"], m["n_unconfirmed"], m["n_numerical"], m["n_unverified"],
            m["n_flips"]) == (2, 1, 1, 1, 1, 4)
    assert res.verdict == "fail" and res.codes == ["TP-C1"] and m["causal"] is False
    # leaks (map, distances, rate): structural and unconfirmed; records: all but numerical
    assert res.evidence["leak_map"] == [[4, 0, 1], [4, 4, 1]]
    assert res.evidence["leak_distances"] == {"1": 1, "5": 1}
    assert [lk["kind"] for lk in res.evidence["leaks"]] == ["structural", "unverified", "unconfirmed"]
    assert [lk["kind"] for lk in res.evidence["numerical_flips"]] == ["numerical"]
    assert m["n_compared"] == 2 * (3 + 5) and m["flip_rate"] == 2 / 16


def test_unverified_alone_warns_and_a_batch_leak_fails():
    f = flips(2, [Kind.UNVERIFIED], [1])
    res = summarise(COMMON, setup(), Findings(base=BASE, isolation=Isolation(True, []), flips=[f]))
    assert res.verdict == "warn" and res.codes == ["TP-C1"] and res.metrics["causal"] is True
    assert "could not be settled" in res.message
    res = summarise(COMMON, setup(), Findings(base=BASE, isolation=Isolation(False, [[1, 3]])))
    assert res.verdict == "fail" and res.codes == ["TP-C3"] and "[[1, 3]]" in res.message


def test_a_score_leak_without_a_flipped_decision_is_named_as_such():
    s = ScoreChanges(4, 0, torch.tensor([1]), torch.tensor([4]), torch.tensor([0.25], dtype=torch.float64),
                     torch.tensor([int(Kind.STRUCTURAL)]))
    res = summarise(COMMON, setup(), Findings(base=BASE, isolation=Isolation(True, []), score_changes=[s]))
    assert res.metrics["causal"] is False and res.metrics["n_score_leaks"] == 1
    assert res.message.startswith("routing scores at 1 (batch, position, cut) depend on later tokens")
    assert res.evidence["score_leak_map"] == [[4, 4, 1]]


def test_brief_abridges_float_vectors_only():
    assert brief([1, 2, 3]) == "[1, 2, 3]"
    assert brief([0.5] * 8) == "[0.5, 0.5, 0.5, ...] (8 values)"


def test_the_message_and_first_leak_name_leaks_not_unverified_flips_and_survive_max_leaks_0():
    """Regression: a score leak with max_leaks=0 (no records kept) crashed the message with
    IndexError; first_leak_position and the message's first leak counted unverified flips."""
    s = ScoreChanges(4, 0, torch.tensor([1, 1]), torch.tensor([0, 4]), torch.tensor([1e-7, 0.25], dtype=torch.float64),
                     torch.tensor([int(Kind.UNVERIFIED), int(Kind.STRUCTURAL)]))
    for max_leaks in (0, 200):
        st = setup()
        st.max_leaks = max_leaks
        res = summarise(COMMON, st, Findings(base=BASE, isolation=Isolation(True, []), score_changes=[s]))
        assert res.metrics["causal"] is False
        assert ("first at position 4" in res.message) == (max_leaks > 0)
    f = flips(4, [Kind.UNVERIFIED, Kind.STRUCTURAL], [0, 3])
    res = summarise(COMMON, setup(), Findings(base=BASE, isolation=Isolation(True, []), flips=[f]))
    assert res.metrics["first_leak_position"] == 3 and "first at position 3" in res.message
    f = flips(4, [Kind.UNVERIFIED], [1])
    res = summarise(COMMON, setup(), Findings(base=BASE, isolation=Isolation(True, []), flips=[f]))
    assert res.verdict == "warn" and res.metrics["first_leak_position"] is None


def test_nan_decisions_cannot_pass():
    """Regression: an HF MoE block built alone (weights from torch.empty) returned all-NaN
    hidden states; a NaN that stays a NaN is no flip, so the check passed having compared
    nothing."""
    nan = Outputs(torch.full((2, T, 3), float("nan")), None)
    res = summarise(COMMON, setup(), Findings(base=nan, isolation=Isolation(True, [])))
    # nothing was compared: cannot judge (causal None, a fail), never a warn that exits 0
    assert res.verdict == "fail" and res.metrics["causal"] is None and "cannot judge" in res.message
    assert res.evidence["nan_decisions"] == 2 * T
    # some decisions NaN, others compared: judged on those, with a warning for the rest
    some = torch.zeros(2, T, 3)
    some[0, :2] = float("nan")
    res = summarise(COMMON, setup(), Findings(base=Outputs(some, None), isolation=Isolation(True, [])))
    assert res.verdict == "warn" and res.metrics["causal"] is True and "2 of" in res.message
    # every position holds a NaN feature, but the other features were compared: judged, a warn
    part = torch.zeros(2, T, 3)
    part[..., 0] = float("nan")
    res = summarise(COMMON, setup(), Findings(base=Outputs(part, None), isolation=Isolation(True, [])))
    assert res.verdict == "warn" and res.metrics["causal"] is True
    assert res.evidence["nan_decisions"] == 2 * T


def test_truncate_mode_never_says_no_decision_differs_beside_a_mismatch():
    # was: "no decisions that differ in the inference view" next to mismatch_rate 0.25,
    # the differences being within rounding noise (numerical) and excused
    s = setup()
    s.mode = "truncate"
    f = flips(4, [Kind.NUMERICAL, Kind.NUMERICAL], [0, 3])
    res = summarise(COMMON, s, Findings(base=BASE, isolation=Isolation(True, []), flips=[f]))
    m = res.metrics
    assert res.verdict == "pass" and m["mismatch_rate"] == 2 / 16
    assert "no decisions that differ in the inference view" not in res.message
    assert "beyond rounding noise" in res.message and "2 of 16" in res.message
    assert "mismatch_rate 0.125" in res.message
    # nothing differs at all: the plain sentence is true
    res = summarise(COMMON, s, Findings(base=BASE, isolation=Isolation(True, [])))
    assert res.metrics["mismatch_rate"] == 0 and "no decisions that differ in the inference view" in res.message
