import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TURBOSPEC_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Random tiny transformers checkpoints of each dense architecture, saved to disk (float32)."""
    from tests.hf_tiny import build_all

    return build_all(tmp_path_factory.mktemp("hf"))
