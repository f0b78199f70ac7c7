import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny GEMMs: one intra-op thread is far faster than two on a shared, loaded machine.

    Use per module: `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
