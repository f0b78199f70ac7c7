"""The plugin's assert_engines_agree: identical engines pass up to exact, a noise pair up to
noise only, a faulty engine fails naming the stage, op and kind."""
import pytest

pytest_plugins = ["pytester"]

TESTS = '''
import copy
import torch
from trainprobes.drift.faults import in_dtype
from trainprobes.reference.models.stack import TinyStack

A = TinyStack(seed=0)
IDS = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(0))

def test_identical_exact(trainprobes):
    trainprobes.assert_engines_agree(A, copy.deepcopy(A), IDS, up_to="exact")

def test_noise_pair_noise(trainprobes):
    b = copy.deepcopy(A)
    in_dtype(b.blocks[1].mlp, torch.float64)
    trainprobes.assert_engines_agree(A, b, IDS)

def test_noise_pair_not_exact(trainprobes):
    b = copy.deepcopy(A)
    in_dtype(b.blocks[1].mlp, torch.float64)
    trainprobes.assert_engines_agree(A, b, IDS, up_to="exact")

def test_bf16_block_fails(trainprobes):
    b = copy.deepcopy(A)
    in_dtype(b.blocks[2].mlp, torch.bfloat16)
    trainprobes.assert_engines_agree(A, b, IDS)
'''


@pytest.mark.slow
def test_assert_engines_agree(pytester):
    pytester.makepyfile(test_engines=TESTS)
    res = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=2, failed=2)
    out = res.stdout.str()
    assert "engines not bit-identical" in out and "kind = noise" in out
    assert "numeric: first stage beyond noise blocks.2 (op mlp: blocks.2.mlp; numerics 100%)" in out
