"""Fixed twins are never called biased: every zoo fixed twin over several seeds, judged at
the defaults (never biased) and at alpha 0.05 without the min_effect floor (the paired
tests' false-positive rate within a binomial bound of alpha). One set of ranks for all."""
import pytest
from scipy import stats
from trainprobes.distributed.launcher import launch
from trainprobes.transforms.equivalence import finish, prepare
from trainprobes.transforms.worker import RankCase, cases_task
from trainprobes.transforms.zoo import zoo_probes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
SEEDS = 5


def test_fixed_twins_are_never_biased_and_the_rate_at_alpha_holds():
    probes = [p for seed in range(SEEDS) for p in zoo_probes(trials=8, seed=seed, fixed_only=True)]
    prepared = [prepare(p, 2) for p in probes]
    outs = launch(cases_task, 2, args=([RankCase(p.probe.step, p.probe.transform, p.seeds)
                                        for p in prepared], "gloo"))[0]["cases"]
    at_default = [finish(p, o, world=2, backend="gloo") for p, o in zip(prepared, outs)]
    assert [r.metrics["transform_verdict"] for r in at_default if r.metrics["transform_verdict"] not in
            ("exact", "noise")] == []
    strict = [finish(p._replace(probe=p.probe.__class__(**{**p.probe.__dict__, "alpha": 0.05,
                                                            "min_effect": 0.0})), o, world=2, backend="gloo")
              for p, o in zip(prepared, outs)]
    biased = sum(r.metrics["transform_verdict"] == "biased" for r in strict)
    assert biased <= stats.binom.ppf(0.999, len(strict), 0.05), biased
    assert all(r.metrics["transform_verdict"] in ("exact", "noise", "biased") for r in strict)
