import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
