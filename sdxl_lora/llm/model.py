"""Load a causal LM and its tokenizer from what the user named: the embedded tiny Llama or a local
transformers folder. Always offline (local_files_only), safetensors only; errors say what is missing.
With model.quantize the frozen base is quantized (core/quantize.py, bitsandbytes) after loading."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..core.config import Config
from .config import TINY_LLM, LLMConfig, ModelConfig
from ..core.weights import PickleWeights, WeightFileError, read_json, weight_files
from .tiny import materialize_tiny_llm

log = logging.getLogger(__name__)

DTYPES = {"no": torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LLMModelError(ValueError):
    """The model folder is not usable; the message says why and what to give instead."""


def resolve_llm_path(cfg: ModelConfig) -> Path:
    if cfg.path == TINY_LLM:
        return materialize_tiny_llm(cfg.cache_dir)
    return Path(cfg.path).expanduser()


def check_causal_lm_folder(path: Path, weights: bool = True):
    """The folder's transformers config, if it is a causal LM folder with safetensors weights (weights=False:
    the config alone, as a plan needs it before the weights are downloaded)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not path.exists():
        raise LLMModelError(f"model.path={str(path)!r} does not exist; give a local transformers causal-LM "
                            f"folder (config.json, *.safetensors, tokenizer files) or '{TINY_LLM}'")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise LLMModelError(f"{path} is not a transformers model folder (no config.json); give the folder that "
                            "holds config.json, the *.safetensors weights and the tokenizer files")
    try:
        read_json(path / "config.json")
    except WeightFileError as e:
        raise LLMModelError(f"{e}; copy it again, whole, or give another causal-LM folder") from None
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # a config.json transformers cannot read as a model's
        raise LLMModelError(f"{path / 'config.json'} is not a transformers model config ({e}); give the folder "
                            "of a transformers causal LM") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise LLMModelError(f"{path} holds a {config.model_type!r} model ({', '.join(config.architectures or [])}), "
                            "not a causal LM; the llm task trains decoder-only text generators (Llama, Mistral, "
                            "Qwen, Gemma, Phi...)")
    if not weights:
        return config
    try:
        weight_files(path, "model")  # safetensors only, each file whole
    except PickleWeights as e:  # its message says what to do
        raise LLMModelError(str(e)) from None
    except WeightFileError as e:
        raise LLMModelError(f"{e}. {path} is not a usable model folder: copy it again, whole, from where it came "
                            f"from, or give another model folder (or '{TINY_LLM}')") from None
    return config


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise LLMModelError(f"{path}: no usable tokenizer files ({e})") from e
    if tok.pad_token_id is None:
        # Padding never carries loss or attention here, so any id will do; EOS is the usual choice.
        tok.pad_token = tok.eos_token
    return tok


def quantize_settings(cfg: Config, mixed_precision: str | None = None) -> tuple[str | None, dict]:
    """model.quantize and the keyword arguments core.quantize.quantize_model takes for it
    (None: no quantization)."""
    method = getattr(cfg.model, "quantize", "none")
    if method in (None, "none"):
        return None, {}
    from ..core.quantize import resolve_compute_dtype

    return method, {"double_quant": cfg.model.quant_double,
                    "compute_dtype": resolve_compute_dtype(cfg.model.quant_compute_dtype, mixed_precision)}


def keep_head(name: str) -> bool:
    # The output head stays in full precision: small next to the body, and its error reaches every logit.
    return name.rsplit(".", 1)[-1] == "lm_head"


def weight_dtype(cfg: Config, mixed_precision: str) -> torch.dtype:
    """The dtype the frozen base is loaded in: the quantized layers' compute dtype, or the training precision's."""
    method, opts = quantize_settings(cfg, mixed_precision)
    return opts["compute_dtype"] if method else DTYPES.get(mixed_precision, torch.float32)


def attention_for(cfg: LLMConfig, config) -> str:
    """llm.attn_implementation for this model: 'sdpa' becomes 'eager' for a model whose transformers class
    has no SDPA path (Gemma 2: its attention logits are soft-capped); packed examples stay apart on both."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if cfg.attn_implementation != "sdpa" or getattr(cls, "_supports_sdpa", True):
        return cfg.attn_implementation
    log.warning("llm.attn_implementation='sdpa': %s has no SDPA attention in transformers; it runs with 'eager' "
                "(or set 'flash_attention_2' on a GPU with flash-attn installed)", cls.__name__)
    return "eager"


def load_llm(cfg: Config, device: torch.device, mixed_precision: str):
    """(model, tokenizer, folder): the causal LM on `device` in the training precision's dtype, its frozen
    base quantized (model.quantize) one layer at a time if asked."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_llm_path(cfg.model)
    attention = attention_for(cfg.llm, check_causal_lm_folder(path))
    tokenizer = load_tokenizer(path)
    method, opts = quantize_settings(cfg, mixed_precision)
    dtype = weight_dtype(cfg, mixed_precision)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, use_safetensors=True,
            attn_implementation=attention, output_loading_info=True)
    except (OSError, RuntimeError) as e:  # transformers' word on weights that do not fit the config
        raise LLMModelError(f"{path}: its weights could not be loaded as the model its config.json describes "
                            f"({str(e).strip().splitlines()[0][:300]}); the folder mixes files of different models "
                            "or a file is damaged: copy it again, whole") from None
    missing = sorted(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        shown = ", ".join(str(k) for k in (missing or mismatched)[:2])
        raise LLMModelError(f"{path}: its weights do not hold the model its config.json describes: {len(missing)} "
                            f"tensors missing, {len(mismatched)} of another shape (e.g. {shown}); the folder mixes "
                            "files of different models or a file is damaged: copy it again, whole")
    model.config.use_cache = False
    if method:
        from ..core.quantize import quantize_model

        report = quantize_model(model, method, device=device, skip=keep_head, **opts)
        log.info("QLoRA base: %s", report)
    model.to(device)
    return model, tokenizer, path
