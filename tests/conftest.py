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


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU code path: on a GPU where there is one (made the current device for the test), else as on a GPU with
    the C++ kernels off and the Triton kernels interpreted on the CPU."""
    from turbospec import device
    from turbospec.kernels import gpu

    if not torch.cuda.is_available():
        monkeypatch.setattr(device, "cpu_kernels", lambda: False)
        monkeypatch.setattr(gpu, "ON_CPU", True)
        yield
        return
    device.use("cuda")
    yield
    device.use("cpu")
