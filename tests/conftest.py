import os

# Keep the suite deterministic and light on a 2-core CPU machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
