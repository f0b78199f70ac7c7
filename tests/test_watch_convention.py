"""trainprobes.watch.convention: a batch's packing convention, read from what
DataCollatorWithFlattening and padding collators return (transformers 5.25, torch 2.13 CPU)."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.watch.convention import convention_of, document_starts
from trainprobes.watch.packing import packing_of


def _flat(lengths, **kw):
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(sum(lengths))
    feats = [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_tensors="pt", **kw)(feats)


def _padded(lengths):
    L = max(lengths)
    ids = torch.randint(1, 128, (len(lengths), L), generator=torch.Generator().manual_seed(L))
    mask = (torch.arange(L) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_token_values_and_lengths_do_not_change_the_convention():
    pytest.importorskip("transformers")
    a, b = _flat([5, 7, 4]), _flat([3, 9, 2, 6])
    assert convention_of(a) == convention_of(b)
    assert convention_of(a).packed and convention_of(a).positions == "restart"
    assert convention_of(_padded([5, 3])) == convention_of(_padded([9, 2, 4]))
    assert not convention_of(_padded([5, 3])).packed


def test_the_collator_trap_is_its_own_convention():
    """An all-ones 2-D mask beside restarting position ids, against the same batch without
    the mask, and a padded batch whose rows happen to be full."""
    pytest.importorskip("transformers")
    plain = _flat([5, 7])
    trap = {**plain, "attention_mask": torch.ones_like(plain["input_ids"])}
    c0, c1 = convention_of(plain), convention_of(trap)
    assert c0.mask == "absent" and c1.mask == "2d-ones" and c0 != c1
    assert convention_of(_padded([4, 4])).mask == "2d-ones"
    assert convention_of(_padded([4, 2])).mask == "2d-padded"


def test_flash_kwargs_and_seq_idx_say_packed_without_position_ids():
    """return_position_ids=False with the flash-attention kwargs: the offsets alone declare
    the documents, and the check tests them."""
    pytest.importorskip("transformers")
    b = _flat([5, 7, 4], return_position_ids=False, return_flash_attn_kwargs=True)
    c = convention_of(b)
    assert c.positions == "absent" and c.packed and "cu_seq_lens_q" in c.boundaries
    assert ("max_length_q", "int") in c.keys  # a python int whose value changes: its type only
    assert packing_of(b).lengths == ((5, 7, 4),)
    s = _flat([5, 7, 4], return_position_ids=False, return_seq_idx=True)
    assert convention_of(s).packed and packing_of(s).lengths == ((5, 7, 4),)


def test_boundaries_of_every_convention_are_tested_together():
    """position ids saying one document and seq_idx saying two: the check must test both."""
    ids = torch.arange(8)[None]
    b = {"input_ids": ids, "position_ids": torch.arange(8)[None],
         "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])}
    assert packing_of(b).lengths == ((3, 5),)


def test_a_restart_on_padding_is_not_a_document():
    """HF fills padding positions with 1: a right-padded row's position ids 'restart' at the
    padding, which is no document boundary (the mask drops those tokens)."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    b = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": mask, "position_ids": pos}
    c = convention_of(b)
    assert c.positions == "monotone" and not c.packed and document_starts(b) is None


def _mask4d(pos, block: bool, dtype=torch.bool):
    """[B, 1, L, L]: causal, and with block=True also within documents only."""
    L = pos.shape[-1]
    doc = (pos == 0).long().cumsum(-1)
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    if block:
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])
    if dtype == torch.bool:
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_a_4d_mask_that_crosses_documents_is_another_convention(dtype):
    """A block-diagonal 4-D mask and a full causal one have the same keys, dtypes and ranks:
    what tells them apart is whether the first token of a document may see the one before."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    base = {"input_ids": torch.ones(1, 8, dtype=torch.long), "position_ids": pos}
    blocks = convention_of({**base, "attention_mask": _mask4d(pos, True, dtype)})
    crosses = convention_of({**base, "attention_mask": _mask4d(pos, False, dtype)})
    assert blocks.mask == "4d-blocks" and crosses.mask == "4d-crosses" and blocks != crosses
    # blocked from the token just before, but not from the one before that: still crosses
    sly = _mask4d(pos, True, torch.bool)
    sly[0, 0, 3, 1] = True
    assert convention_of({**base, "attention_mask": sly}).mask == "4d-mixed"  # doc 1 crosses, doc 2 not
    sly[0, 0, 5, 0] = True
    assert convention_of({**base, "attention_mask": sly}).mask == "4d-crosses"


def test_the_attention_implementation_is_part_of_the_convention():
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    b = _flat([5, 7])
    sdpa, eager = tiny_model("llama", "sdpa"), tiny_model("llama", "eager")
    assert convention_of(b, sdpa).attention == "sdpa"
    assert convention_of(b, sdpa) != convention_of(b, eager)


def test_a_batch_that_is_not_a_dict_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="batch is a tuple"):
        convention_of((torch.ones(2, 3),))


def test_switches_count_by_value_data_by_type():
    """use_cache=False vs True in the batch, or in the model's config, is another convention
    (transformers 5.25 reads packed position ids into the mask only without a cache); an int
    whose value changes every batch (max_length_q) is not."""
    pytest.importorskip("transformers")
    from trainprobes.isolation.hf import tiny_model
    b = _flat([5, 7])
    assert convention_of({**b, "use_cache": False}) != convention_of({**b, "use_cache": True})
    assert convention_of({**b, "n": 3}) == convention_of({**b, "n": 4})
    model = tiny_model("llama", "sdpa")
    before = convention_of(b, model)
    model.config.use_cache = not model.config.use_cache
    assert convention_of(b, model) != before


@pytest.mark.parametrize("key", ["seq_idx", "cu_seq_lens_q"])
@pytest.mark.parametrize("positions", ["monotone", "absent"])
def test_a_4d_mask_is_read_at_every_declared_boundary(key, positions):
    """Documents declared by seq_idx or cu_seq_lens (position ids monotone across documents,
    or absent): a block-diagonal 4-D mask and a full causal one are still two conventions,
    else a leaky mask after an isolated one goes unchecked."""
    L, lens = 12, [4, 5, 3]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    base = {"input_ids": torch.ones(1, L, dtype=torch.long),
            key: seq if key == "seq_idx" else torch.tensor([0, 4, 9, 12], dtype=torch.int32)}
    if positions == "monotone":
        base["position_ids"] = torch.arange(L)[None]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    block = causal & (seq[0][:, None] == seq[0][None, :])
    b = convention_of({**base, "attention_mask": block[None, None]})
    c = convention_of({**base, "attention_mask": causal[None, None]})
    assert (b.mask, c.mask) == ("4d-blocks", "4d-crosses")


def test_a_4d_mask_broadcast_over_the_batch_is_read():
    """A [1, 1, L, L] mask beside B rows (broadcast by the attention) is read row by row."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 0, 1, 0, 1, 2]])
    base = {"input_ids": torch.ones(2, 8, dtype=torch.long), "position_ids": pos}
    assert convention_of({**base, "attention_mask": _mask4d(pos[:1], True)}).mask == "4d-blocks"
    assert convention_of({**base, "attention_mask": _mask4d(pos[:1], False)}).mask == "4d-crosses"


@pytest.mark.parametrize("pos", [
    torch.arange(8).repeat(3, 1, 1),          # multimodal RoPE: [3, B, L] (Qwen2-VL)
    [[0, 1, 2, 0, 1, 2, 3, 4]],               # a python list
], ids=["mrope-3d", "list"])
def test_position_ids_that_cannot_be_read_are_not_called_absent(pos):
    """position_ids present but not a [B, L] / [L] tensor: whether they restart is unknown,
    never 'absent' (which would make a packed batch 'not packed': nothing checked, said nowhere)."""
    c = convention_of({"input_ids": torch.ones(1, 8, dtype=torch.long), "position_ids": pos})
    assert c.positions == "unread" and not c.packed


def test_left_padding_is_not_a_document():
    """transformers' position ids for a left-padded row (generate, and collators that pad on
    the left): cumsum(mask) - 1 with padding filled by 1, so [1, 1, 0, 1, 2]. The drop to 0
    at the first real token follows padding: no document boundary."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    b = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": mask, "position_ids": pos}
    c = convention_of(b)
    assert c.positions == "monotone" and not c.packed and document_starts(b) is None


def test_a_2d_mask_of_document_ids_declares_documents():
    """axolotl's sample packing writes each token's document number into the 2-D
    attention_mask ([1, 1, 1, 2, 2, 3, ...], 0 for padding): packed even without position
    ids; transformers' sdpa and eager read any nonzero as 'attend', so it must be checked."""
    mask = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    b = {"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": mask}
    c = convention_of(b)
    assert c.mask == "2d-ids" and c.packed
    assert packing_of(b).lengths == ((3, 2, 3), (8,))
    assert convention_of({**b, "attention_mask": (mask != 0).long()}).mask == "2d-padded"
