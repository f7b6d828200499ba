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


# The files whose tests take longest start first: pytest-xdist (--dist loadfile) hands out whole files in
# collection order, and a long file handed out last keeps one worker busy while the other has nothing left.
FIRST = ("test_train.py", "test_ui.py", "test_durability.py", "test_speed.py", "test_multiprocess.py",
         "test_adapter_kinds.py", "test_faults.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


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
