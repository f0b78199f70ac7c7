"""probes/distributed/predict.py: one sample per distinct output, and a bias that matters."""
import math

import pytest
import torch
from trainprobes.distributed.predict import MIN_RELATIVE_BIAS, biased, distinct
from trainprobes.distributed.probe import emulate_collective, run_collective


def test_identical_ranks_count_once_and_different_ones_each():
    a, b, ref = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0])
    assert [t is not None for t in distinct([a, a.clone(), None, a], [ref] * 4)] == [True, False, False, False]
    assert [t is not None for t in distinct([a, b], [ref, ref])] == [True, True]
    # same bits but a different truth (reduce_scatter chunks that happen to agree): both count
    assert [t is not None for t in distinct([a, a], [ref, ref + 1])] == [True, True]


def test_real_all_reduce_is_judged_as_one_sample_like_the_emulator():
    # 4 ranks hold the same bits: counting each rank's copy made p 4x more certain
    # (fp32 gloo gradient data: p=3e-6 per rank copy, 0.02 once)
    kw = dict(world=4, dtype="fp32", op="sum", numel=4096, data="gradient")
    real = run_collective(backend="gloo", **kw)
    emulated = emulate_collective(algorithm="gloo", **kw)
    assert real.metrics["bitwise_match_fraction"] == 1.0
    assert real.metrics["bias_p"] == pytest.approx(emulated.metrics["bias_p"], rel=1e-9)
    assert real.metrics["bias_p"] > 1e-3 and real.verdict == "pass"


@pytest.mark.parametrize("p, rel, flagged, note", [
    (1e-9, 1e-9, False, "negligible"),    # significant, but no run can feel 1e-9
    (1e-9, -2e-6, True, ""),
    (0.5, 1e-2, False, ""),               # large but not significant
    (math.nan, 1e-2, False, ""),
])
def test_tp_b1_needs_significance_and_size(p, rel, flagged, note):
    got, why = biased({"bias_p": p, "bias_relative": rel})
    assert got is flagged and note in why
    assert MIN_RELATIVE_BIAS == 1e-6
