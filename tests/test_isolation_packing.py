"""Packing: every convention derived from document lengths, and read back from it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.errors import InvalidArgument
from trainprobes.isolation import Packing

rows_of_lengths = st.integers(1, 3).flatmap(
    lambda B: st.integers(2, 24).flatmap(
        lambda L: st.lists(st.lists(st.integers(1, L), min_size=1, max_size=6)
                           .map(lambda ns, L=L: _fit(ns, L)), min_size=B, max_size=B)))


def _fit(ns, L):
    """Lengths summing to exactly L: cut the running sum at L, pad the rest."""
    out, total = [], 0
    for n in ns:
        n = min(n, L - total)
        if n:
            out.append(n)
            total += n
    if total < L:
        out.append(L - total)
    return out


@settings(max_examples=20, deadline=None)
@given(rows_of_lengths)
def test_every_convention_reads_back_the_same_documents(lengths):
    p = Packing.of(lengths)
    assert Packing.from_doc_ids(p.doc_ids()) == p
    assert Packing.from_position_ids(p.position_ids()) == p
    assert Packing.from_cu_seqlens(p.cu_seqlens(), rows=p.batch) == p
    assert [d.length for d in p.documents] == [n for row in lengths for n in row]


@settings(max_examples=15, deadline=None)
@given(rows_of_lengths)
def test_block_mask_is_same_document_and_causal(lengths):
    p = Packing.of(lengths)
    ids = p.doc_ids()
    L = p.length
    m = p.block_mask()
    for b in range(p.batch):  # the rule written out element by element, as a reference
        want = torch.tensor([[bool(ids[b, i] == ids[b, j] and j <= i) for j in range(L)]
                             for i in range(L)])
        assert torch.equal(m[b, 0], want)
    add = p.block_mask(torch.float32)
    assert torch.equal(add == 0, m) and (add[~m] == torch.finfo(torch.float32).min).all()


def test_position_ids_restart_at_each_document():
    p = Packing.of([3, 2, 4])
    assert p.position_ids().tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert p.cu_seqlens().tolist() == [0, 3, 5, 9] and p.max_seqlen == 4
    assert p.global_doc_ids().tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    two = Packing.of([[2, 2], [1, 3]])
    assert two.global_doc_ids().tolist() == [[0, 0, 1, 1], [2, 3, 3, 3]]
    assert two.tile(2).lengths == ((2, 2), (1, 3), (2, 2), (1, 3))


@pytest.mark.parametrize("bad, match", [
    ([], "document lengths"), ([[]], "one non-empty list"), ([[2, 2], [3]], "same length"), ([0, 3], ">= 1"),
    ("abc", "document lengths")])
def test_bad_lengths_name_the_value(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        Packing.of(bad)


def test_cu_seqlens_crossing_a_row_is_refused():
    with pytest.raises(InvalidArgument, match="crosses the row boundary"):
        Packing.from_cu_seqlens([0, 3, 8], rows=2)


def test_a_sliding_window_keeps_the_last_keys_of_the_same_document():
    m = Packing.of([5, 3]).block_mask(window=2)[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False, False, False]
    assert m[5].tolist() == [False] * 5 + [True, False, False]  # a document's first token
