"""The causal-LM task's settings: its sections over the core's (sdxl_lora/core/config.py), the fields only it
reads ([llm], adapter.init). core.config.load_config returns a CausalLMConfig for task = "llm"."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..core import config as core
from ..core.config import SAMPLE_DATA, Section

TINY_LLM = "tiny-llm"  # the embedded tiny Llama (llm/tiny.py), the LLM's default model


class ModelConfig(core.ModelConfig):
    """The causal LM's [model]: the core's fields, its own default model."""
    path: str = Field(TINY_LLM, description="Base model: 'tiny-llm' (the embedded tiny Llama) or a transformers "
                                            "causal-LM folder.")

    @field_validator("path")
    @classmethod
    def _embedded(cls, v: str) -> str:
        # Empty, or SDXL's embedded names in a config saved before the LLM had its own default: the tiny Llama.
        return TINY_LLM if v in ("", "tiny-sdxl-demo", "tiny-sdxl") else v


class LLMConfig(Section):
    """The [llm] section: the causal LM's data, rows and previews (docs/llm.md)."""
    data: list[str] = Field(default_factory=lambda: [str(SAMPLE_DATA / "llm" / "alpaca.jsonl"),
                                                     str(SAMPLE_DATA / "llm" / "chat.jsonl")], description=(
        "JSONL files of alpaca lines ({instruction, input, output}) or chat lines ({messages: [{role, "
        "content}]}); the default is the bundled sample set."))
    format: Literal["auto", "alpaca", "chat"] = Field("auto", description=(
        "How the lines are read; 'auto' tells alpaca and chat lines apart per line."))
    max_length: int = Field(512, ge=8, description=(
        "Tokens per training row; longer examples are cut at the end (and reported)."))
    # Position ids restart per example, which is what keeps packed examples apart.
    packing: bool = Field(True, description=(
        "Pack several short examples into each row, each attending only to itself."))
    chat_template: str | None = Field(None, description=(
        "A Jinja chat template or a path to a .jinja file; none: the tokenizer's own, else a ChatML-style one."))
    system_prompt: str | None = Field(None, description=(
        "A system message for examples (and preview prompts) that have none."))
    validation_split: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Fraction of examples held out for the validation loss; 0 is none."))
    preview_prompts: list[str] = Field(default_factory=lambda: [
        "What colour is a ripe banana?", "Reverse the word: garden", "Count from one to five."], description=(
        "Prompts answered greedily before and after training (and every preview.every steps)."))
    max_new_tokens: int = Field(48, ge=1, description="The longest preview answer, in tokens.")
    loss_chunk: int = Field(256, ge=16, description=(
        "Tokens per cross-entropy chunk, so the full fp32 logits are never held at once; lower saves memory."))
    offload_activations: bool = Field(False, description=(
        "With train.gradient_checkpointing: keep each checkpointed decoder layer's input in host memory "
        "until backward needs it, not on the GPU (less GPU memory, a copy each way per layer and step)."))
    offload_embeddings: bool = Field(False, description=(
        "Keep the frozen input embedding table in CPU memory; each step reads only its tokens' rows. Less GPU "
        "memory; as fast where Triton is installed, slower elsewhere. Not for tied heads."))
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field("sdpa", description=(
        "transformers' attention kernel; 'sdpa' keeps packed examples apart through the position ids."))
    merge: bool = Field(False, description=(
        "Also write the base model with the adapter merged in (<run>/merged) at the end."))


class AdapterConfig(core.AdapterConfig):
    """The causal LM's [adapter]: the core's fields and how the adapter starts (adapter.init)."""
    init: Literal["default", "pissa", "olora", "loftq"] = Field("default", description=(
        "How lora starts: default (B = 0), pissa (the weight's top singular vectors), olora (a QR of the weight) "
        "or loftq (the 4-bit quantization error; needs model.quantize='nf4'). docs/llm.md."))

    @model_validator(mode="after")
    def _init_options(self) -> "AdapterConfig":
        # PiSSA/OLoRA move part of the weight into A and B; LoftQ sets them from the quantization error.
        if self.init != "default":
            for name, value, why in (
                    ("kind", self.kind not in ("lora",) and self.kind, "it sets LoRA's B x A factors"),
                    ("lora_bias", self.lora_bias, "peft allows the bias only with the default init"),
                    ("rank_budget", self.rank_budget or self.rank_budget_mb, "the budget's probe adapters would "
                                                                            "be initialised from the weights too")):
                if value:
                    raise ValueError(f"adapter.init={self.init!r} does not combine with adapter.{name}={value!r} "
                                     f"({why}): leave adapter.{name} unset or use adapter.init='default'")
        return self


class CausalLMConfig(core.Config):
    """A config of the causal-LM task: the core's sections, adapter.init and [llm]."""
    task: Literal["llm"] = Field("llm", description=core.Config.model_fields["task"].description)
    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)

    @model_validator(mode="after")
    def _init_fits_the_base(self) -> "CausalLMConfig":
        init, quant = self.adapter.init, self.model.quantize
        if init == "loftq" and quant not in ("nf4", "fp4"):
            raise ValueError(f"adapter.init='loftq' starts the adapter from the error of a 4-bit base, and "
                             f"model.quantize={quant!r}: set model.quantize='nf4' (or 'fp4'), or use adapter.init="
                             "'pissa' / 'olora' on an unquantized base")
        if init in ("pissa", "olora") and quant != "none":
            raise ValueError(f"adapter.init={init!r} moves part of each weight into the adapter, which a quantized "
                             f"base (model.quantize={quant!r}) cannot give back: use adapter.init='loftq' with a "
                             "4-bit base, or model.quantize='none'")
        return self
