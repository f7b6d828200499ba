"""The embedded tiny SDXL: every component built in-process from configs, deterministic from a seed.

It has SDXL's topology at small widths, so every code path (injector slots, sgm export names,
time_ids, pooled text embeddings, two text encoders) is exercised on a CPU in seconds:
  - UNet: 3 levels, 2 layers per block, cross-attention at levels 1 and 2, a mid block,
    `text_time` added conditioning fed by the second encoder's pooled projection + 6 time ids;
  - two CLIP text encoders (the second with projection), each with its own tokenizer;
  - a 4-level VAE (8x downsampling, 4 latent channels) and SDXL's Euler scheduler config.
Materialised once as a standard diffusers folder, so any diffusers tool can load it.

Two names: "tiny-sdxl" is this build with random weights (what tests use when only the topology
matters); "tiny-sdxl-demo" is the same model pretrained on synthetic shapes (docs/demo_base.md), shipped
with the package as a diffusers folder and read in place (never written), the default model.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ...core.fsutil import build_folder_once
from ..config import TINY_NAME

# Bump when the architecture or the build changes, so old materialised copies are not reused.
TINY_VERSION = 1

# SDXL's own scheduler settings (scaled-linear betas 0.00085..0.012, 1000 steps, epsilon, leading).
SCHEDULER_CONFIG = {
    "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000, "prediction_type": "epsilon", "steps_offset": 1,
    "timestep_spacing": "leading", "interpolation_type": "linear", "use_karras_sigmas": False,
    "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "clip_sample": False,
}

# Words the tiny tokenizer learns merges from: enough that captions of shapes, colours and common
# prompt words become a few tokens each; anything else still tokenizes (byte-level fallback).
_CORPUS = (
    "a an the of on in with and or to photo picture drawing painting image style art "
    "red green blue yellow purple orange white black grey gray pink brown cyan magenta "
    "circle square triangle star ring stripe stripes dot dots shape shapes background "
    "small large big tiny bright dark light cat dog person man woman face portrait landscape "
    "high quality detailed blurry sks ohwx token trigger"
)


def bytes_to_unicode() -> dict[int, str]:
    # CLIP's byte-level alphabet: printable bytes map to themselves, the rest to unused code points.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer_files(folder: Path, n_merges: int = 300) -> None:
    """Write a small CLIP BPE tokenizer (vocab.json, merges.txt, configs) learned from _CORPUS."""
    alphabet = list(bytes_to_unicode().values())
    vocab_tokens = alphabet + [a + "</w>" for a in alphabet]
    words = Counter(_CORPUS.split())
    splits = {w: [*w[:-1], w[-1] + "</w>"] for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, syms in splits.items():
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        # Most frequent pair; ties broken by the pair itself, so the result is deterministic.
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        vocab_tokens.append(best[0] + best[1])
        for w, syms in splits.items():
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            splits[w] = out
    vocab_tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(vocab_tokens))}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
               "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**special, "model_max_length": 77, "tokenizer_class": "CLIPTokenizer",
         "do_lower_case": True, "clean_up_tokenization_spaces": False}), encoding="utf-8")


def build_tiny_pipeline(tokenizer_dir: Path, seed: int = 0, top_attention: bool = False):
    """Build the tiny SDXL pipeline in memory (random weights, deterministic from `seed`). top_attention
    puts cross-attention at the top level (16 x 16 latents) too, where SDXL has none: the demo base's
    option for detail that the text decides at that level (docs/demo_base.md)."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
    tok2 = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
    common = dict(vocab_size=len(tok), max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # Encoder 1 mirrors CLIP ViT-L's text tower (quick_gelu); encoder 2 OpenCLIP bigG's (gelu + projection).
    te1_cfg = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                             hidden_act="quick_gelu", projection_dim=32, **common)
    te2_cfg = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                             hidden_act="gelu", projection_dim=32, **common)
    torch.manual_seed(seed)
    te1 = CLIPTextModel(te1_cfg)
    torch.manual_seed(seed + 1)
    te2 = CLIPTextModelWithProjection(te2_cfg)

    time_embed_dim = 8
    torch.manual_seed(seed + 2)
    unet = UNet2DConditionModel(
        sample_size=16,  # 16 latents * 8 = 128 px native resolution
        in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D" if top_attention else "DownBlock2D", "CrossAttnDownBlock2D",
                          "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                        "CrossAttnUpBlock2D" if top_attention else "UpBlock2D"),
        block_out_channels=(32, 64, 128),
        layers_per_block=2,
        # SDXL: [1, 2, 10] transformer layers by level (level 0 has none); here deeper at the bottom too.
        transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 8),  # diffusers' name for the number of heads, as in SDXL's config
        cross_attention_dim=te1_cfg.hidden_size + te2_cfg.hidden_size,
        norm_num_groups=32,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=te2_cfg.projection_dim + 6 * time_embed_dim,
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 64, 64), layers_per_block=1, norm_num_groups=32,
        sample_size=128, scaling_factor=0.13025, force_upcast=False,
    )
    scheduler = EulerDiscreteScheduler.from_config(SCHEDULER_CONFIG)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok2,
        unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True)


def materialize_tiny(cache_dir: str | Path, seed: int = 0) -> Path:
    """Return the tiny SDXL diffusers folder, building it once (atomically: temp folder, then rename)."""
    def build(scratch: Path, out: Path) -> None:
        # The build reseeds torch's RNG: forked, so a run that builds the model trains the same adapter
        # as one that finds it built.
        with torch.random.fork_rng(devices=[]):
            build_tokenizer_files(scratch / "tok")
            build_tiny_pipeline(scratch / "tok", seed=seed).save_pretrained(out, safe_serialization=True)

    return build_folder_once(Path(cache_dir) / f"{TINY_NAME}-v{TINY_VERSION}-seed{seed}", build, "model_index.json")
