import os

import pytest

# Tests never reach a hub, like the product.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_dir():
    """The embedded tiny SDXL as a diffusers folder (built once, in the repo's model cache)."""
    from sdxl_lora.config import ModelConfig
    from sdxl_lora.sdxl.tiny import materialize_tiny

    return materialize_tiny(ModelConfig().cache_dir)
