"""The one config schema: every default lives here; the CLI, UI and launch scripts only override it.

A config is a TOML file with the sections below (all optional) plus `--set section.key=value`
overrides. Errors name the field, the bad value and what is allowed.
"""
from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO_ROOT / "sample_data"
# The shipped demo base (model.path = "tiny-sdxl-demo"): the tiny SDXL pretrained on shapes.
DEMO_NAME = "tiny-sdxl-demo"
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / DEMO_NAME
# A model folder may hold the training settings it is meant to be trained with (TOML sections as in a
# config, no [model]): they apply wherever the user's config is silent. A 9M-parameter base wants other
# settings than SDXL's 2.6B; the demo base ships one (docs/demo_base.md).
RECOMMENDED_SETTINGS = "sdxl_lora.toml"


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and says what to do."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    # "tiny-sdxl-demo" is the shipped demo base (the tiny SDXL pretrained on shapes, docs/demo_base.md);
    # "tiny-sdxl" the same model with random weights, built in-process; otherwise a diffusers SDXL
    # folder or a single-file .safetensors checkpoint.
    path: str = "tiny-sdxl-demo"
    # Folder holding tokenizer/ and tokenizer_2/ (for single-file checkpoints, which carry none).
    tokenizer: str | None = None
    # "auto" reads the scheduler config of the model.
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = "auto"
    # Where the embedded tiny SDXL is materialised (once) as a diffusers folder.
    cache_dir: str = str(REPO_ROOT / ".cache" / "models")
    # QLoRA (docs/qlora.md): the frozen UNet's Linear layers stored quantized while the adapter trains
    # in full precision. nf4/fp4/int8 need bitsandbytes (the qlora extra); fp8 is torch only.
    quantize: Literal["none", "nf4", "fp4", "int8", "fp8"] = "none"
    # Opt-in: the frozen UNet's convolutions (conv_in/conv_out kept) in fp8 too, 1 byte a weight instead of
    # 2 (~0.3 GiB less on SDXL), with fp8's rounding error; works with any model.quantize, "none" included.
    quantize_convs: Literal["none", "fp8"] = "none"
    # nf4/fp4: quantize the block scales too (~0.4 bits a weight less).
    quant_double: bool = True
    # The dtype quantized layers compute in; "auto" follows train.mixed_precision (fp32 when "no").
    quant_compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"


class DataConfig(Section):
    # One or more dataset folders; none means the bundled sample_data/images.
    dirs: list[str] = Field(default_factory=lambda: [str(SAMPLE_DATA / "images")])
    caption_extension: str = ".txt"
    trigger_word: str = ""
    class_token: str = ""
    # Training resolution (side of a square of the same area); none means the model's native one.
    resolution: int | None = None
    bucket_step: int = 64
    max_aspect: float = 2.0
    crop: Literal["center", "random"] = "center"
    flip: bool = False
    small_images: Literal["upscale", "skip"] = "upscale"
    # Images with fewer pixels than (resolution * min_size_fraction)^2 count as small.
    min_size_fraction: float = 0.5
    # Decompression-bomb guard: images with more pixels than this are refused.
    max_pixels: int = 100_000_000
    # Images with a side shorter than this are always skipped (icons, tracking pixels, broken
    # thumbnails), whatever small_images says: upscaling them would only teach blur.
    min_side: int = Field(16, ge=1)
    shuffle_tags: bool = False
    keep_tokens: int = 0
    caption_dropout: float = 0.0
    # Fraction of images held out for the validation loss (fixed timesteps and noise); 0 = none.
    validation_split: float = Field(0.0, ge=0.0, lt=1.0)
    # Where latents and text embeddings are cached; none means <runs_dir>/.cache.
    cache_dir: str | None = None
    # Masked loss (docs/training.md): a grey-level mask beside an image (OneTrainer's convention,
    # `foo.png` + `foo-masklabel.png`) weights its loss per pixel: white learns, black is ignored.
    # An image without a mask trains everywhere (listed in the dataset report).
    masked_loss: bool = False
    mask_suffix: str = "-masklabel"

    @field_validator("caption_extension")
    @classmethod
    def _dot(cls, v: str) -> str:
        if not v.startswith("."):
            raise ValueError(f"must start with a dot, e.g. '.{v}'")
        return v

    @field_validator("mask_suffix")
    @classmethod
    def _suffix(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty (it tells a mask from its image), e.g. '-masklabel' or '.mask'")
        return v

    @field_validator("caption_dropout")
    @classmethod
    def _prob(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError("must be between 0 and 1")
        return v


class AdapterConfig(Section):
    # Which layers get LoRA, and how ranks are weighted across them (docs/injector.md):
    #   attn       to_q, to_k, to_v, to_out.0 of every attention, one rank (diffusers' default)
    #   cross-attn the same, cross-attention only
    #   topology   the attention projections, ranks weighted by slot (kind, projection, level)
    #   full       attention, feed-forward and proj_in/proj_out linears
    preset: Literal["attn", "cross-attn", "topology", "full"] = "topology"
    # The base rank (at the model's native resolution when scale_rank_with_resolution).
    rank: int = Field(16, ge=1, le=1024)
    # none means alpha = rank (scale 1); otherwise every slot keeps the same alpha/rank ratio.
    alpha: float | None = None
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # rank = base x sqrt(resolution / native resolution), rounded, clamped to [min_rank, max_rank].
    scale_rank_with_resolution: bool = True
    min_rank: int = Field(1, ge=1)
    max_rank: int = Field(256, ge=1)
    # Glob on the module path or kohya block id (IN00..IN08, MID, OUT00..OUT08) -> rank; 0 leaves it
    # out; the last matching entry wins. E.g. {"*.attn2.to_v" = 32, "OUT0[0-2]" = 8}.
    overrides: dict[str, int] = Field(default_factory=dict)
    # LoRA-Bias: a trainable bias on each adapter's up projection.
    lora_bias: bool = False
    # A budget of trainable parameters (or adapter megabytes, fp32): ranks are redistributed across the
    # planned slots in proportion to their measured sensitivity (adapter gradient norms on
    # `calibration_batches` batches before training). None: no budget.
    rank_budget: int | None = Field(None, ge=1)
    rank_budget_mb: float | None = Field(None, gt=0)
    calibration_batches: int = Field(4, ge=1)
    # Rank schedule: {step = base rank}: at each step the adapters shrink (never grow) to that base rank,
    # every slot in proportion to its planned rank, by SVD truncation of its update; e.g. rank = 64 with
    # {200 = 16} trains wide for 200 steps, then at a quarter of the rank. The export has the final ranks.
    # The optimizer's moments of a shrunk adapter restart from zero.
    rank_schedule: dict[int, int] = Field(default_factory=dict)

    @field_validator("rank_schedule")
    @classmethod
    def _schedule(cls, v: dict[int, int]) -> dict[int, int]:
        bad = {k: r for k, r in v.items() if k < 1 or r < 1}
        if bad:
            raise ValueError(f"steps and ranks must be at least 1, got {bad}; e.g. {{200 = 16}}")
        return dict(sorted(v.items()))
    # LoRA on both text encoders too (their attention q/k/v/out projections), trained with
    # train.text_encoder_lr; text embeddings are then computed live, not cached.
    train_text_encoder: bool = False
    # none means adapter.rank (alpha scales with it as for the UNet).
    text_encoder_rank: int | None = Field(None, ge=1, le=1024)


class TrainConfig(Section):
    steps: int = Field(300, ge=1)
    batch_size: int = Field(2, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    # Learning rates of the UNet's and the text encoders' adapters; none means train.lr.
    unet_lr: float | None = Field(None, gt=0)
    text_encoder_lr: float | None = Field(None, gt=0)
    # Glob on a UNet slot's module path or kohya block id (as adapter.overrides) -> lr multiplier;
    # the last matching entry wins. E.g. {"OUT0[0-2]" = 0.5, "*.attn2.*" = 2.0}.
    lr_multipliers: dict[str, float] = Field(default_factory=dict)
    # adamw8bit, paged_adamw8bit, paged_adamw and lion need bitsandbytes (the qlora extra); the paged
    # ones keep their state in memory that can spill to the host under pressure. prodigy needs
    # prodigyopt and wants lr=1.0 (it finds the step size itself). docs/training.md compares them.
    optimizer: Literal["adamw", "adamw8bit", "paged_adamw8bit", "paged_adamw", "adafactor", "lion",
                       "prodigy"] = "adamw"
    weight_decay: float = Field(1e-2, ge=0)
    # Each with warmup_steps of linear warmup first. cosine_with_restarts: scheduler_cycles hard
    # restarts; polynomial: decays to ~0 with power scheduler_power (1 = linear).
    scheduler: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = "constant"
    scheduler_cycles: int = Field(1, ge=1)
    scheduler_power: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    # The diffusion loss (docs/training.md). l2 is the usual MSE; huber is quadratic within huber_delta
    # of the target and linear beyond it.
    loss: Literal["l2", "huber"] = "l2"
    huber_delta: float = Field(1.0, gt=0)
    # Noise offset: adds offset x N(0,1) per image and channel to the noise; ~0.05-0.1 helps very
    # dark/bright images. 0 is off.
    noise_offset: float = Field(0.0, ge=0)
    # Min-SNR-gamma loss weighting (5 is the paper's value); 0 is off.
    min_snr_gamma: float = Field(0.0, ge=0)
    # Rescale the noise schedule's betas to zero terminal SNR (pairs with v-prediction models).
    zero_terminal_snr: bool = False
    # Timesteps are drawn uniformly from [timestep_min, timestep_max]; none means the schedule's last.
    timestep_min: int = Field(0, ge=0)
    timestep_max: int | None = Field(None, ge=0)
    # NaN/Inf guard: a step with a non-finite loss or gradient is skipped (weights unchanged) and
    # logged; after max_nan_steps in a row the run saves its state and stops. Costs one host sync a step.
    nan_guard: bool = True
    max_nan_steps: int = Field(5, ge=1)
    # "auto": bf16 on a GPU that supports it, fp32 ("no") on CPU.
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"
    gradient_checkpointing: bool = False
    # Speed levers (docs/speed.md): selective checkpointing to fit a memory budget (GiB of activations
    # and weights; measured per block at setup), NHWC convolutions, compilation of each repeated block
    # ("regional": transformer and ResNet blocks; "transformer": the transformer blocks only),
    # CUDA graphs of the model's forward and backward per bucket shape (one process, CUDA only).
    # channels_last with compile="regional" also keeps the ResNets' surroundings and backward in that layout.
    checkpoint_budget_gb: float | None = Field(None, gt=0)
    channels_last: bool = False
    compile: Literal["none", "regional", "transformer"] = "none"
    # With compile: the fraction (0-1] of the compiled blocks' activations kept for backward; torch's
    # partitioner recomputes the cheapest of the rest (torch._functorch.config.activation_memory_budget).
    # None keeps what the compiler keeps by default.
    compile_activation_budget: float | None = Field(None, gt=0, le=1)
    cuda_graphs: bool = False
    # Each attention's q/k/v projections (cross-attention: k/v) and their LoRA factors computed by one
    # matmul each instead of three (docs/speed.md); the same loss and gradients, fewer and larger kernels.
    # H200, compile + graphs: batch 1 71.5 -> 64.4 ms, batch 16 24.5 -> 25.3 images/s.
    fuse_qkv: bool = True
    # CUDA: the feed-forward's GEGLU backward as one Triton kernel that reads each input once
    # (sdxl_lora/kernels.py): the same gradients; H200, batch 16: 47.8 -> 17.3 ms of the step.
    fused_geglu: bool = True
    # With fuse_qkv: how each attention projection's LoRA is computed (docs/speed.md). "merged": x @ (W + sBA)^T,
    # the delta added to a copy of the frozen weight each call (rounded once to bf16: as close to fp32 as
    # peft's products, tested), A's and B's gradients as peft's; H200, batch 16: 574.9 -> 545.9 ms. "peft":
    # peft's own rank-r products and add; "concat": [x, xA^T] @ [W, sB]^T (exact; 570.6 ms). Projections
    # with fewer tokens than the weight's input width keep peft's products (the weight would cost more).
    # Quantized bases (model.quantize) take "merged" too, dequantized per call (QLoRA at batch 4: 330.4 ->
    # 283.4 ms); "concat" leaves them to peft. Without fuse_qkv every projection is peft's own.
    lora_matmul: Literal["peft", "concat", "merged"] = "merged"
    # The attention kernel of the training forward (docs/speed.md): "default" is PyTorch's own choice; a
    # named one is used alone ("cudnn" and "efficient" need CUDA). cuDNN's is 1.6x flash's on SDXL's
    # attention shapes on an H200 in isolation, and torch's own choice already runs it there (profiled).
    sdpa_backend: Literal["default", "cudnn", "flash", "efficient", "math"] = "default"
    # Several processes: how the adapter's gradients are averaged. "ddp": DistributedDataParallel's
    # bucketed all-reduce, overlapped with the backward; "allreduce": the model is not wrapped and the
    # loop averages all adapter gradients in one flat all-reduce after the backward (what a CUDA-graphed
    # step needs: DDP's hooks cannot be captured); "auto": allreduce with cuda_graphs, ddp otherwise.
    gradient_sync: Literal["auto", "ddp", "allreduce"] = "auto"
    # Record N steps with torch's profiler into <run>/profile (a trace Perfetto opens) and log where the
    # step time goes. 0 is off.
    profile_steps: int = Field(0, ge=0)
    seed: int = 42
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(10, ge=1)
    # Training state (adapter, optimizer, schedule, RNG, data position) every N steps and/or every
    # M minutes, whichever comes first; 0 turns either off. The last K states are kept.
    save_every: int = Field(100, ge=0)
    save_every_minutes: float = Field(10.0, ge=0)
    keep_checkpoints: int = Field(3, ge=1)
    # Exponential moving average of the adapter weights (fp32, on the device), updated after each
    # optimizer step; the exported adapter and the final previews use it.
    ema: bool = False
    ema_decay: float = Field(0.999, gt=0, lt=1)
    # TensorBoard event files in <run>/tensorboard (needs the tensorboard package).
    tensorboard: bool = False
    # The GPU's dense bf16/fp16 peak in TFLOP/s for the MFU figure; none looks the GPU up by name.
    peak_tflops: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _timestep_range(self) -> "TrainConfig":
        if self.timestep_max is not None and self.timestep_max < self.timestep_min:
            raise ValueError(f"timestep_max={self.timestep_max} is below timestep_min={self.timestep_min}; "
                             "the range is [timestep_min, timestep_max]")
        return self

    @model_validator(mode="after")
    def _lora_matmul_needs_fused_projections(self) -> "TrainConfig":
        # Only a choice the user made: the default ("merged") simply has nothing to act on without fuse_qkv.
        if self.lora_matmul != "peft" and not self.fuse_qkv and "lora_matmul" in self.model_fields_set:
            raise ValueError(f"lora_matmul={self.lora_matmul!r} works through the fused attention projections: set "
                             "train.fuse_qkv=true too, or train.lora_matmul='peft'")
        return self


class PreviewConfig(Section):
    # One prompt per line, with kohya's per-line options (`a cat --n blurry --w 1024 --h 1024 --s 30
    # --l 7 --d 42`), or a .toml ([[prompt]] tables) / .jsonl / .json file of entries with fields
    # (docs/training.md); none means the bundled sample_data/prompts.txt. Empty string: no previews.
    prompts: str | None = str(SAMPLE_DATA / "prompts.txt")
    # Also every N steps during training (0: only before and after). The validation loss (with
    # data.validation_split) is computed at the same steps.
    every: int = Field(0, ge=0)
    steps: int = Field(20, ge=1)
    guidance: float = 5.0
    # Classifier-free guidance rescale (Lin et al. 2023); none means 0.7 with train.zero_terminal_snr, else 0.
    guidance_rescale: float | None = Field(None, ge=0, le=1)
    seed: int = 0
    # Render before training (baseline) and at the end.
    before: bool = True
    after: bool = True
    # Score the previews for a concept with the shapes detector (sdxl/shapes.py: shape and/or colour
    # words, e.g. "star"): a "concept" event per preview, over the prompts naming it (prompts naming
    # none of its words are not scored, so it is harmless for other prompts). "" is off.
    concept: str = "star"


class OutputConfig(Section):
    runs_dir: str = "runs"
    # none means a timestamped name.
    name: str | None = None
    overwrite: bool = False


class LLMConfig(Section):
    """Fields of the causal-LM task only (`task = "llm"`, docs/llm.md); the other sections are shared."""
    # JSONL files: alpaca-style lines ({"instruction", "input", "output"}) or chat lines ({"messages":
    # [{"role", "content"}, ...]}); "auto" tells them apart per line. Default: the bundled sample set.
    data: list[str] = Field(default_factory=lambda: [str(SAMPLE_DATA / "llm" / "alpaca.jsonl"),
                                                     str(SAMPLE_DATA / "llm" / "chat.jsonl")])
    format: Literal["auto", "alpaca", "chat"] = "auto"
    # Tokens per training row; longer examples are cut at the end (and reported).
    max_length: int = Field(512, ge=8)
    # Several short examples per row, each attending only to itself (position ids restart per example).
    packing: bool = True
    # A Jinja chat template (or a path to a .jinja file); none: the tokenizer's own, else a ChatML-style default.
    chat_template: str | None = None
    # Prepended as a system message to examples that have none (and to preview prompts).
    system_prompt: str | None = None
    # Fraction of examples held out for the validation loss; 0 = none.
    validation_split: float = Field(0.0, ge=0.0, lt=1.0)
    # Answered greedily before and after training (and every preview.every steps).
    preview_prompts: list[str] = Field(default_factory=lambda: [
        "What colour is a ripe banana?", "Reverse the word: garden", "Count from one to five."])
    max_new_tokens: int = Field(48, ge=1)
    # Tokens per cross-entropy chunk: full fp32 logits (tokens x vocabulary) are never held at once.
    loss_chunk: int = Field(1024, ge=16)
    # transformers' attention kernel; "sdpa" masks packed examples apart through the position ids.
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # Also write the base model with the adapter merged in (<run>/merged) at the end.
    merge: bool = False


class Config(Section):
    # Which task trains: the SDXL UNet, or a causal LM (`sdxl-lora llm train` sets "llm").
    task: Literal["sdxl", "llm"] = "sdxl"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    preview: PreviewConfig = Field(default_factory=PreviewConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)

    @model_validator(mode="after")
    def _llm_model(self) -> "Config":
        # The SDXL default model means "the embedded one": for an LLM run that is the tiny Llama.
        if self.task == "llm" and self.model.path in ("tiny-sdxl-demo", "tiny-sdxl"):
            self.model.path = "tiny-llm"
        return self

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.model_dump(mode="json")))


def _drop_none(d: Any) -> Any:
    # TOML has no null; a missing key means "default", which is what None means here.
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def _parse_value(raw: str) -> Any:
    """`--set` values are TOML literals (1e-4, true, [1, 2], "x"); anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            section = _section_at(e["loc"][:-1])
            allowed = ", ".join(section.model_fields) if section else ""
            msg = f"unknown field; allowed here: {allowed}"
        elif e["type"] == "literal_error":
            msg = f"must be one of {e['ctx']['expected']}"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {field}{shown}: {msg}")
    return "\n".join(lines)


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for p in loc:
        f = model.model_fields.get(str(p))
        if f is None or not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)):
            return None
        model = f.annotation
    return model


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                extra: dict[str, Any] | None = None) -> Config:
    """Build a Config from an optional TOML file, then `key=value` overrides, then a dict of dotted keys."""
    tree: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
        source = str(p)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.lr=1e-4")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(raw.strip()))
        source = f"{source} + --set"
    for key, value in (extra or {}).items():
        _set_dotted(tree, key, value)
    recommended, rec_path = recommended_settings(tree)
    if recommended:
        applied = sorted(set(_dotted_keys(recommended)) - set(_dotted_keys(tree)))
        if applied:
            import logging

            logging.getLogger(__name__).info("%s: the model's recommended settings apply where the config is "
                                             "silent: %s", rec_path, ", ".join(applied))
            source = f"{source} + {rec_path}"
        tree = _merged(recommended, tree)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def recommended_settings(tree: dict) -> tuple[dict, Path | None]:
    """The RECOMMENDED_SETTINGS file of the model a (not yet validated) config tree names, parsed: ({}, None)
    when the model folder has none, or the task is not SDXL."""
    if tree.get("task", "sdxl") != "sdxl":
        return {}, None
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    name = str(model.get("path", ModelConfig.model_fields["path"].default))
    folder = DEMO_DIR if name == DEMO_NAME else Path(name).expanduser()
    path = folder / RECOMMENDED_SETTINGS
    if not path.is_file():
        return {}, None
    try:
        rec = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} (the model's recommended training settings) is not valid TOML: {e}; fix or "
                          "remove it") from e
    bad = sorted(set(rec) - {"data", "adapter", "train", "preview"})
    if bad:
        raise ConfigError(f"{path}: a model's recommended settings may hold [data], [adapter], [train] and "
                          f"[preview] only, not {', '.join(bad)}; fix or remove the file")
    return rec, path


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and k not in _table_fields():
            out += _dotted_keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


@functools.cache
def _table_fields() -> frozenset[str]:
    """Fields whose value is itself a table (adapter.overrides, train.lr_multipliers, ...): a config sets
    them whole, so they merge as one value, not key by key."""
    from typing import get_origin

    return frozenset(name for section in (DataConfig, AdapterConfig, TrainConfig, PreviewConfig)
                     for name, f in section.model_fields.items() if get_origin(f.annotation) is dict)


def _merged(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (a field set in `top` wins whole)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = (_merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict)
                  and k not in _table_fields() else v)
    return out
