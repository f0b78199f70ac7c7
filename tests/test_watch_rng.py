"""trainprobes.watch.rng.keep_rng: python's, numpy's and torch's global generators (CPU, and
CUDA where present) come back as they were, whichever of them the block draws from."""
import random

import numpy as np
import pytest
import torch
from trainprobes.watch.rng import keep_rng

DRAWS = {"python": lambda: random.random(), "numpy": lambda: np.random.random(),
         "torch": lambda: torch.rand(1), "seeded": lambda: (random.seed(7), np.random.seed(7),
                                                           torch.manual_seed(7))}
if torch.cuda.is_available():
    DRAWS["cuda"] = lambda: torch.rand(1, device="cuda")


def _states():
    return (random.getstate(), np.random.get_state(), torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _equal(a, b) -> bool:
    py, (kind, keys, *rest), cpu, cuda = a
    py2, (kind2, keys2, *rest2), cpu2, cuda2 = b
    return (py == py2 and kind == kind2 and np.array_equal(keys, keys2) and rest == rest2
            and torch.equal(cpu, cpu2)
            and (cuda is None or all(torch.equal(x, y) for x, y in zip(cuda, cuda2))))


@pytest.mark.parametrize("raises", [False, True])
@pytest.mark.parametrize("draw", list(DRAWS))
def test_every_global_generator_is_restored(draw, raises):
    random.random(), np.random.random(), torch.rand(1)  # away from any seed a draw sets
    before = _states()
    DRAWS[draw]()
    assert not _equal(before, _states()), "the draw must move a generator, or the test proves nothing"
    before = _states()
    try:
        with keep_rng():
            DRAWS[draw]()
            if raises:
                raise RuntimeError("a check that failed")
    except RuntimeError:
        pass
    assert _equal(before, _states()), f"{draw} moved"


def test_draws_after_the_block_are_those_without_it():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    plain = (random.random(), np.random.random(), torch.rand(1))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with keep_rng():
        for d in DRAWS.values():
            d()
    kept = (random.random(), np.random.random(), torch.rand(1))
    assert plain[:2] == kept[:2] and torch.equal(plain[2], kept[2])
