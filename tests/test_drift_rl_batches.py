"""trainprobes.drift.rl_batches: verl, NeMo-RL and OpenRLHF batches, built here in each
package's own layout (padding side, position shift, masks, packing) from one set of ragged
responses, read back to exactly the same tokens: the monitor's verdict on the batch equals
`compare` on the responses themselves. verl, NeMo-RL and OpenRLHF need a GPU engine (vLLM,
Ray) and are not installed here; their containers are stood in for by the same fields."""
from dataclasses import dataclass, fields

import pytest
import torch
from trainprobes.drift import DriftMonitor, compare
from trainprobes.drift.rl_batches import nemo_rl_pair, openrlhf_pair, verl_pair
from trainprobes.errors import InvalidArgument, InvalidType

LENGTHS = [5, 9, 3, 12, 7, 1, 10, 8]
PROMPTS = [4, 2, 6, 3, 5, 4, 2, 6]


def _responses(offset=0.0, seed=0):
    """Per response: the trainer's and the sampler's log-probs (ragged lists)."""
    g = torch.Generator().manual_seed(seed)
    train = [-torch.rand(n, generator=g) * 3 for n in LENGTHS]
    infer = [(t + torch.randn(n, generator=g) * 0.02 + offset).clamp(max=0) for t, n in zip(train, LENGTHS)]
    return train, infer


def _truth(train, infer):
    return compare(torch.cat(train), torch.cat(infer), lengths=LENGTHS).metrics


def _monitor(p):
    mon = DriftMonitor()
    mon.update(p.train, p.infer, p.mask, p.lengths)
    return mon.summary().metrics


def _same(got, want):
    for k in ("n_tokens", "n_units", "mean_log_ratio", "se_mean", "p_value", "k3_kl", "biased",
              "drift_verdict"):
        if isinstance(want[k], float):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-12), k
        else:
            assert got[k] == want[k], k


class DataProto:
    """verl's container: tensors in .batch (a TensorDict there; keys() and [] are what is read)."""

    def __init__(self, batch):
        self.batch = batch


def _verl(train, infer, R=14, use_attention=False):
    B = len(LENGTHS)
    P = max(PROMPTS)
    old, roll = torch.zeros(B, R), torch.zeros(B, R)
    resp_mask = torch.zeros(B, R, dtype=torch.int64)
    attn = torch.zeros(B, P + R, dtype=torch.int64)
    for b, (t, i) in enumerate(zip(train, infer)):
        n = t.numel()
        old[b, :n], roll[b, :n] = t, i  # responses right-padded
        resp_mask[b, :n] = 1
        attn[b, P - PROMPTS[b]:P + n] = 1  # prompt left-padded, then the response
    batch = {"old_log_probs": old, "rollout_log_probs": roll, "responses": torch.zeros(B, R, dtype=torch.long),
             "attention_mask": attn}
    if not use_attention:
        batch["response_mask"] = resp_mask
    return DataProto(batch)


@pytest.mark.parametrize("offset", [0.0, 0.01])
@pytest.mark.parametrize("use_attention", [False, True])
def test_verl_batch_reads_the_response_tokens(offset, use_attention):
    train, infer = _responses(offset)
    want = _truth(train, infer)
    assert want["biased"] is (offset > 0)  # the cases differ: a misread batch cannot match both
    _same(_monitor(verl_pair(_verl(train, infer, use_attention=use_attention))), want)


def _nemo(train, infer, S=20, drop=None):
    B = len(LENGTHS)
    prev, gen = torch.zeros(B, S), torch.zeros(B, S)
    token_mask = torch.zeros(B, S)
    for b, (t, i) in enumerate(zip(train, infer)):
        p, n = PROMPTS[b], t.numel()
        prev[b, p:p + n], gen[b, p:p + n] = t, i  # entry j: log-prob of token j (prompt first)
        prev[b, 1:p] = -torch.rand(p - 1)  # the policy scores prompt tokens too; masked out
        token_mask[b, p:p + n] = 1
    sample_mask = torch.ones(B)
    if drop is not None:
        sample_mask[drop] = 0
    return {"prev_logprobs": prev, "generation_logprobs": gen, "token_mask": token_mask,
            "sample_mask": sample_mask, "input_ids": torch.zeros(B, S, dtype=torch.long)}


@pytest.mark.parametrize("offset", [0.0, 0.01])
def test_nemo_rl_data_reads_generated_tokens_after_the_shift(offset):
    train, infer = _responses(offset)
    _same(_monitor(nemo_rl_pair(_nemo(train, infer))), _truth(train, infer))


def test_nemo_rl_sample_mask_drops_a_sample():
    train, infer = _responses(0.01)
    got = _monitor(nemo_rl_pair(_nemo(train, infer, drop=3)))
    keep = [i for i in range(len(LENGTHS)) if i != 3]
    want = compare(torch.cat([train[i] for i in keep]), torch.cat([infer[i] for i in keep]),
                   lengths=[LENGTHS[i] for i in keep]).metrics
    _same(got, want)


@dataclass
class Experience:
    """OpenRLHF's Experience, the fields read (the real one has more, all optional)."""

    sequences: torch.Tensor = None
    action_log_probs: torch.Tensor = None
    rollout_log_probs: torch.Tensor = None
    action_mask: torch.Tensor = None
    base_action_log_probs: torch.Tensor = None


def test_openrlhf_experience_right_padded_actions():
    train, infer = _responses(0.01)
    A = max(LENGTHS)
    B = len(LENGTHS)
    alp, rlp, am = torch.zeros(B, A), torch.zeros(B, A), torch.zeros(B, A, dtype=torch.bool)
    for b, (t, i) in enumerate(zip(train, infer)):
        alp[b, :t.numel()], rlp[b, :t.numel()], am[b, :t.numel()] = t, i, True
    exp = Experience(sequences=torch.zeros(B, 20, dtype=torch.long), action_log_probs=alp,
                     rollout_log_probs=rlp, action_mask=am)
    assert [f.name for f in fields(exp)][1] == "action_log_probs"
    _same(_monitor(openrlhf_pair(exp)), _truth(train, infer))


def test_openrlhf_packed_samples_keep_each_response_a_unit():
    train, infer = _responses(0.01)
    pad = 5  # packed buffers end in padding
    alp = torch.cat([*train, torch.zeros(pad)])[None]
    rlp = torch.cat([*infer, torch.zeros(pad)])[None]
    am = torch.cat([torch.ones(sum(LENGTHS), dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])[None]
    exp = Experience(action_log_probs=alp, rollout_log_probs=rlp, action_mask=am)
    _same(_monitor(openrlhf_pair(exp, lengths=LENGTHS)), _truth(train, infer))
    with pytest.raises(InvalidArgument, match="sum to at most"):
        openrlhf_pair(exp, lengths=[100, 100])


def test_missing_field_is_named_with_what_works():
    train, infer = _responses()
    b = _verl(train, infer)
    del b.batch["rollout_log_probs"]
    with pytest.raises(InvalidArgument, match=r"no 'rollout_log_probs' \(set actor_rollout_ref.rollout"):
        verl_pair(b)
    d = _nemo(train, infer)
    del d["generation_logprobs"]
    with pytest.raises(InvalidArgument, match="no 'generation_logprobs'"):
        nemo_rl_pair(d)
    with pytest.raises(InvalidArgument, match="no 'rollout_log_probs'"):
        openrlhf_pair(Experience(action_log_probs=torch.zeros(2, 3)))
    with pytest.raises(InvalidType, match="expected the package's batch"):
        verl_pair(42)


def test_shapes_and_values_are_checked():
    train, infer = _responses()
    b = _verl(train, infer)
    b.batch["response_mask"] = b.batch["response_mask"][:, :-1]
    with pytest.raises(InvalidArgument, match=r"\['response_mask'\] has shape \(8, 13\), expected \(8, 14\)"):
        verl_pair(b)
    d = _nemo(train, infer)
    d["sample_mask"] = torch.ones(3)
    with pytest.raises(InvalidArgument, match="sample_mask'] has shape"):
        nemo_rl_pair(d)
    b = _verl(train, infer)
    b.batch["rollout_log_probs"][2, 1] = 0.5  # a probability-like value, not a log-prob
    with pytest.raises(InvalidArgument, match=r"infer_logprobs\[2, 1\] = 0.5 is not a log-probability"):
        DriftMonitor().update(*verl_pair(b))
    b.batch["rollout_log_probs"][2, 1] = float("nan")
    with pytest.raises(InvalidArgument, match="is not a log-probability"):
        DriftMonitor().update(*verl_pair(b))
