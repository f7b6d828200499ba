import os

import pytest

# Tests never reach a hub, like the product.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# Under pytest-xdist (`-n 2`, pyproject's addopts) each worker is one process per core: one thread each
# (and in the training processes tests start), or the workers' thread pools fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir():
    """The embedded tiny SDXL as a diffusers folder (built once, in the repo's model cache)."""
    from sdxl_lora.core.config import ModelConfig
    from sdxl_lora.sdxl.tiny import materialize_tiny

    return materialize_tiny(ModelConfig().cache_dir)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: the tiny models gain nothing from a second, and when the other
    core is busy its spin-waits make each UNet call up to 100x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
