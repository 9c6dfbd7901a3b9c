import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels' tests run in Triton's interpreter (turbospec.kernels.gpu)
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("TURBOSPEC_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Random tiny transformers checkpoints of each dense architecture, saved to disk (float32)."""
    from tests.hf_tiny import build_all

    return build_all(tmp_path_factory.mktemp("hf"))
