"""LLM adapters on disk: the PEFT folder (adapter_config.json + adapter_model.safetensors) that
`PeftModel.from_pretrained` loads, and a merged model (base + adapter baked in) as a transformers folder.

Folders are written whole under a temporary name and renamed into place, so a crash leaves the old
folder or the new one, never half of one.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..core.fsutil import atomic_folder, check_destination

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's own key prefix: PeftModel wraps the base model as base_model.model.
PEFT_PREFIX = "base_model.model."


def save_peft_adapter(model: torch.nn.Module, dest: Path, base_model: str, adapter_name: str = "default",
                      metadata: dict[str, str] | None = None, initial: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the model's LoRA as a PEFT adapter folder (fp32 weights, PEFT's key names). `initial`: the
    factors a PiSSA/OLoRA adapter was injected with; the folder then holds a LoRA of the original base
    (llm/init.py: as_plain_lora)."""
    from peft import get_peft_model_state_dict

    config = model.peft_config[adapter_name]
    state = {k: v.detach().to("cpu", torch.float32) for k, v in
             get_peft_model_state_dict(model, adapter_name=adapter_name).items()}
    cfg = config.to_dict()
    if initial is not None:
        from .init import as_plain_lora

        state, cfg = as_plain_lora(state, initial, cfg)
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in state.items()}
    cfg.update(base_model_name_or_path=base_model, task_type="CAUSAL_LM", inference_mode=True)
    for k, v in cfg.items():  # sets (target_modules) are not JSON
        if isinstance(v, set):
            cfg[k] = sorted(v)
    with atomic_folder(dest, overwrite=True) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str), encoding="utf-8")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt", **(metadata or {})})
    return dest


def read_adapter_config(adapter: Path) -> dict:
    f = Path(adapter) / ADAPTER_CONFIG
    if not f.is_file() or not (Path(adapter) / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter} is not a PEFT adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
                                "expected); a run folder holds one in <run>/adapter")
    return json.loads(f.read_text(encoding="utf-8"))


def adapter_folder(path: str | Path) -> Path:
    """A PEFT folder, or a run folder's adapter/."""
    p = Path(path)
    return p / "adapter" if (p / "config.toml").is_file() and (p / "adapter").is_dir() else p


def load_with_adapter(base: Path, adapter: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      quantize: tuple[str | None, dict] = (None, {})):
    """(PeftModel, tokenizer): the base from its folder (offline), quantized and dequantized again when
    the adapter was trained on a quantized base, with the adapter loaded by PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .model import check_causal_lm_folder, load_tokenizer

    check_causal_lm_folder(base)
    read_adapter_config(adapter)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype, local_files_only=True, use_safetensors=True)
    method, opts = quantize
    if method:
        from ..core.quantize import dequantize_model, quantize_model

        log.warning("the adapter was trained on a %s-quantized base: the base is quantized and dequantized again "
                    "so the merge uses the weights the adapter saw (not the original ones)", method)
        from .model import keep_head

        quantize_model(model, method, device=torch.device(device), skip=keep_head, **{"compute_dtype": dtype, **opts})
        dequantize_model(model)
    model.to(device)
    return PeftModel.from_pretrained(model, str(adapter)), load_tokenizer(base)


def merge_adapter(base: Path, adapter: Path, out: Path, dtype: torch.dtype = torch.float32, overwrite: bool = False,
                  quantize: tuple[str | None, dict] = (None, {}), device: str = "cpu") -> Path:
    """Bake the adapter into the base and save the result (with the tokenizer) as a transformers folder."""
    check_destination(out, overwrite, reads=(base, adapter), reader="the merge")  # a folder --out is replaced whole
    model, tok = load_with_adapter(base, adapter, dtype, device, quantize)
    merged = model.merge_and_unload()
    merged.to("cpu")
    with atomic_folder(out, overwrite=True) as tmp:  # refused above unless asked
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    return out
