"""What a user sees when something goes wrong (docs/training.md, "When something goes wrong"): one paragraph
on stderr naming the file or field and what to do, exit code 2 for bad input and 1 for the machine, no
traceback, and nothing half-written left behind. CPU, the tiny models.

Faults tested where their subject lives, not repeated here:
  - a full disk during a state save and at the final export; SIGKILL mid-save and mid-step; a truncated
    newest state; Ctrl-C; two starts of one run name; a start killed before its config.toml was whole;
    resume with another plan or dataset: tests/test_durability.py
  - the config fuzz over the whole schema (inf, nan, negatives, zero, ranges; a file that is not UTF-8):
    tests/test_config.py
  - images of each damaged kind, decoded at the scan as at caching: tests/test_data.py
  - LLM data lines that are not UTF-8, unknown roles, empty answers: tests/test_llm.py
  - the UI's caption editor writing only beside its image: tests/test_frontends.py
"""
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdxl_lora.cli import main


# ---- bad model folders: each refused before training, naming the file; pickles never loaded


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _variant(src: Path, dest: Path) -> Path:
    """A copy of the model folder `src` whose files are hard links (fast); _rewrite replaces one of them."""
    shutil.copytree(src, dest, copy_function=os.link)
    return dest


def _rewrite(path: Path, data: bytes | None = None, tensors: dict | None = None) -> None:
    path.unlink()  # a new file: writing through the hard link would damage the source model
    if tensors is not None:
        save_file(tensors, str(path), metadata={"format": "pt"})
    elif data is not None:
        path.write_bytes(data)


def _pickle_only(d: Path, component: str, stem: str, weights: str) -> Path:
    marker = d.parent / f"{d.name}-pickle-ran"
    _rewrite(d / component / weights)
    (d / component / f"{stem}.bin").write_bytes(pickle.dumps(_Boom(marker)))
    return marker


def _drop_keys(path: Path, n: int = 2) -> None:
    sd = load_file(str(path))
    _rewrite(path, tensors={k: v for k, v in sd.items() if k not in sorted(sd)[:n]})


def _widen(path: Path, suffix: str) -> None:
    sd = load_file(str(path))
    k = sorted(k for k in sd if k.endswith(suffix))[0]
    sd[k] = torch.zeros(sd[k].shape[0] * 2, *sd[k].shape[1:])
    _rewrite(path, tensors=sd)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    _rewrite(path, data=data[: len(data) // 2])


UNET = "unet/diffusion_pytorch_model.safetensors"
# (what is wrong, how to make it, the file the message names, whether `plan` sees it: plan reads configs
# and weight-file headers only, so a VAE's or text encoder's wrong tensors show at training).
SDXL_FAULTS = {
    "only pickle weights": (lambda d: _pickle_only(d, "unet", "diffusion_pytorch_model",
                                                   "diffusion_pytorch_model.safetensors"), "unet", True),
    "garbage model_index.json": (lambda d: _rewrite(d / "model_index.json", b"{garbage"), "model_index.json", True),
    "a UNet config that is not JSON": (lambda d: _rewrite(d / "unet/config.json", b"\xff\xfe"), "unet/config.json",
                                       True),
    "truncated UNet weights": (lambda d: _truncate(d / UNET), UNET, True),
    "UNet weights with tensors missing": (lambda d: _drop_keys(d / UNET), UNET, True),
    "UNet weights of another shape": (lambda d: _widen(d / UNET, "conv_in.weight"), UNET, True),
    "VAE weights with tensors missing": (lambda d: _drop_keys(d / "vae/diffusion_pytorch_model.safetensors"),
                                         "vae", False),
    "text encoder weights of another shape": (lambda d: _widen(d / "text_encoder/model.safetensors", "weight"),
                                              "text_encoder", False),
}


def _one_paragraph(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fault", list(SDXL_FAULTS))
def test_a_bad_sdxl_model_folder_is_refused_naming_the_file(fault, tiny_dir, tmp_path, capsys):
    make, named, plan_sees_it = SDXL_FAULTS[fault]
    d = _variant(tiny_dir, tmp_path / "model")
    marker = make(d)
    if plan_sees_it:
        assert main(["plan", "--model", str(d)]) == 2
        assert str(d / named) in _one_paragraph(capsys.readouterr().err)
    assert main(["train", "--model", str(d), "--out", str(tmp_path / "runs"), "--steps", "1",
                 "--set", "preview.prompts=''", "--set", f"data.cache_dir='{tmp_path / 'cache'}'"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert str(d / named) in msg
    assert ("safetensors" in msg) if "pickle" in fault else ("copy it again" in msg), msg
    if marker is not None:
        assert not marker.exists()  # the pickle was never loaded
    assert not list((tmp_path / "runs").glob("*/checkpoints"))


LLM_FAULTS = {
    "only pickle weights": lambda d: _pickle_only(d, ".", "pytorch_model", "model.safetensors"),
    "a config.json that is not JSON": lambda d: _rewrite(d / "config.json", b"{"),
    "truncated weights": lambda d: _truncate(d / "model.safetensors"),
    "weights with tensors missing": lambda d: _drop_keys(d / "model.safetensors"),
    "weights of another shape": lambda d: _widen(d / "model.safetensors", "q_proj.weight"),
}


@pytest.fixture(scope="module")
def tiny_llm_dir():
    from sdxl_lora.core.config import ModelConfig
    from sdxl_lora.llm.tiny import materialize_tiny_llm

    return materialize_tiny_llm(ModelConfig().cache_dir)


@pytest.mark.parametrize("fault", list(LLM_FAULTS))
def test_a_bad_llm_model_folder_is_refused_naming_it(fault, tiny_llm_dir, tmp_path, capsys):
    d = _variant(tiny_llm_dir, tmp_path / "model")
    marker = LLM_FAULTS[fault](d)
    assert main(["llm", "train", "--model", str(d), "--out", str(tmp_path / "runs"), "--steps", "1"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert str(d) in msg and ("safetensors" in msg if "pickle" in fault else "copy it again" in msg), msg
    if marker is not None:
        assert not marker.exists()
