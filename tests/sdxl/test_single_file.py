"""Single-file SDXL checkpoints: bundled configs, sgm naming, offline load/save round trip, tokenizers, errors."""
from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import socket
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sdxl_lora.sdxl.formats import single_file as sf
from sdxl_lora.sdxl.demo.tiny import bytes_to_unicode, materialize_tiny


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return materialize_tiny(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tiny_pipe(tiny_dir):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), local_files_only=True)


@pytest.fixture(scope="module")
def tiny_file(tiny_pipe, tmp_path_factory) -> Path:
    return sf.save_single_file(tiny_pipe, tmp_path_factory.mktemp("ckpt") / "tiny.safetensors")


@pytest.fixture(scope="module")
def sdxl_meta():
    """SDXL base's four networks on the meta device (shapes, no weights), from the bundled configs."""
    return sf.meta_models(sf.SDXL_BASE_CONFIG_DIR)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _image(pipe) -> np.ndarray:
    return pipe("a red circle on a blue background", num_inference_steps=2, height=64, width=64,
                generator=torch.Generator().manual_seed(7), output_type="np").images


# ---------------------------------------------------------------------------------------------
# bundled configs and the sgm naming on the real SDXL architecture


def test_bundled_configs_are_sdxl_base(sdxl_meta):
    unet, vae, te1, te2 = sdxl_meta
    # SDXL base's published parameter counts.
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    assert sum(p.numel() for p in vae.parameters()) == 83_653_863
    assert sum(p.numel() for p in te1.parameters()) == 123_060_480
    assert sum(p.numel() for p in te2.parameters()) == 694_659_840
    assert sf.unet_config()["cross_attention_dim"] == 2048
    assert vae.config.scaling_factor == 0.13025 and vae.config.force_upcast
    # Nothing heavy or fetchable ships: configs only.
    files = {p.relative_to(sf.SDXL_BASE_CONFIG_DIR).as_posix() for p in sf.SDXL_BASE_CONFIG_DIR.rglob("*") if p.is_file()}
    assert all(f.endswith(".json") for f in files), files
    assert json.loads((sf.SDXL_BASE_CONFIG_DIR / "tokenizer_2" / "special_tokens_map.json").read_text())["pad_token"] == "!"


def test_unet_mapping_gives_sdxl_sgm_blocks():
    m = sf.unet_diffusers_to_sgm(sf.unet_config())
    # issue 7: input_blocks 4,5 = level 1 attention, 7,8 = level 2; middle_block.1;
    # output_blocks 0-2 = level 2, 3-5 = level 1.
    expected = {
        "down_blocks.1.attentions.0": "input_blocks.4.1", "down_blocks.1.attentions.1": "input_blocks.5.1",
        "down_blocks.2.attentions.0": "input_blocks.7.1", "down_blocks.2.attentions.1": "input_blocks.8.1",
        "mid_block.attentions.0": "middle_block.1",
        "up_blocks.0.attentions.0": "output_blocks.0.1", "up_blocks.0.attentions.1": "output_blocks.1.1",
        "up_blocks.0.attentions.2": "output_blocks.2.1", "up_blocks.1.attentions.0": "output_blocks.3.1",
        "up_blocks.1.attentions.1": "output_blocks.4.1", "up_blocks.1.attentions.2": "output_blocks.5.1",
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.1.downsamplers.0.conv": "input_blocks.6.0.op",
        "up_blocks.0.upsamplers.0": "output_blocks.2.2", "up_blocks.1.upsamplers.0": "output_blocks.5.2",
        "add_embedding.linear_1": "label_emb.0.0", "time_embedding.linear_2": "time_embed.2",
        "down_blocks.1.resnets.0.conv_shortcut": "input_blocks.4.0.skip_connection",
    }
    assert {k: m[k] for k in expected} == expected
    attn = sorted(v for k, v in m.items() if re.fullmatch(r".*\.attentions\.\d+", k))
    assert attn == sorted(expected[k] for k in expected if ".attentions." in k)
    assert sf.map_module_path("up_blocks.2.resnets.1.conv1.weight", m) == "output_blocks.7.0.in_layers.2.weight"
    assert sf.map_module_path("down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k", m) == \
        "input_blocks.8.1.transformer_blocks.9.attn2.to_k"


def test_sgm_layout_on_real_sdxl_matches_diffusers_converters(sdxl_meta, monkeypatch):
    """Our writer's names, read back by diffusers' own (independent) single-file converters."""
    from diffusers.loaders import single_file_utils as su

    unet, vae, te1, te2 = sdxl_meta
    usd = unet.state_dict()
    # The same tensor objects every time, so identity shows where each one lands.
    monkeypatch.setattr(unet, "state_dict", lambda *a, **k: usd)
    m = sf.unet_diffusers_to_sgm(dict(unet.config))
    modules = dict(unet.named_modules())
    assert all(k in modules for k in m), [k for k in m if k not in modules]
    sgm = sf.sgm_state_dict(unet, vae, te1, te2)
    shape = {k: list(v.shape) for k, v in sgm.items()}
    assert len(sgm) == 2514  # the original file's 2515 keys minus OpenCLIP's unused logit_scale
    assert shape["model.diffusion_model.label_emb.0.0.weight"] == [1280, 2816]
    assert shape["model.diffusion_model.input_blocks.8.1.transformer_blocks.9.attn2.to_k.weight"] == [1280, 2048]
    assert shape["model.diffusion_model.output_blocks.2.2.conv.weight"] == [1280, 1280, 3, 3]
    assert shape["first_stage_model.encoder.mid.attn_1.q.weight"] == [512, 512, 1, 1]
    assert shape["first_stage_model.decoder.up.3.upsample.conv.weight"] == [512, 512, 3, 3]
    assert shape["conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight"] == [3840, 1280]
    assert shape["conditioner.embedders.1.model.positional_embedding"] == [77, 1280]
    assert "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight" in sgm

    back = su.convert_ldm_unet_checkpoint(sgm, dict(unet.config))
    assert set(back) == set(usd)
    assert all(back[k] is usd[k] for k in usd)
    vback = su.convert_ldm_vae_checkpoint(sgm, dict(vae.config))
    vsd = vae.state_dict()
    assert set(vback) == set(vsd) and all(vback[k].shape == vsd[k].shape for k in vsd)
    t2back = su.convert_open_clip_checkpoint(te2, sgm, prefix=sf.TE2_PREFIX)
    t2sd = te2.state_dict()
    assert set(t2back) == set(t2sd) and all(t2back[k].shape == t2sd[k].shape for k in t2sd)
    t1back = su.convert_ldm_clip_checkpoint(sgm)
    assert {k.removeprefix("text_model.") for k in t1back} - {"embeddings.position_ids"} == set(te1.state_dict())


# ---------------------------------------------------------------------------------------------
# round trip on the tiny SDXL


def test_round_trip_is_exact_and_offline(tiny_pipe, tiny_file, tiny_dir, no_network):
    with safe_open(str(tiny_file), framework="pt") as f:
        keys = list(f.keys())
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    for prefix in ("model.diffusion_model.input_blocks.4.1.", "model.diffusion_model.middle_block.1.",
                   "first_stage_model.decoder.up.0.block.", "conditioner.embedders.0.transformer.text_model.",
                   "conditioner.embedders.1.model.transformer.resblocks.2.attn.in_proj_weight"):
        assert any(k.startswith(prefix) for k in keys), prefix

    loaded = sf.load_single_file(tiny_file, tokenizer_dir=tiny_dir, config_dir=tiny_dir)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(tiny_pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert a.keys() == b.keys(), name
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert dict(loaded.scheduler.config) == dict(tiny_pipe.scheduler.config)
    assert loaded.tokenizer_2.pad_token == tiny_pipe.tokenizer_2.pad_token
    np.testing.assert_array_equal(_image(loaded), _image(tiny_pipe))


def test_save_never_overwrites_unless_asked(tiny_pipe, tiny_file):
    before = tiny_file.read_bytes()
    with pytest.raises(sf.SingleFileError, match="already exists"):
        sf.save_single_file(tiny_pipe, tiny_file)
    assert tiny_file.read_bytes() == before
    sf.save_single_file(tiny_pipe, tiny_file, overwrite=True)
    assert tiny_file.read_bytes() == before  # deterministic, and no temp file left beside it
    assert sorted(p.name for p in tiny_file.parent.iterdir()) == [tiny_file.name]
    # The usual mode for a new file (not a temp file's 0600), so other users' tools can read it.
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(tiny_file.stat().st_mode) == 0o666 & ~umask


# ---------------------------------------------------------------------------------------------
# errors a user meets


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was (not) executed."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(sf.SingleFileNotFoundError, match="nope.safetensors does not exist"):
        sf.load_single_file(missing)


@pytest.mark.parametrize("name", ["model.ckpt", "model.safetensors"])
def test_pickles_are_never_unpickled(tmp_path, name):
    marker = tmp_path / "pwned"
    path = tmp_path / name
    path.write_bytes(pickle.dumps(_Boom(marker)))
    with pytest.raises(sf.SingleFileError, match="pickle") as e:
        sf.load_single_file(path)
    assert name in str(e.value) and "safetensors" in str(e.value)
    assert not marker.exists()


def test_non_sdxl_files_are_refused(tmp_path, tiny_file):
    other = tmp_path / "classifier.safetensors"
    save_file({"fc.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(sf.SingleFileError, match="classifier.safetensors is not an SDXL checkpoint"):
        sf.load_single_file(other)
    sd15 = tmp_path / "sd15.safetensors"
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(1),
               "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.zeros(1)}, str(sd15))
    with pytest.raises(sf.SingleFileError, match="1.x/2.x"):
        sf.load_single_file(sd15)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not a checkpoint at all")
    with pytest.raises(sf.SingleFileError, match="garbage.safetensors is not a valid safetensors file"):
        sf.load_single_file(garbage)
    # A tiny checkpoint read with the default (real SDXL) configs: the mismatch is named up front.
    with pytest.raises(sf.SingleFileError, match="does not match the SDXL architecture") as e:
        sf.load_single_file(tiny_file)
    assert "shape" in str(e.value)


def test_unet_only_file_names_missing_parts(tmp_path, tiny_file):
    with safe_open(str(tiny_file), framework="pt") as f:
        unet_only = {k: f.get_tensor(k) for k in f.keys() if k.startswith(sf.UNET_PREFIX)}
    path = tmp_path / "unet_only.safetensors"
    save_file(unet_only, str(path))
    with pytest.raises(sf.SingleFileError, match="no vae, text_encoder, text_encoder_2 weights"):
        sf.load_single_file(path)


# ---------------------------------------------------------------------------------------------
# tokenizers


def _alphabet() -> list[str]:
    return list(bytes_to_unicode().values())


def _write_bpe(path: Path, merges: list[str]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('"bpe_simple_vocab_16e6.txt#version: 0.2\n' + "\n".join(merges) + "\n")
    return path


def test_bpe_conversion_builds_clip_vocab(tmp_path):
    meaningful = ["c a", "ca t</w>", "r e", "re d</w>"]
    # Filler merges of two single symbols, so the file is longer than CLIP keeps (48894 merges).
    filler = [f"{a} {b}" for a in _alphabet() for b in _alphabet() if a + b not in ("ca", "re")]
    bpe = _write_bpe(tmp_path / "bpe.txt.gz", meaningful + filler[:49000])
    tok, tok2 = sf.clip_tokenizers(None, bpe_path=bpe, cache_dir=tmp_path / "cache")

    vocab = json.loads((tmp_path / "cache").glob("clip-tokenizers-*/tokenizer/vocab.json").__next__().read_text())
    assert len(vocab) == sf.CLIP_VOCAB_SIZE == 49408
    assert vocab["!"] == 0 and vocab["!</w>"] == 256 and vocab["ca"] == 512 and vocab["cat</w>"] == 513
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    kept = 49152 - 256 - 2
    last_kept = "".join((meaningful + filler)[kept - 1].split())
    first_dropped = "".join((meaningful + filler)[kept].split())
    assert vocab[last_kept] == 49405 and first_dropped not in vocab

    assert len(tok) == 49408 and len(tok2) == 49408
    ids = tok("a red cat").input_ids
    assert ids == [49406, vocab["a</w>"], vocab["red</w>"], vocab["cat</w>"], 49407]
    # SDXL: the first tokenizer pads with <|endoftext|>, the second with "!".
    assert tok("cat", padding="max_length").input_ids[-1] == 49407
    assert tok2("cat", padding="max_length").input_ids[-1] == 0
    assert tok.model_max_length == 77 == tok2.model_max_length


def test_clip_vocab_found_in_open_clip_without_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "open_clip"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('open_clip must not be imported')\n")
    _write_bpe(pkg / sf.CLIP_BPE_NAME, ["c a", "ca t</w>"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert sf.find_clip_bpe() == pkg / sf.CLIP_BPE_NAME
    tok, tok2 = sf.clip_tokenizers(None, cache_dir=tmp_path / "cache")
    assert tok("cat").input_ids[1] == 513 and tok2.pad_token == "!"


def test_no_tokenizer_anywhere(monkeypatch, tiny_file, tiny_dir, tmp_path):
    monkeypatch.setattr(sf, "find_clip_bpe", lambda: None)
    with pytest.raises(sf.SingleFileError) as e:
        sf.clip_tokenizers(None)
    assert str(e.value) == (
        "a single-file checkpoint has no tokenizer: pass model.tokenizer=DIR (a folder with tokenizer/ and "
        "tokenizer_2/) or `pip install open-clip-torch --no-deps` to get CLIP's vocabulary")
    with pytest.raises(sf.SingleFileError, match="has no tokenizer"):
        sf.load_single_file(tiny_file, config_dir=tiny_dir)


def test_tokenizer_folder_errors_name_what_is_missing(tmp_path, tiny_dir):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.json").write_text("{}")
    with pytest.raises(sf.SingleFileError, match=r"missing merges\.txt"):
        sf.clip_tokenizers(tmp_path)
    (tmp_path / "tokenizer" / "vocab.json").unlink()
    (tmp_path / "tokenizer" / "tokenizer.json").write_bytes((tiny_dir / "tokenizer" / "tokenizer.json").read_bytes())
    with pytest.raises(sf.SingleFileNotFoundError, match=r"no tokenizer_2/ subfolder"):
        sf.clip_tokenizers(tmp_path)
    with pytest.raises(sf.SingleFileNotFoundError, match="does not exist"):
        sf.clip_tokenizers(tmp_path / "absent")
