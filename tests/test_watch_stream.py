"""trainprobes.watch.stream: a stream called biased at a look stays biased at every later
look and at close (the sequential test's decision stands)."""
import torch
from trainprobes.watch import Sentinel
from trainprobes.watch.stream import Streams, look_alpha
from trainprobes.watch.updates import UpdateWatch

# 8 errors whose t-test p (0.0019) is under look 1's level (0.0061, one stream) and over
# look 2's (0.0015): called biased at look 1, not at look 2 on the same samples
ERRORS = [(x + 0.05) * 1e-3 for x in (-1.0, -1.2, -0.8, -1.1, -0.9, -1.3, -0.7, 0.2)]


def test_the_errors_sit_between_the_two_looks_levels():
    from scipy import stats
    p = stats.ttest_1samp(ERRORS, 0).pvalue
    assert look_alpha(0.01, 2, 1) < p < look_alpha(0.01, 1, 1), p


def test_a_biased_stream_stays_biased_at_later_looks_quick_or_full():
    st = Streams(alpha=0.01, min_effect=2.0 ** -12, keep=100)
    s = st.stream("b", 10)
    for i, e in enumerate(ERRORS):
        s.add(i, e)
    (j1,) = st.look(10)
    assert j1.biased and s.found_at == 10
    (j2,) = st.look(20)  # the quick path would clear it at this level
    (j3,) = st.look(30, full=True)
    assert j2.biased and j3.biased and s.found_at == 10
    assert j3.stats["p_value"] > j3.alpha  # this look alone would not have called it


def test_the_sentinels_final_result_is_not_a_pass_after_a_finding(tmp_path):
    """Before: the finding (fail at step 10) was written, then close() judged the same samples
    at look 2's stricter level and wrote a final 'pass, noise' for the same bucket."""
    s = Sentinel(rank=0)
    stream = s.streams.stream("bucket0", 1000)
    for i, e in enumerate(ERRORS):
        stream.add(i, e)
    found = []
    for _ in range(10):
        found += s.step()
    assert [r.verdict for r in found] == ["fail"]
    final = [r for r in s.close() if r.evidence.get("look") == 2]
    assert [r.verdict for r in final] == ["fail"] and final[0].codes == ["TP-B1"], final[0].message
    assert "biased since step 10" in final[0].message


def test_the_update_watchs_final_result_is_not_a_pass_after_a_finding():
    p = torch.nn.Parameter(torch.zeros(4))
    s = Sentinel(rank=0)
    w = UpdateWatch(s, torch.optim.SGD([p], lr=0.1), every=1, elements=4, seed=0)
    st = w.streams.stream("all_groups", 4)
    for i, e in enumerate(ERRORS):
        st.add(i, e)
    found = w.step(9)  # the look after step 9: look 1
    assert [r.verdict for r in found] == ["fail"]
    (final,) = w.close()
    assert final.verdict == "fail" and "biased since step 10" in final.message, final.message


def _fades(stream, n_after=60):
    """A stream biased low for its first samples, then unbiased and a little high: the
    finding's samples fall out of `keep`, the latest ones read slightly positive."""
    for i, e in enumerate(ERRORS):
        stream.add(i, e)
    return lambda: [stream.add(100 + i, (1.0 + 0.1 * (-1) ** i) * 1e-6) for i in range(n_after)]


def _faded_bucket_result():
    """The final Result of a bucket stream called biased at look 1 whose bias then faded."""
    s = Sentinel(rank=0, keep=20)
    after = _fades(s.streams.stream("bucket0", 1000))
    for _ in range(10):
        s.step()
    after()
    (final,) = [r for r in s.close() if r.evidence.get("look") == 2]
    return final


def test_a_finding_that_fades_is_reported_as_found_not_as_its_opposite():
    """A bias that went away keeps its verdict (the sequential decision stands), but the Result
    must say what was found (too small, at which look, with its figures) and that the latest
    samples no longer show it: before, close() printed the latest samples' sign ('too large',
    p=0) beside 'biased since step 10', the opposite of the finding."""
    final = _faded_bucket_result()
    assert final.verdict == "fail"
    assert "too small" in final.message and "too large" not in final.message, final.message
    assert final.evidence["found"]["bias"] < 0 and final.evidence["found"]["look"] == 1
    assert final.evidence["biased_at_this_look"] is False
    assert "no longer" in final.message, final.message


def test_a_faded_update_finding_says_lost_not_inflated():
    p = torch.nn.Parameter(torch.zeros(4))
    s = Sentinel(rank=0, keep=20)
    w = UpdateWatch(s, torch.optim.SGD([p], lr=0.1), every=1, elements=4, seed=0)
    after = _fades(w.streams.stream("all_groups", 4))
    w.step(9)
    after()
    (final,) = w.close()
    assert final.verdict == "fail"
    assert "lost" in final.message and "inflated" not in final.message, final.message
    assert final.evidence["found"]["bias"] < 0 and "no longer" in final.message


def test_the_findings_figures_survive_a_json_round_trip():
    from trainprobes.result import Result
    final = _faded_bucket_result()
    again = Result.from_json(final.to_json())
    assert again.evidence["found"] == final.evidence["found"]


def test_a_bucket_relayout_after_a_finding_keeps_the_finding():
    """DDP rebuilding its buckets starts a bucket's stream afresh (its samples were of another
    layout); a finding already made on that bucket must not end as a final pass."""
    s = Sentinel(rank=0)
    for i, e in enumerate(ERRORS):
        s._record("bucket0", 1000, i, torch.tensor([1.0 + e]), torch.tensor([1.0]))
    found = []
    for _ in range(10):
        found += s.step()
    assert [r.verdict for r in found if r.target.endswith("bucket0")] == ["fail"]
    for i in range(20):  # re-laid out: another size, exact reductions
        s._record("bucket0", 2000, 10 + i, torch.tensor([1.0]), torch.tensor([1.0]))
    (final,) = [r for r in s.close() if r.target.endswith("bucket0") and r.evidence.get("look") == 2]
    assert s.relayouts == 1
    assert final.verdict == "fail" and "biased since step 10" in final.message, final.message
