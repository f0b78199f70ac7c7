"""reference/scratch.py: reused buffers and the one-pass zero test."""
import math

import torch
from trainprobes.reference.scratch import Scratch, any_nonzero, float32_copy


def test_a_name_reuses_its_buffer_while_it_fits_and_is_remade_otherwise():
    s = Scratch()
    a = s.get("x", (4, 8), torch.float32, "cpu")
    assert a.shape == (4, 8) and a.dtype == torch.float32
    b = s.get("x", (2, 3), torch.float32, "cpu")  # smaller: the same memory
    assert b.shape == (2, 3) and b.data_ptr() == a.data_ptr()
    c = s.get("x", (10, 10), torch.float32, "cpu")  # larger: a new buffer
    assert c.numel() == 100 and c.data_ptr() != a.data_ptr()
    # the views cached for the old buffer are dropped: a shape seen before now lives in
    # the new buffer, so a name never holds two buffers at once
    assert s.get("x", (2, 3), torch.float32, "cpu").data_ptr() == c.data_ptr()
    d = s.get("x", (4,), torch.int32, "cpu")  # another dtype: a new buffer
    assert d.dtype == torch.int32
    other = s.get("y", (4,), torch.int32, "cpu")  # names never share
    assert other.data_ptr() != s.get("x", (4,), torch.int32, "cpu").data_ptr()


def test_any_nonzero():
    assert not any_nonzero(torch.zeros(5))
    assert not any_nonzero(torch.tensor([0.0, -0.0]))
    assert not any_nonzero(torch.empty(0))
    assert any_nonzero(torch.tensor([0.0, 1e-45]))
    assert any_nonzero(torch.tensor([0.0, -3.0]))
    assert any_nonzero(torch.tensor([0.0, math.nan]))
    assert any_nonzero(torch.tensor([0, 0, 7], dtype=torch.int64))


def test_float32_copy_says_what_float32_lost():
    x = torch.tensor([1.5, 1 + 2.0 ** -40, math.nan, -0.0, 1e300], dtype=torch.float64)
    s, lost = float32_copy(x, Scratch())
    assert s.dtype == torch.float32 and torch.equal(s[:2], torch.tensor([1.5, 1.0]))
    assert lost[0] == 0 and lost[1] == -(2.0 ** -40) and lost[2].isnan() and lost[3] == 0
    assert lost[4].isinf()  # past float32's range: nothing of x is held
