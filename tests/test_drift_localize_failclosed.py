"""drift.localize fails closed and finds what lies outside the hooked stages: non-finite
engine log-probs, post-lm_head faults (a soft-cap dropped, a logit rescale), a batch leak."""
import copy
import math

import pytest
import torch
from trainprobes.drift.decompose import localize
from trainprobes.drift.engines import Engine
from trainprobes.errors import InvalidArgument

pytest.importorskip("transformers")
from trainprobes.isolation.hf import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))


def _nan_half(z):
    lp = torch.log_softmax(z.float(), -1)
    lp[::2] = math.nan
    return lp


def _neginf_but_zero(z):
    lp = torch.full(z.shape, -math.inf)
    lp[..., 0] = 0.0
    return lp


@pytest.mark.parametrize("lp_b, words", [(_nan_half, r"NaN or \+inf"), (_neginf_but_zero, "finite log-prob")])
def test_nonfinite_engine_logprobs_cannot_be_judged(lp_b, words):
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=2)
    ids = IDS.clamp_min(1)  # no token is id 0: every scored token is -inf under _neginf_but_zero
    with pytest.raises(InvalidArgument, match=words):
        localize(Engine(a), Engine(copy.deepcopy(a), lp_b), ids)
