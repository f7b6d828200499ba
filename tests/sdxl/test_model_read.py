"""Reading a diffusers folder's UNet onto the training device on a thread of its own (sdxl/model.py: UNetReader),
beside the pipeline's imports and the other components: the same model as diffusers' loader makes, and a bad
folder refused as before, with no read left running."""
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdxl_lora.sdxl.config import ModelConfig
from sdxl_lora.sdxl.model import ModelError, _load_component, load_pipeline

UNET = "unet/diffusion_pytorch_model.safetensors"


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sdxl-lora-unet-read"]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_the_unet_read_beside_the_rest_is_the_model_diffusers_loads(tiny_dir, tmp_path, sharded):
    dtype = torch.bfloat16  # the tiny folder stores fp32: each tensor is cast as it is read
    if sharded:  # the UNet in several files and their index, as large checkpoints are saved
        d = _copy(tiny_dir, tmp_path)
        _load_component(d, "unet", torch.float32).save_pretrained(d / "unet", max_shard_size="4MB")
        (d / UNET).unlink()
        assert len(list((d / "unet").glob("*.safetensors"))) > 1
        tiny_dir = d
    pipe = load_pipeline(ModelConfig(path=str(tiny_dir)), unet_dtype=dtype, unet_device=torch.device("cpu"),
                         encoders_as_stored=True)
    ref = _load_component(tiny_dir, "unet", dtype)
    got = pipe.unet
    assert type(got) is type(ref) and not got.training
    assert dict(got.config) == dict(ref.config)
    want = ref.state_dict()
    have = got.state_dict()
    assert have.keys() == want.keys()
    for k, v in want.items():
        assert have[k].dtype == dtype and have[k].device.type == "cpu" and torch.equal(have[k], v), k
    assert all(p.requires_grad for p in got.parameters())  # as loaded: training freezes what it freezes
    # Nothing left on the meta device (a buffer the files do not hold would be): every tensor is the read's.
    assert all(t.device.type == "cpu" for t in (*got.parameters(), *got.buffers()))
    assert not _readers()


def _copy(tiny_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    return d


def test_a_folder_refused_while_the_unet_is_read_leaves_no_read_running(tiny_dir, tmp_path):
    # The UNet's file lacks tensors: refused naming it, as diffusers' loader path refuses it.
    d = _copy(tiny_dir, tmp_path)
    sd = load_file(str(d / UNET))
    save_file({k: v for k, v in sd.items() if k not in sorted(sd)[:2]}, str(d / UNET))
    with pytest.raises(ModelError, match="copy it again") as e:
        load_pipeline(ModelConfig(path=str(d)), unet_device=torch.device("cpu"))
    assert str(d / UNET) in str(e.value)
    assert not _readers()
    # The VAE's lacks tensors, found while the UNet's read runs: refused naming the VAE; the read stopped.
    d = _copy(tiny_dir, tmp_path / "vae")
    vae = d / "vae" / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(vae))
    save_file({k: v for k, v in sd.items() if k not in sorted(sd)[:2]}, str(vae))
    with pytest.raises(ModelError, match="copy it again") as e:
        load_pipeline(ModelConfig(path=str(d)), unet_device=torch.device("cpu"))
    assert str(d / "vae") in str(e.value)
    assert not _readers()
