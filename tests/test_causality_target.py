"""trainprobes.causality.target: `differs` (its one-pass form at atol 0 against the float64
definition) and `same` (never says equal where differs sees a change)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.causality.target import differs, same

SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, 1.0 + 2 ** -23, 1e-45, 3e38]


def reference(a: torch.Tensor, b: torch.Tensor, atol: float) -> torch.Tensor:
    """The definition: |a - b| > atol in float64, or NaN on one side only; NaN beside NaN no."""
    a64, b64 = a.double(), b.double()
    d = ((a64 - b64).abs() > atol) | (a64.isnan() != b64.isnan())
    d &= ~(a64.isnan() & b64.isnan())
    return d.reshape(*d.shape[:2], -1).any(-1) if d.dim() > 2 else d


values = st.lists(st.sampled_from(SPECIAL) | st.floats(-1e3, 1e3, width=32), min_size=24, max_size=24)


@settings(max_examples=200, deadline=None)
@given(values, values, st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       st.sampled_from([0.0, 1e-6, 0.5]), st.sampled_from([(2, 12), (2, 3, 4)]))
def test_differs_is_the_float64_definition(a, b, dtype, atol, shape):
    a, b = torch.tensor(a).to(dtype).view(*shape), torch.tensor(b).to(dtype).view(*shape)
    b = torch.where(torch.arange(24).view(*shape) % 3 == 0, a, b)  # many equal pairs too
    want = reference(a, b, atol)
    assert torch.equal(differs(a, b, atol), want)
    if same(a, b):
        assert not want.any()


def test_same_says_no_to_nan_and_other_shapes():
    a = torch.tensor([[1.0, float("nan")]])
    assert not same(a, a.clone()) and not differs(a, a.clone(), 0.0).any()  # differs decides
    assert not same(a, a[:, :1]) and same(a[:, :1], a[:, :1].clone())
    assert same(torch.tensor([[0.0]]), torch.tensor([[-0.0]]))
    ids = torch.tensor([[1, 2, 3]])
    assert same(ids, ids.clone()) and differs(ids, ids + (ids == 3), 0.0).tolist() == [[False, False, True]]
