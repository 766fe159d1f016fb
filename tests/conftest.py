import pytest
import torch

# The suite runs tiny tensors: intra-op threads only add overhead, and on a loaded 2-core
# machine OpenMP spin-waits made tiny-model tests ~50x slower.
torch.set_num_threads(1)

from coolsd.theory import TabularAR


@pytest.fixture(scope="session")
def lab_pair():
    """A target and a drafter at a moderate distance (V=3, N=4)."""
    P = TabularAR.random(3, 4, seed=0)
    R = TabularAR.random(3, 4, seed=1)
    return P, TabularAR.mix(P, R, 0.5)
