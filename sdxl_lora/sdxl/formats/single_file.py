"""Single-file SDXL checkpoints (the original sgm / "ldm" layout), read and written fully offline.

A single `.safetensors` SDXL checkpoint (what ComfyUI, AUTOMATIC1111/Forge and most model sites use)
holds the four networks under the original Stability module names:

  model.diffusion_model.*                  the UNet (sgm `input_blocks` / `middle_block` / `output_blocks`)
  first_stage_model.*                      the VAE (ldm `encoder.down.N.block.M`, conv 1x1 attention)
  conditioner.embedders.0.transformer.*    CLIP ViT-L/14 text, in transformers' own layout
  conditioner.embedders.1.model.*          OpenCLIP bigG text (fused qkv, `text_projection` transposed)

It carries no configs and no tokenizer. The configs of SDXL base ship with this package
(`assets/sdxl-base`, the diffusers folder without weights); the two CLIP tokenizers come from a
folder the user names, or are built offline from the CLIP BPE vocabulary inside the `open-clip-torch`
package (which is not imported and not a dependency).

Loading goes through diffusers' own converters (`StableDiffusionXLPipeline.from_single_file`) with
a local config folder and `local_files_only=True`, so nothing is fetched. Writing uses the mapping
below, derived from each model's config (levels, layers per block, where attention is), never from
a table of SDXL indices, so it is the same code for the embedded tiny SDXL and the real one; the
kohya LoRA exporter and the merger reuse `unet_diffusers_to_sgm` / `sgm_state_dict`.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...core.fsutil import atomic_save
from ..demo.tiny import bytes_to_unicode

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI imports this module to parse arguments
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

SDXL_BASE_CONFIG_DIR: Path = Path(__file__).resolve().parents[2] / "assets" / "sdxl-base"

MODELSPEC_ARCHITECTURE = "stable-diffusion-xl-v1-base"
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TE1_PREFIX = "conditioner.embedders.0.transformer."
TE2_PREFIX = "conditioner.embedders.1.model."
TE1_POSITION_IDS = TE1_PREFIX + "text_model.embeddings.position_ids"
COMPONENT_PREFIXES = {
    "unet": UNET_PREFIX, "vae": VAE_PREFIX, "text_encoder": TE1_PREFIX, "text_encoder_2": TE2_PREFIX,
}

CLIP_BPE_NAME = "bpe_simple_vocab_16e6.txt.gz"
# CLIP keeps the first 49152 - 256 - 2 merges of its BPE file (the file's first line is a header).
CLIP_NUM_MERGES = 49152 - 256 - 2
CLIP_VOCAB_SIZE = 49408
NO_TOKENIZER_MESSAGE = (
    "a single-file checkpoint has no tokenizer: pass model.tokenizer=DIR (a folder with tokenizer/ and "
    "tokenizer_2/) or `pip install open-clip-torch --no-deps` to get CLIP's vocabulary"
)
PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}


class SingleFileError(ValueError):
    """A single-file checkpoint, its configs or its tokenizer are missing or wrong; the message says which."""


class SingleFileNotFoundError(SingleFileError, FileNotFoundError):
    """A file or folder that single-file loading needs does not exist."""


# --------------------------------------------------------------------------------------------
# Bundled SDXL base configs


def unet_config() -> dict:
    """SDXL base's UNet config (diffusers `UNet2DConditionModel` config), a fresh dict each call."""
    return json.loads((SDXL_BASE_CONFIG_DIR / "unet" / "config.json").read_text(encoding="utf-8"))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise SingleFileNotFoundError(f"config file {path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------
# Module-name mapping: diffusers <-> sgm (UNet) and diffusers <-> ldm (VAE)

# Inside a ResNet block the sgm names differ from diffusers'; everything inside an attention
# (SpatialTransformer) block has the same names in both.
_UNET_RESNET_RENAMES = (
    ("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
    ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"),
)


def _per_level(value: Any, n: int, name: str) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise SingleFileError(f"UNet config: {name} has {len(value)} entries for {n} levels")
    return value


def unet_diffusers_to_sgm(unet_config: dict) -> dict[str, str]:
    """Map diffusers UNet module paths to SDXL's original (sgm) module paths, from the UNet's config.

    Keys are module prefixes, e.g. "down_blocks.1.attentions.0" -> "input_blocks.4.1",
    "down_blocks.0.resnets.0.conv1" -> "input_blocks.1.0.in_layers.2". Translate any parameter or
    submodule name with `map_module_path` (longest prefix wins; the rest of the name is unchanged,
    which is right because sgm's SpatialTransformer uses diffusers' names inside). The layout is
    sgm's: input_blocks.0 is conv_in, then per level `layers_per_block` blocks (`.0` ResNet, `.1`
    attention where the level has cross-attention) and, except at the last level, one downsampler
    block (`.0.op`); middle_block.0/1/2 = ResNet, attention, ResNet; output_blocks run from the
    deepest level up with layers_per_block + 1 blocks each, the last of a level holding the
    upsampler (`.1.conv`, or `.2.conv` after an attention).
    """
    cfg = unet_config
    down_types = list(cfg["down_block_types"])
    up_types = list(cfg["up_block_types"])
    n = len(down_types)
    if len(up_types) != n:
        raise SingleFileError(f"UNet config: {n} down blocks but {len(up_types)} up blocks")
    for t in down_types:
        if t not in ("DownBlock2D", "CrossAttnDownBlock2D"):
            raise SingleFileError(f"UNet config: down block type {t!r} has no sgm equivalent "
                                  "(allowed: DownBlock2D, CrossAttnDownBlock2D)")
    for t in up_types:
        if t not in ("UpBlock2D", "CrossAttnUpBlock2D"):
            raise SingleFileError(f"UNet config: up block type {t!r} has no sgm equivalent "
                                  "(allowed: UpBlock2D, CrossAttnUpBlock2D)")
    mid_type = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid_type != "UNetMidBlock2DCrossAttn":
        raise SingleFileError(f"UNet config: mid block type {mid_type!r} has no sgm equivalent "
                              "(allowed: UNetMidBlock2DCrossAttn)")
    layers = _per_level(cfg.get("layers_per_block", 2), n, "layers_per_block")
    channels = list(cfg["block_out_channels"])

    m: dict[str, str] = {}

    def resnet(d: str, s: str, has_shortcut: bool) -> None:
        m[d] = s
        for a, b in _UNET_RESNET_RENAMES:
            if a != "conv_shortcut" or has_shortcut:
                m[f"{d}.{a}"] = f"{s}.{b}"

    if cfg.get("time_cond_proj_dim") is not None:
        raise SingleFileError("UNet config: time_cond_proj_dim (a guidance-distilled UNet) has no sgm equivalent")

    m["conv_in"] = "input_blocks.0.0"
    m["time_embedding"] = "time_embed"
    m["time_embedding.linear_1"] = "time_embed.0"
    m["time_embedding.linear_2"] = "time_embed.2"
    if cfg.get("addition_embed_type") == "text_time":
        emb = "add_embedding"
    elif cfg.get("addition_embed_type") is None and cfg.get("class_embed_type") in ("timestep", "projection"):
        emb = "class_embedding"
    elif cfg.get("addition_embed_type") is None and cfg.get("class_embed_type") is None:
        emb = None
    else:
        raise SingleFileError(
            f"UNet config: addition_embed_type={cfg.get('addition_embed_type')!r}, "
            f"class_embed_type={cfg.get('class_embed_type')!r} have no sgm equivalent "
            "(allowed: text_time, as in SDXL)")
    if emb:
        m[emb] = "label_emb.0"
        m[f"{emb}.linear_1"] = "label_emb.0.0"
        m[f"{emb}.linear_2"] = "label_emb.0.2"

    idx = 1
    for level, kind in enumerate(down_types):
        attn = kind.startswith("CrossAttn")
        for layer in range(layers[level]):
            in_ch = channels[max(level - 1, 0)] if layer == 0 else channels[level]
            resnet(f"down_blocks.{level}.resnets.{layer}", f"input_blocks.{idx}.0", in_ch != channels[level])
            if attn:
                m[f"down_blocks.{level}.attentions.{layer}"] = f"input_blocks.{idx}.1"
            idx += 1
        if level < n - 1:
            m[f"down_blocks.{level}.downsamplers.0"] = f"input_blocks.{idx}.0"
            m[f"down_blocks.{level}.downsamplers.0.conv"] = f"input_blocks.{idx}.0.op"
            idx += 1

    resnet("mid_block.resnets.0", "middle_block.0", False)
    m["mid_block.attentions.0"] = "middle_block.1"
    resnet("mid_block.resnets.1", "middle_block.2", False)

    idx = 0
    for up, kind in enumerate(up_types):
        level = n - 1 - up
        attn = kind.startswith("CrossAttn")
        count = layers[level] + 1
        for layer in range(count):
            # Every up ResNet takes the previous output concatenated with a skip: its input is
            # always wider than its output, so each has a 1x1 shortcut.
            resnet(f"up_blocks.{up}.resnets.{layer}", f"output_blocks.{idx}.0", True)
            if attn:
                m[f"up_blocks.{up}.attentions.{layer}"] = f"output_blocks.{idx}.1"
            if layer == count - 1 and up < n - 1:
                m[f"up_blocks.{up}.upsamplers.0"] = f"output_blocks.{idx}.{2 if attn else 1}"
            idx += 1

    m["conv_norm_out"] = "out.0"
    m["conv_out"] = "out.2"
    return m


_VAE_ATTN_RENAMES = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))


def vae_diffusers_to_ldm(vae_config: dict) -> dict[str, str]:
    """Map diffusers AutoencoderKL module paths to the original ldm VAE's, from the VAE's config."""
    cfg = vae_config
    n = len(cfg["down_block_types"])
    if len(cfg["up_block_types"]) != n:
        raise SingleFileError("VAE config: down and up block counts differ")
    layers = int(cfg.get("layers_per_block", 1))
    channels = list(cfg["block_out_channels"])
    m: dict[str, str] = {}

    def resnet(d: str, s: str, has_shortcut: bool) -> None:
        m[d] = s
        if has_shortcut:
            m[f"{d}.conv_shortcut"] = f"{s}.nin_shortcut"

    def mid(side: str) -> None:
        resnet(f"{side}.mid_block.resnets.0", f"{side}.mid.block_1", False)
        resnet(f"{side}.mid_block.resnets.1", f"{side}.mid.block_2", False)
        m[f"{side}.mid_block.attentions.0"] = f"{side}.mid.attn_1"
        for a, b in _VAE_ATTN_RENAMES:
            m[f"{side}.mid_block.attentions.0.{a}"] = f"{side}.mid.attn_1.{b}"

    for side in ("encoder", "decoder"):
        m[f"{side}.conv_in"] = f"{side}.conv_in"
        m[f"{side}.conv_norm_out"] = f"{side}.norm_out"
        m[f"{side}.conv_out"] = f"{side}.conv_out"
        mid(side)
    for i in range(n):
        for j in range(layers):
            in_ch = channels[max(i - 1, 0)] if j == 0 else channels[i]
            resnet(f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}", in_ch != channels[i])
        if i < n - 1:
            m[f"encoder.down_blocks.{i}.downsamplers.0"] = f"encoder.down.{i}.downsample"
    rev = channels[::-1]
    for i in range(n):
        # diffusers counts decoder blocks from the bottom (up_blocks.0 is the deepest), ldm from the top.
        for j in range(layers + 1):
            in_ch = rev[max(i - 1, 0)] if j == 0 else rev[i]
            resnet(f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{n - 1 - i}.block.{j}", in_ch != rev[i])
        if i < n - 1:
            m[f"decoder.up_blocks.{i}.upsamplers.0"] = f"decoder.up.{n - 1 - i}.upsample"
    m["quant_conv"] = "quant_conv"
    m["post_quant_conv"] = "post_quant_conv"
    return m


def map_module_path(path: str, mapping: dict[str, str]) -> str:
    """Translate a module or parameter path with a prefix mapping (longest matching prefix wins)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in mapping:
            return ".".join([mapping[head], *parts[i:]])
    raise KeyError(f"{path!r} is not covered by the module mapping")


# --------------------------------------------------------------------------------------------
# diffusers/transformers state dicts -> one sgm state dict


def _no_adapters(name: str, sd: dict) -> None:
    bad = [k for k in sd if ".base_layer." in k or ".lora_" in k or "lora_magnitude" in k]
    if bad:
        raise SingleFileError(
            f"the {name} still has unmerged adapter layers (e.g. {bad[0]}): merge them into the base "
            "weights first (fuse_lora / merge_and_unload), then write the checkpoint")


def _unet_sgm(unet) -> dict[str, torch.Tensor]:
    sd = unet.state_dict()
    _no_adapters("UNet", sd)
    mapping = unet_diffusers_to_sgm(dict(unet.config))
    out, unmapped = {}, []
    for k, v in sd.items():
        try:
            out[UNET_PREFIX + map_module_path(k, mapping)] = v
        except KeyError:
            unmapped.append(k)
    if unmapped:
        raise SingleFileError(f"UNet has {len(unmapped)} weights with no sgm name, e.g. {unmapped[:3]}")
    return out


def _vae_ldm(vae) -> dict[str, torch.Tensor]:
    sd = vae.state_dict()
    mapping = vae_diffusers_to_ldm(dict(vae.config))
    out, unmapped = {}, []
    for k, v in sd.items():
        try:
            name = map_module_path(k, mapping)
        except KeyError:
            unmapped.append(k)
            continue
        if ".mid.attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # ldm's VAE attention uses 1x1 convolutions
        out[VAE_PREFIX + name] = v
    if unmapped:
        raise SingleFileError(f"VAE has {len(unmapped)} weights with no ldm name, e.g. {unmapped[:3]}")
    return out


def _te1_sgm(te) -> dict[str, torch.Tensor]:
    # CLIP-L keeps transformers' layout under `transformer.text_model.` (transformers >= 5.6 flattened
    # CLIPTextModel, so its own keys may lack `text_model.`).
    sd = te.state_dict()
    _no_adapters("first text encoder", sd)
    out = {}
    for k, v in sd.items():
        if k.endswith("position_ids"):
            continue
        out[TE1_PREFIX + (k if k.startswith("text_model.") else "text_model." + k)] = v
    # Original checkpoints carry this buffer (older transformers saved it); loaders that load
    # strictly with those versions expect it, newer ones ignore it.
    n_pos = int(te.config.max_position_embeddings)
    out[TE1_POSITION_IDS] = torch.arange(n_pos, dtype=torch.int64, device=_device_of(sd))[None]
    return out


def _device_of(sd: dict) -> torch.device:
    return next(iter(sd.values())).device if sd else torch.device("cpu")


_TE2_RENAMES = (("self_attn.out_proj.", "attn.out_proj."), ("layer_norm1.", "ln_1."), ("layer_norm2.", "ln_2."),
                ("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj."))


def _te2_openclip(te) -> dict[str, torch.Tensor]:
    """CLIPTextModelWithProjection -> OpenCLIP text tower names (fused qkv, transposed projection)."""
    sd = {k.removeprefix("text_model."): v for k, v in te.state_dict().items() if not k.endswith("position_ids")}
    _no_adapters("second text encoder", sd)
    n_layers = int(te.config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        used.add(k)
        return sd[k]

    out["token_embedding.weight"] = take("embeddings.token_embedding.weight")
    out["positional_embedding"] = take("embeddings.position_embedding.weight")
    for i in range(n_layers):
        src, dst = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{kind}"] = torch.cat(
                [take(f"{src}self_attn.{p}_proj.{kind}") for p in ("q", "k", "v")], dim=0)
            for a, b in _TE2_RENAMES:
                out[f"{dst}{b}{kind}"] = take(f"{src}{a}{kind}")
    out["ln_final.weight"] = take("final_layer_norm.weight")
    out["ln_final.bias"] = take("final_layer_norm.bias")
    # OpenCLIP applies `x @ text_projection`; transformers a Linear (x @ W.T): store W.T.
    out["text_projection"] = take("text_projection.weight").T
    left = sorted(set(sd) - used)
    if left:
        raise SingleFileError(f"second text encoder has weights with no OpenCLIP name, e.g. {left[:3]}")
    return {TE2_PREFIX + k: v for k, v in out.items()}


def sgm_source(component: str, param: str, unet_mapping: dict[str, str]) -> tuple[str, int | None]:
    """Where the diffusers/transformers parameter `param` of `component` ("unet", "text_encoder",
    "text_encoder_2") is stored in a single-file checkpoint: its key there, and for the second text encoder's
    q/k/v projections which third of the fused `in_proj` rows (0, 1, 2; None: the whole tensor). The inverse
    of `sgm_state_dict` for the UNet's and the text encoders' layers (`unet_mapping`: unet_diffusers_to_sgm)."""
    if component == "unet":
        return UNET_PREFIX + map_module_path(param, unet_mapping), None
    if component == "text_encoder":
        return TE1_PREFIX + (param if param.startswith("text_model.") else "text_model." + param), None
    if component != "text_encoder_2":
        raise KeyError(f"{component!r} has no single-file source mapping (unet, text_encoder, text_encoder_2)")
    name = param.removeprefix("text_model.")
    if not name.startswith("encoder.layers."):
        raise KeyError(f"text_encoder_2.{param}: only the encoder layers' parameters are mapped")
    i, rest = name.removeprefix("encoder.layers.").split(".", 1)
    dst = f"{TE2_PREFIX}transformer.resblocks.{i}."
    for j, p in enumerate(("q", "k", "v")):
        if rest.startswith(f"self_attn.{p}_proj."):
            return f"{dst}attn.in_proj_{rest.rsplit('.', 1)[1]}", j
    for a, b in _TE2_RENAMES:
        if rest.startswith(a):
            return dst + b + rest.removeprefix(a), None
    raise KeyError(f"text_encoder_2.{param} has no OpenCLIP name")


def sgm_state_dict(unet, vae, text_encoder, text_encoder_2) -> dict[str, torch.Tensor]:
    """The four SDXL networks as one original-layout (sgm) state dict (tensors may be views)."""
    out: dict[str, torch.Tensor] = {}
    for part in (_unet_sgm(unet), _vae_ldm(vae), _te1_sgm(text_encoder), _te2_openclip(text_encoder_2)):
        out.update(part)
    return out


def save_single_file(pipe, path: Path, *, overwrite: bool = False, dtype: torch.dtype | None = None,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write an SDXL pipeline (UNet, VAE, both text encoders) as one original-layout `.safetensors`.

    The file loads in ComfyUI, AUTOMATIC1111/Forge and diffusers' `from_single_file`. It is written
    atomically and never replaces an existing file unless `overwrite=True`. `dtype` casts floating
    weights (e.g. torch.float16 for the usual 6.9 GB file); `metadata` adds string entries.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        raise SingleFileError(f"{path}: a single-file checkpoint is written as .safetensors")
    if path.exists() and not overwrite:
        raise SingleFileError(f"{path} already exists; pass overwrite=True to replace it")
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if getattr(pipe, name, None) is None:
            raise SingleFileError(f"the pipeline has no {name}; an SDXL base checkpoint needs all four networks")
    sd = sgm_state_dict(pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)
    tensors = {}
    for k, v in sd.items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous().cpu()
    meta = {"modelspec.architecture": MODELSPEC_ARCHITECTURE}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})

    return atomic_save(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


# --------------------------------------------------------------------------------------------
# Tokenizers


def find_clip_bpe() -> Path | None:
    """CLIP's BPE file inside the installed open-clip-torch package, found without importing it."""
    try:
        spec = importlib.util.find_spec("open_clip")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / CLIP_BPE_NAME
        if candidate.is_file():
            return candidate
    try:
        dist = importlib.metadata.distribution("open_clip_torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name == CLIP_BPE_NAME:
            candidate = Path(str(dist.locate_file(f)))
            if candidate.is_file():
                return candidate
    return None


def clip_vocab_from_bpe(bpe_path: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary and merges from its gzipped BPE file, exactly as CLIP's SimpleTokenizer builds them."""
    try:
        lines = gzip.open(bpe_path, "rt", encoding="utf-8").read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SingleFileError(f"{bpe_path} is not a gzipped CLIP BPE file: {e}") from None
    merges: list[tuple[str, str]] = []
    for line in lines[1:CLIP_NUM_MERGES + 1]:  # line 0 is a header
        parts = tuple(line.split())
        if not parts:
            continue
        if len(parts) != 2:
            raise SingleFileError(f"{bpe_path}: bad merge line {line!r} (expected two symbols)")
        merges.append(parts)  # type: ignore[arg-type]
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [a + "</w>" for a in alphabet] + ["".join(mg) for mg in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    # Same rule as CLIP's dict(zip(vocab, range(len(vocab)))): a repeated token keeps its last index.
    vocab = {t: i for i, t in enumerate(tokens)}
    return vocab, merges


def build_clip_tokenizer_files(bpe_path: Path, cache_dir: Path | None = None) -> Path:
    """Write SDXL's two tokenizer folders (tokenizer/, tokenizer_2/) built from CLIP's BPE file.

    The result is cached under `cache_dir` by the BPE file's hash and written atomically; the
    returned folder is a valid `tokenizer_dir` for `clip_tokenizers`.
    """
    bpe_path = Path(bpe_path)
    if not bpe_path.is_file():
        raise SingleFileNotFoundError(f"CLIP BPE vocabulary {bpe_path} does not exist")
    digest = hashlib.sha256(bpe_path.read_bytes()).hexdigest()[:16]
    cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    dest = cache_dir / f"clip-tokenizers-{digest}"
    if (dest / "tokenizer_2" / "merges.txt").is_file():
        return dest
    vocab, merges = clip_vocab_from_bpe(bpe_path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=cache_dir))
    try:
        for sub in ("tokenizer", "tokenizer_2"):
            d = tmp / sub
            d.mkdir()
            (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
            (d / "merges.txt").write_text(
                "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
            for f in ("tokenizer_config.json", "special_tokens_map.json"):
                shutil.copyfile(SDXL_BASE_CONFIG_DIR / sub / f, d / f)
        try:
            os.replace(tmp, dest)
        except OSError:
            # Another process built it first; same input, same files.
            if not (dest / "tokenizer_2" / "merges.txt").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sdxl_lora"


def _check_tokenizer_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise SingleFileNotFoundError(
            f"tokenizer folder {folder.parent} has no {folder.name}/ subfolder; it needs tokenizer/ and "
            "tokenizer_2/ (as in a diffusers SDXL folder)")
    if (folder / "tokenizer.json").is_file():
        return
    missing = [f for f in ("vocab.json", "merges.txt") if not (folder / f).is_file()]
    if missing:
        raise SingleFileNotFoundError(
            f"tokenizer folder {folder} has no tokenizer.json and is missing {' and '.join(missing)}")


def clip_tokenizers(tokenizer_dir: Path | None, *, bpe_path: Path | None = None,
                    cache_dir: Path | None = None) -> tuple[CLIPTokenizer, CLIPTokenizer]:
    """SDXL's two CLIP tokenizers, offline.

    From `tokenizer_dir/tokenizer` and `tokenizer_dir/tokenizer_2` when given; otherwise built from
    CLIP's BPE vocabulary (`bpe_path`, or the copy inside an installed open-clip-torch package),
    cached under `cache_dir`. The second pads with "!" as SDXL's does.
    """
    from transformers import CLIPTokenizer

    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        if not tokenizer_dir.is_dir():
            raise SingleFileNotFoundError(f"tokenizer folder {tokenizer_dir} does not exist")
    else:
        bpe = Path(bpe_path) if bpe_path is not None else find_clip_bpe()
        if bpe is None:
            raise SingleFileError(NO_TOKENIZER_MESSAGE)
        tokenizer_dir = build_clip_tokenizer_files(bpe, cache_dir)
    subs = (tokenizer_dir / "tokenizer", tokenizer_dir / "tokenizer_2")
    for sub in subs:
        _check_tokenizer_folder(sub)
    tok, tok2 = (CLIPTokenizer.from_pretrained(str(sub), local_files_only=True) for sub in subs)
    return tok, tok2


# --------------------------------------------------------------------------------------------
# Loading


def meta_models(config_dir: Path):
    """The UNet, VAE and both text encoders `config_dir`'s configs describe, on the meta device (no weights)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    te1_cfg = CLIPTextConfig.from_pretrained(str(config_dir / "text_encoder"), local_files_only=True)
    te2_cfg = CLIPTextConfig.from_pretrained(str(config_dir / "text_encoder_2"), local_files_only=True)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(_read_json(config_dir / "unet" / "config.json"))
        vae = AutoencoderKL.from_config(_read_json(config_dir / "vae" / "config.json"))
        te1 = CLIPTextModel(te1_cfg)
        te2 = CLIPTextModelWithProjection(te2_cfg)
    return unet, vae, te1, te2


def expected_sgm_shapes(config_dir: Path | None = None) -> dict[str, tuple[int, ...]]:
    """Every key of a single-file checkpoint for the configs in `config_dir`, with its shape (no weights)."""
    config_dir = Path(config_dir) if config_dir is not None else SDXL_BASE_CONFIG_DIR
    sd = sgm_state_dict(*meta_models(config_dir))
    return {k: tuple(v.shape) for k, v in sd.items()}


def _looks_like_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def _read_header(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types, or OSError
        hint = " (it looks like a PyTorch pickle: convert it to safetensors)" if _looks_like_pickle(path) else ""
        raise SingleFileError(f"{path} is not a valid safetensors file{hint}: {e}") from None


def _check_sdxl(path: Path, shapes: dict[str, tuple[int, ...]], config_dir: Path) -> None:
    keys = shapes.keys()
    if not keys:
        raise SingleFileError(f"{path} holds no tensors")
    if any(k.startswith("cond_stage_model.") for k in keys):
        raise SingleFileError(f"{path} is a Stable Diffusion 1.x/2.x checkpoint (cond_stage_model.*), not SDXL")
    if any(k.startswith("lora_") or ".lora_down." in k or ".lora_A." in k for k in keys):
        raise SingleFileError(f"{path} is a LoRA adapter, not a full SDXL checkpoint")
    if any(k.startswith("conditioner.embedders.0.model.") for k in keys):
        raise SingleFileError(f"{path} is an SDXL refiner checkpoint (one OpenCLIP text encoder); "
                              "only SDXL base-architecture checkpoints are supported")
    missing_parts = [name for name, prefix in COMPONENT_PREFIXES.items()
                     if not any(k.startswith(prefix) for k in keys)]
    if len(missing_parts) == len(COMPONENT_PREFIXES):
        raise SingleFileError(
            f"{path} is not an SDXL checkpoint: none of its {len(shapes)} keys (e.g. {next(iter(keys))!r}) "
            f"starts with {', '.join(COMPONENT_PREFIXES.values())}")
    if missing_parts:
        raise SingleFileError(
            f"{path} is not a complete SDXL checkpoint: it has no {', '.join(missing_parts)} weights "
            f"(no keys starting with {', '.join(COMPONENT_PREFIXES[p] for p in missing_parts)})")
    expected = expected_sgm_shapes(config_dir)
    expected.pop(TE1_POSITION_IDS)  # a buffer, not a weight: files may lack it
    # Shapes first: a different model size is the likelier mistake and the clearer message.
    for k, want in expected.items():
        got = shapes.get(k)
        # VAE attention: ldm stores 1x1 convolutions, some converted files plain matrices.
        if got is None or got == want or (k.startswith(VAE_PREFIX) and got == want[:2] and want[2:] == (1, 1)):
            continue
        raise SingleFileError(
            f"{path} does not match the SDXL architecture of {config_dir}: {k} has shape {list(got)}, "
            f"the config expects {list(want)} (a different model size? give the config folder that describes it)")
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise SingleFileError(
            f"{path} does not match the SDXL architecture of {config_dir}: {len(missing)} weights are missing, "
            f"e.g. {missing[:3]} (a different model size? give the config folder that describes it)")


def check_single_file(path: Path, config_dir: Path) -> None:
    """What loading a single-file checkpoint checks before it reads a weight: a safetensors file named
    .safetensors (pickles refused), a config folder with every config, and SDXL's keys and shapes under them."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise SingleFileError(
            f"{path} is a pickled checkpoint ({path.suffix}); pickles run code when loaded, so they are "
            "refused: convert it to .safetensors first")
    if not path.exists():
        raise SingleFileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise SingleFileError(f"checkpoint {path} is not a file (a diffusers folder is loaded as a folder)")
    shapes = _read_header(path)
    if path.suffix != ".safetensors":
        # diffusers picks the reader by extension and would hand anything else to torch.load.
        raise SingleFileError(f"{path} is a safetensors file but named {path.suffix!r}; rename it to .safetensors")
    if not (config_dir / "model_index.json").is_file():
        raise SingleFileNotFoundError(f"config folder {config_dir} has no model_index.json (a diffusers SDXL folder "
                                      "without weights is enough)")
    for sub, f in (("unet", "config.json"), ("vae", "config.json"), ("text_encoder", "config.json"),
                   ("text_encoder_2", "config.json"), ("scheduler", "scheduler_config.json")):
        if not (config_dir / sub / f).is_file():
            raise SingleFileNotFoundError(f"config folder {config_dir} is missing {sub}/{f}")
    _check_sdxl(path, shapes, config_dir)


def load_single_file(path: Path, tokenizer_dir: Path | None = None, config_dir: Path | None = None,
                     torch_dtype=None, *, tokenizer_cache_dir: Path | None = None) -> StableDiffusionXLPipeline:
    """Load a single-file SDXL `.safetensors` checkpoint as a diffusers pipeline, offline.

    `config_dir` is a diffusers SDXL folder whose configs describe the checkpoint (default: SDXL
    base's, bundled); `tokenizer_dir` holds tokenizer/ and tokenizer_2/ (default: built from CLIP's
    BPE vocabulary, see `clip_tokenizers`). Pickled checkpoints (.ckpt/.pt) are refused: unpickling
    runs code; convert them to safetensors with a tool you trust.
    """
    from diffusers import StableDiffusionXLPipeline
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from safetensors import safe_open
    from transformers import CLIPTextModelWithProjection

    path = Path(path)
    config_dir = Path(config_dir) if config_dir is not None else SDXL_BASE_CONFIG_DIR
    check_single_file(path, config_dir)
    tok, tok2 = clip_tokenizers(tokenizer_dir, cache_dir=tokenizer_cache_dir)

    # diffusers picks the converter for text_encoder_2 by comparing hidden sizes with the CLIP-L
    # key; when both encoders are equally wide (small models) it would load CLIP-L's weights into it.
    # So the second encoder is converted by diffusers' own OpenCLIP converter from its keys alone.
    with safe_open(str(path), framework="pt") as f:
        te2_sd = {k: f.get_tensor(k) for k in f.keys() if k.startswith(TE2_PREFIX)}
    te2 = create_diffusers_clip_model_from_ldm(
        CLIPTextModelWithProjection, te2_sd, subfolder="text_encoder_2", config=str(config_dir),
        torch_dtype=torch_dtype, local_files_only=True)
    del te2_sd
    # `config` must be a str: the per-model loaders reject a Path. A local folder plus
    # local_files_only and no original_config keeps every step off the Hub.
    return StableDiffusionXLPipeline.from_single_file(
        str(path), config=str(config_dir), local_files_only=True, torch_dtype=torch_dtype,
        tokenizer=tok, tokenizer_2=tok2, text_encoder_2=te2)
