"""The one config schema: every default lives here; the CLI, UI and launch scripts only override it.

A config is a TOML file with the sections below (all optional) plus `--set section.key=value`
overrides. Errors name the field, the bad value and what is allowed.
"""
from __future__ import annotations

import functools
import logging
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import presets

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO_ROOT / "sample_data"
# The shipped demo base (model.path = "tiny-sdxl-demo"): the tiny SDXL pretrained on shapes.
DEMO_NAME = "tiny-sdxl-demo"
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / DEMO_NAME
# A model folder may hold the training settings it is meant to be trained with (TOML sections as in a
# config, no [model]): they apply wherever the user's config is silent. A 9M-parameter base wants other
# settings than SDXL's 2.6B; the demo base ships one (docs/demo_base.md).
RECOMMENDED_SETTINGS = "sdxl_lora.toml"


_EXTENSION = re.compile(r"\.[A-Za-z0-9_.-]{1,32}")


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and says what to do. problems: each wrong value as
    pydantic describes it (loc, type, msg, input, ctx), for a front end that names fields in its own words."""

    def __init__(self, message: str, problems: list[dict] | tuple = ()):
        super().__init__(message)
        self.problems = list(problems)


class MissingPackage(ImportError):
    """A feature asked for needs a package that is not installed; the message names what to install."""


class Section(BaseModel):
    # No field takes inf or nan: a learning rate or noise offset of inf trains to NaN and still "finishes".
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Which tasks a field does something for: json_schema_extra={"tasks": ...} on the field, or on its section's
# model_config; unmarked means every task. fields_for_other_tasks() names the ones a config sets in vain.
SDXL_ONLY = {"tasks": ("sdxl",)}
LLM_ONLY = {"tasks": ("llm",)}


class ModelConfig(Section):
    path: str = Field("tiny-sdxl-demo", description=(
        "Base model: 'tiny-sdxl-demo' (the shipped demo), 'tiny-sdxl' (random weights), a diffusers SDXL folder or "
        "a single-file .safetensors; for the LLM task 'tiny-llm' or a transformers causal-LM folder."))
    tokenizer: str | None = Field(None, json_schema_extra=SDXL_ONLY, description=(
        "Folder holding tokenizer/ and tokenizer_2/, for single-file checkpoints (they carry none)."))
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field("auto", json_schema_extra=SDXL_ONLY,
        description="What the UNet predicts; 'auto' reads the model's scheduler config.")
    cache_dir: str = Field(str(REPO_ROOT / ".cache" / "models"), description=(
        "Where the built-in tiny models are written out (once) as model folders."))
    # QLoRA (docs/qlora.md): the adapter itself always trains in full precision.
    quantize: Literal["none", "nf4", "fp4", "int8", "fp8"] = Field("none", description=(
        "QLoRA: keep the frozen base's Linear layers quantized to save memory; nf4/fp4/int8 need bitsandbytes "
        "(the qlora extra), fp8 only torch."))
    quantize_convs: Literal["none", "fp8"] = Field("none", json_schema_extra=SDXL_ONLY, description=(
        "Also keep the frozen UNet's convolutions (not conv_in/conv_out) in fp8: less memory, fp8's rounding "
        "error; works with any model.quantize."))
    quant_double: bool = Field(True, description="nf4/fp4: quantize the block scales too (a little less memory).")
    tiled_vae_encode: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "Encode images in tiles when caching latents: far less memory at full size; the latents differ slightly "
        "near tile seams. train.vram_gb turns it on where the budget needs it."))
    quant_compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description=(
        "The dtype quantized layers compute in; 'auto' follows train.mixed_precision (fp32 when 'no')."))


class DataConfig(Section):
    """The image dataset of the SDXL task (the LLM task reads llm.data)."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True, json_schema_extra=SDXL_ONLY)

    dirs: list[str] = Field(default_factory=lambda: [str(SAMPLE_DATA / "images")], description=(
        "Dataset folders of images with caption files; the default is the bundled sample set."))
    caption_extension: str = Field(".txt", description="Extension of the caption file beside each image.")
    trigger_word: str = Field("", description=(
        "The word that calls your concept up: put first in every caption that lacks it."))
    class_token: str = Field("", description=(
        "What the concept is (e.g. 'dog'): with the trigger word, the caption of images that have none."))
    resolution: int | None = Field(None, ge=64, le=8192, description=(
        "Training resolution (the side of a square of the same area); none means the model's native one."))
    bucket_step: int = Field(64, ge=8, le=512, description="Bucket sides are multiples of this many pixels (a multiple of 8).")
    max_aspect: float = Field(2.0, ge=1.0, le=8.0, description="The most elongated bucket, long side over short side.")
    crop: Literal["center", "random"] = Field("center", description="Where an image is cropped to fit its bucket.")
    flip: bool = Field(False, description=(
        "Mirror images left-right at random (not for text or one-sided subjects)."))
    small_images: Literal["upscale", "skip"] = Field("upscale", description=(
        "What to do with images smaller than min_size_fraction of the resolution."))
    min_size_fraction: float = Field(0.5, gt=0, le=1, description=(
        "Images with fewer pixels than (resolution x this)^2 count as small."))
    max_pixels: int = Field(100_000_000, ge=1, description=(
        "Images with more pixels than this are refused (a guard against decompression bombs)."))
    # Skipped whatever small_images says: upscaling icons, tracking pixels or broken thumbnails only teaches blur.
    min_side: int = Field(16, ge=1, description="Images with a side shorter than this many pixels are always skipped.")
    shuffle_tags: bool = Field(False, description=(
        "Shuffle a caption's comma-separated tags each time it is used (the first keep_tokens stay)."))
    keep_tokens: int = Field(0, ge=0, description="With shuffle_tags: how many leading tags stay in place.")
    caption_dropout: float = Field(0.0, description=(
        "Chance an image trains with an empty caption, which keeps classifier-free guidance working."))
    tag_dropout: float = Field(0.0, description=(
        "Chance each comma-separated tag (after the first keep_tokens) is left out of a caption, each time."))
    keep_tokens_separator: str = Field("", description=(
        "With shuffle_tags or tag_dropout: the tags before this mark (e.g. '|||') stay in place instead of the "
        "first keep_tokens; a second mark keeps the tags after it at the end."))
    wildcards: bool = Field(False, description=(
        "A caption's {a|b|c} picks one of its choices each time it is used ({{ and }} are plain braces)."))
    caption_prefix: str = Field("", description="Text put before every caption (after dropout decides).")
    caption_suffix: str = Field("", description="Text put after every caption.")
    datasets: list["DatasetConfig"] = Field(default_factory=list, description=(
        "Several datasets, each a [[data.datasets]] table with its own path and settings (docs/data.md); set, "
        "it replaces data.dirs, and the data.* values above are the defaults each table overrides."))
    validation_split: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Fraction of images held out for the validation loss (fixed timesteps and noise); 0 is none."))
    cache_dir: str | None = Field(None, description=(
        "Where latents and text embeddings are cached; none means <runs_dir>/.cache."))
    # OneTrainer's convention (docs/training.md); an image without a mask trains everywhere (the dataset
    # report lists them).
    masked_loss: bool = Field(False, description=(
        "Weight each image's loss by a grey mask beside it (foo.png + foo-masklabel.png): white learns, black "
        "is ignored."))
    mask_suffix: str = Field("-masklabel", description="What a mask's file name adds to its image's name.")

    @field_validator("caption_extension")
    @classmethod
    def _dot(cls, v: str) -> str:
        if not v.startswith("."):
            raise ValueError(f"must start with a dot, e.g. '.{v}'")
        # An extension, never a path: the caption file sits beside its image, whoever writes it (the UI's
        # caption editor, a captioner).
        if not _EXTENSION.fullmatch(v) or ".." in v:
            raise ValueError("must be a file extension such as '.txt' or '.caption' (a dot, then letters, "
                             "digits, '-', '_' or single dots), not a path")
        return v

    @field_validator("mask_suffix")
    @classmethod
    def _suffix(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty (it tells a mask from its image), e.g. '-masklabel' or '.mask'")
        return v

    @field_validator("caption_dropout", "tag_dropout")
    @classmethod
    def _prob(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError("must be between 0 and 1")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> "DataConfig":
        # Folders from --data / data.dirs beside [[data.datasets]] tables: one of them would be ignored silently.
        if self.datasets and self.dirs != type(self).model_fields["dirs"].default_factory():
            raise ValueError(f"data.dirs = {self.dirs} and {len(self.datasets)} [[data.datasets]] table(s) both name "
                             "the folders to train on — put each folder in a table (path = ...) and drop data.dirs "
                             "(or --data), or drop the tables")
        return self


# The data.* fields a [[data.datasets]] table may override (the rest are about the whole run: buckets' step,
# pixel limits, caches, masks, validation).
DATASET_OVERRIDES = ("caption_extension", "trigger_word", "class_token", "resolution", "flip", "shuffle_tags",
                     "keep_tokens", "keep_tokens_separator", "caption_dropout", "tag_dropout", "caption_prefix",
                     "caption_suffix", "small_images", "wildcards")


class DatasetConfig(Section):
    """One [[data.datasets]] table: a folder and the settings that differ from data.*'s (kohya's dataset TOML
    subsets, OneTrainer's concepts). A field left out takes data.*'s value."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True, json_schema_extra=SDXL_ONLY)

    path: str | None = Field(None, description=(
        "The dataset's folder of images with caption files (none: images generated from class_prompt)."))
    class_prompt: str | None = Field(None, description=(
        "Regularization images made by the base model from this prompt when training starts (no path), "
        "cached like latents and captioned with the prompt (docs/data.md)."))
    class_images: int = Field(0, ge=0, description="With class_prompt: how many images to generate.")
    repeats: int | None = Field(None, ge=1, description=(
        "Times each image counts per epoch; none means kohya folder names ('10_sks dog') decide, else 1."))
    is_regularization: bool = Field(False, description=(
        "Regularization (class) images: never given the trigger word, their loss weighted by "
        "train.prior_loss_weight, repeated to balance the training images per epoch (docs/data.md)."))
    name: str | None = Field(None, description="What reports call the dataset; none means its folder's name.")
    caption_extension: str | None = None
    trigger_word: str | None = None
    class_token: str | None = None
    resolution: int | None = Field(None, ge=64, le=8192)
    flip: bool | None = None
    shuffle_tags: bool | None = None
    keep_tokens: int | None = Field(None, ge=0)
    keep_tokens_separator: str | None = None
    caption_dropout: float | None = None
    tag_dropout: float | None = None
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    wildcards: bool | None = None
    small_images: Literal["upscale", "skip"] | None = None

    @field_validator("caption_extension")
    @classmethod
    def _dot(cls, v: str | None) -> str | None:
        return None if v is None else DataConfig._dot(v)

    @field_validator("caption_dropout", "tag_dropout")
    @classmethod
    def _prob(cls, v: float | None) -> float | None:
        return None if v is None else DataConfig._prob(v)

    @model_validator(mode="after")
    def _source(self) -> "DatasetConfig":
        if self.path is None and not (self.class_prompt and self.class_images):
            raise ValueError("needs a path (a folder of images), or class_prompt and class_images > 0 for "
                             "regularization images made by the base model")
        if self.path is not None and self.class_prompt:
            raise ValueError("has both a path and a class_prompt: images are generated into the cache, never into "
                             "your folder — give one of them")
        if self.class_prompt and not self.is_regularization:
            raise ValueError("class_prompt makes regularization images: set is_regularization = true")
        return self

    def settings(self, base: DataConfig) -> DataConfig:
        """data.* with this table's settings over it, for this folder alone."""
        update = {f: getattr(self, f) for f in DATASET_OVERRIDES if getattr(self, f) is not None}
        return base.model_copy(update={**update, "dirs": [self.path], "datasets": []})


DataConfig.model_rebuild()


class AdapterConfig(Section):
    # What each kind is, when to use it and how each tool loads it: docs/training.md, docs/export.md.
    kind: Literal["lora", "dora", "loha", "lokr"] = Field("lora", description=(
        "The adapter: lora (B x A), dora (LoRA plus a trained magnitude per output), loha (Hadamard product of "
        "two low-rank pairs), lokr (Kronecker product of two small factors: small files)."))
    # The presets' slots and weights: docs/injector.md.
    preset: Literal["attn", "cross-attn", "topology", "full", "locon"] = Field("topology", description=(
        "Which layers: attn (attention projections), cross-attn (cross-attention only), topology (attention, "
        "ranks weighted by layer), full (attention, feed-forward), locon (full + ResNet convolutions)."))
    rank: int = Field(16, ge=1, le=1024, description=(
        "The base LoRA rank (SDXL: at the model's native resolution, see scale_rank_with_resolution)."))
    alpha: float | None = Field(None, gt=0, description=(
        "LoRA alpha; none means alpha = rank (scale 1). Every layer keeps the same alpha/rank ratio (with rslora: "
        "the same alpha)."))
    # A convolution's update sees 9x more inputs per output than a projection's; LyCORIS' conv_dim/conv_alpha.
    conv_rank: int | None = Field(None, ge=1, le=1024, json_schema_extra=SDXL_ONLY, description=(
        "The rank of the convolution layers the plan adapts (preset locon, or overrides naming convs), scaled "
        "with resolution as rank is; none means adapter.rank."))
    conv_alpha: float | None = Field(None, gt=0, json_schema_extra=SDXL_ONLY, description=(
        "The convolutions' alpha; none keeps the alpha/rank ratio of adapter.alpha."))
    rslora: bool = Field(False, description=(
        "rsLoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank, every layer with the same alpha, "
        "so high ranks keep learning (lora and dora); exports carry the equivalent alpha."))
    init: Literal["default", "pissa", "olora", "loftq"] = Field("default", json_schema_extra=LLM_ONLY, description=(
        "How lora starts: default (B = 0), pissa (the weight's top singular vectors), olora (a QR of the weight) "
        "or loftq (the 4-bit quantization error; needs model.quantize='nf4'). docs/llm.md."))
    lokr_factor: int | None = Field(None, ge=1, description=(
        "lokr: the size of the Kronecker product's small factor; none: as close to the square root of each "
        "dimension as it divides."))
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")
    scale_rank_with_resolution: bool = Field(True, json_schema_extra=SDXL_ONLY, description=(
        "Scale the rank by sqrt(resolution / native resolution), rounded and kept in [min_rank, max_rank]."))
    min_rank: int = Field(1, ge=1, description="The lowest rank a layer gets after scaling, weighting or a budget.")
    max_rank: int = Field(256, ge=1, description="The highest rank a layer gets after scaling, weighting or a budget.")
    overrides: dict[str, Annotated[int, Field(ge=0, le=1024)]] = Field(default_factory=dict, description=(
        "Per-layer ranks: glob on a module path or kohya block id -> rank, 0 leaves it out; the last match wins. "
        "E.g. {\"*.attn2.to_v\" = 32, \"OUT0[0-2]\" = 8}."))
    lora_bias: bool = Field(False, description="LoRA-Bias: a trainable bias on each adapter's up projection.")
    # The sensitivity is each planned layer's adapter gradient norm over calibration_batches batches.
    rank_budget: int | None = Field(None, ge=1, description=(
        "A budget of trainable parameters: ranks are shared out by each layer's sensitivity, measured before "
        "training. None: no budget."))
    rank_budget_mb: float | None = Field(None, gt=0, description="The same budget in adapter megabytes (fp32).")
    calibration_batches: int = Field(4, ge=1, description="Batches a rank budget measures the layers' sensitivity on.")
    # Every slot shrinks in proportion to its planned rank, by SVD truncation of its update; the optimizer's
    # moments of a shrunk adapter restart from zero.
    rank_schedule: dict[int, int] = Field(default_factory=dict, json_schema_extra=SDXL_ONLY, description=(
        "{step = base rank}: at each step the adapters shrink to that rank, e.g. rank = 64 with {200 = 16}; "
        "the export has the final ranks."))

    @field_validator("rank_schedule")
    @classmethod
    def _schedule(cls, v: dict[int, int]) -> dict[int, int]:
        bad = {k: r for k, r in v.items() if k < 1 or r < 1}
        if bad:
            raise ValueError(f"steps and ranks must be at least 1, got {bad}; e.g. {{200 = 16}}")
        return dict(sorted(v.items()))
    @model_validator(mode="after")
    def _kind_options(self) -> "AdapterConfig":
        # What peft's LoHa/LoKr layers do not have, and plans that assume LoRA's B x A factors.
        if self.kind in ("loha", "lokr"):
            for name, value, why in (
                    ("lora_bias", self.lora_bias, "a bias on B, which LoHa/LoKr have not"),
                    ("dropout", self.dropout, "dropout on LoRA's input, which peft's LoHa/LoKr layers have not"),
                    ("rslora", self.rslora, "LoRA's alpha / sqrt(rank) rule"),
                    ("rank_schedule", self.rank_schedule, "an SVD of LoRA's B x A")):
                if value:
                    raise ValueError(f"adapter.{name}={value!r} is for lora and dora ({why}), not "
                                     f"adapter.kind={self.kind!r}: leave it unset or use kind='lora' or 'dora'")
        if self.init != "default":
            # PiSSA/OLoRA move part of the weight into A and B; LoftQ sets them from the quantization error.
            for name, value, why in (
                    ("kind", self.kind not in ("lora",) and self.kind, "it sets LoRA's B x A factors"),
                    ("lora_bias", self.lora_bias, "peft allows the bias only with the default init"),
                    ("rank_schedule", self.rank_schedule, "a cut rank no longer holds the part of the weight "
                                                          "the init moved into the adapter"),
                    ("rank_budget", self.rank_budget or self.rank_budget_mb, "the budget's probe adapters would "
                                                                            "be initialised from the weights too")):
                if value:
                    raise ValueError(f"adapter.init={self.init!r} does not combine with adapter.{name}={value!r} "
                                     f"({why}): leave adapter.{name} unset or use adapter.init='default'")
        if self.kind == "dora" and self.lora_bias:
            raise ValueError("adapter.lora_bias=True with adapter.kind='dora': peft's DoRA layers have no LoRA "
                             "bias; use kind='lora' or lora_bias=false")
        return self

    train_text_encoder: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "LoRA on both text encoders' attention too (at train.text_encoder_lr); text embeddings are then "
        "computed each step, not cached."))
    text_encoder_rank: int | None = Field(None, ge=1, le=1024, json_schema_extra=SDXL_ONLY, description=(
        "The text encoders' rank; none means adapter.rank."))


# train.* settings that were removed, with what a user reads about each: a config that sets one loads with a
# warning (TrainConfig._removed_fields). benchmarks/RESULTS.md#levers-measured-and-not-kept says why each went.
REMOVED_TRAIN_FIELDS = {
    "reuse_conv_search": "cuDNN's algorithm search now runs in the first step, as torch does it",
    "background_compile": "a compiled run compiles in its first step",
    "graphs_while_compiling": "a compiled run compiles in its first step",
}


class TrainConfig(Section):
    steps: int = Field(300, ge=1, description="Optimizer steps to train for (unless train.epochs is set).")
    # kohya's count: an epoch is every image as many times as its dataset's repeats, in global batches of
    # batch_size x processes, and grad_accum batches make one step.
    epochs: int | None = Field(None, ge=1, description=(
        "Train this many epochs instead of train.steps: an epoch is each image once per its dataset's repeats, "
        "batch_size x processes images a batch, grad_accum batches a step (kohya's count)."))
    batch_size: int = Field(2, ge=1, description="Examples (images, or LLM rows) per step on each process.")
    grad_accum: int = Field(1, ge=1, description=(
        "Batches whose gradients add up into one optimizer step: a larger effective batch in the same memory."))
    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    unet_lr: float | None = Field(None, gt=0, json_schema_extra=SDXL_ONLY, description=(
        "Learning rate of the UNet's adapters; none means train.lr."))
    text_encoder_lr: float | None = Field(None, gt=0, json_schema_extra=SDXL_ONLY, description=(
        "Learning rate of the text encoders' adapters; none means train.lr."))
    # LoRA+ (Hayou et al. 2024): B starts at zero and needs a larger step than A; B's group is peft's (B's
    # matrices, biases and DoRA's magnitudes: core/optim.py).
    loraplus_ratio: float | None = Field(None, ge=1, description=(
        "LoRA+: the learning rate of each adapter's B (up) matrix is this multiple of A's, e.g. 16; lora and "
        "dora only. None: one learning rate."))
    lr_multipliers: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict, json_schema_extra=SDXL_ONLY, description=(
        "Per-layer lr factors: glob on a UNet module path or kohya block id -> multiplier; the last match wins. "
        "E.g. {\"OUT0[0-2]\" = 0.5}."))
    # The paged optimizers keep their state in memory that can spill to the host under pressure; prodigy finds
    # the step size itself. docs/training.md compares them.
    optimizer: Literal["adamw", "adamw8bit", "paged_adamw8bit", "paged_adamw", "adafactor", "lion",
                       "prodigy", "adamw_schedulefree", "came"] = Field("adamw", description=(
        "The optimizer; its lr (docs/training.md): prodigy 1.0; adamw_schedulefree 1-2x adamw's, constant "
        "schedule; came 1e-4 to 2e-4. bitsandbytes (qlora extra) for adamw8bit, paged_*, lion."))
    weight_decay: float = Field(1e-2, ge=0, description="Weight decay of the adapter weights.")
    scheduler: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = Field(
        "constant", description="The learning-rate schedule, after warmup_steps of linear warmup.")
    scheduler_cycles: int = Field(1, ge=1, description="cosine_with_restarts: how many cycles (hard restarts).")
    scheduler_power: float = Field(1.0, gt=0, description=(
        "polynomial: the power of the decay to ~0 (1 is linear)."))
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup before the schedule.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the gradient norm to this; 0 turns clipping off.")
    # The losses and their weighting: docs/training.md.
    loss: Literal["l2", "huber"] = Field("l2", json_schema_extra=SDXL_ONLY, description=(
        "The diffusion loss: l2 is the usual MSE; huber is quadratic within huber_delta of the target and "
        "linear beyond, so outliers pull less."))
    huber_delta: float = Field(1.0, gt=0, json_schema_extra=SDXL_ONLY, description=(
        "huber: the distance where the loss turns from quadratic to linear."))
    prior_loss_weight: float = Field(1.0, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "Regularization images (a dataset with is_regularization): each one's loss is multiplied by this, as "
        "kohya does; 0 leaves them out of the loss."))
    prior_prediction: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "Regularization images learn the base model's own prediction (the adapter off) instead of their noise, as "
        "OneTrainer's prior prediction: the images need not be good, only their captions matter."))
    noise_offset: float = Field(0.0, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "Adds offset x N(0,1) per image and channel to the noise; ~0.05-0.1 helps very dark or bright images. "
        "0 is off."))
    min_snr_gamma: float = Field(0.0, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "Min-SNR-gamma loss weighting (5 is the paper's value); 0 is off."))
    debiased_estimation: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "Weight each image's loss by 1/sqrt(SNR) (v-prediction: 1/(SNR+1)), debiased estimation as kohya offers it; "
        "with min_snr_gamma both weights apply."))
    multires_noise_iterations: int = Field(0, ge=0, le=20, json_schema_extra=SDXL_ONLY, description=(
        "Multi-resolution noise: adds this many coarser noise levels, so the model learns overall colour and layout "
        "(6-10 are usual); 0 is off."))
    multires_noise_discount: float = Field(0.3, gt=0, le=1, json_schema_extra=SDXL_ONLY, description=(
        "With multires_noise_iterations: level i of the coarser noise is weighted by this to the power i."))
    ip_noise_gamma: float = Field(0.0, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "Input perturbation: the model sees latents noised with noise + gamma x N(0,1) while it predicts the noise, "
        "against exposure bias (0.1 is the paper's value); 0 is off."))
    zero_terminal_snr: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "Rescale the noise schedule to zero terminal SNR (pairs with v-prediction models)."))
    timestep_min: int = Field(0, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "The lowest timestep trained on (timesteps are drawn uniformly in the range)."))
    timestep_max: int | None = Field(None, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "The highest timestep trained on; none means the schedule's last."))
    # Checking the loss and gradients costs one host sync a step.
    nan_guard: bool = Field(True, description=(
        "Skip a step whose loss or gradient is not finite (weights unchanged); after max_nan_steps in a row, "
        "save and stop."))
    max_nan_steps: int = Field(5, ge=1, description="With nan_guard: non-finite steps in a row that stop the run.")
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = Field("auto", description=(
        "Training precision; 'auto' is bf16 on a GPU that supports it, fp32 ('no') otherwise."))
    gradient_checkpointing: bool = Field(False, description=(
        "Recompute activations in the backward instead of keeping them: less memory, slower steps."))
    # Speed and memory levers: docs/speed.md.
    speed: Literal["auto", "off"] = Field("auto", description=(
        "On a CUDA GPU, 'auto' turns on the speed levers that pay for the run's length (CUDA graphs, "
        "compilation, channels_last) and logs why; a lever you set wins. 'off': only yours."))
    vram_gb: float | None = Field(None, gt=0, description=(
        "GPU memory the whole run may use, in GiB: the fastest settings that fit are chosen and logged, the "
        "process is capped there, and a budget that cannot be met is refused at start."))
    checkpoint_budget_gb: float | None = Field(None, gt=0, json_schema_extra=SDXL_ONLY, description=(
        "A memory budget in GiB (activations and weights): only as many blocks are checkpointed as it takes "
        "to fit."))
    # With compile="regional" the ResNets' surroundings and backward keep that layout too.
    channels_last: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "Run the UNet's convolutions in channels-last (NHWC) memory layout."))
    compile: Literal["none", "regional", "transformer"] = Field("none", description=(
        "torch.compile each repeated block: 'regional' (transformer and ResNet blocks; LLM: decoder layers), "
        "'transformer' (transformer blocks only). The first steps include compilation."))
    # torch._functorch.config.activation_memory_budget: torch's partitioner recomputes the cheapest of the rest.
    compile_activation_budget: float | None = Field(None, gt=0, le=1, description=(
        "With compile: the fraction of the compiled blocks' activations kept for the backward, the rest "
        "recomputed; none keeps the compiler's choice."))
    cuda_graphs: bool = Field(False, description=(
        "Replay the step from CUDA graphs (CUDA only): SDXL, the UNet's forward and backward per bucket shape; "
        "LLM, the compiled decoder layers (no checkpointing)."))
    fuse_qkv: bool = Field(True, json_schema_extra=SDXL_ONLY, description=(
        "Compute each attention's q/k/v projections and their LoRA in one matmul instead of three: the same "
        "loss and gradients, fewer kernels."))
    fused_geglu: bool = Field(True, json_schema_extra=SDXL_ONLY, description=(
        "CUDA: the feed-forward's GEGLU backward as one Triton kernel that reads each input once (the same "
        "gradients)."))
    # "merged" rounds the summed weight once to bf16, which stays as close to fp32 as peft's products (tested),
    # and gives A and B peft's gradients. Projections with fewer tokens than the weight's input width keep
    # peft's products (the weight-sized copy would cost more than it saves); quantized bases take "merged"
    # dequantized per call.
    lora_matmul: Literal["peft", "merged"] = Field("merged", json_schema_extra=SDXL_ONLY, description=(
        "With fuse_qkv: how the attention projections' LoRA is computed. 'merged': x @ (W + sBA)^T; "
        "'peft': peft's own products."))
    # On SDXL's attention shapes torch's own choice already runs cuDNN's kernel, the fastest (docs/speed.md).
    sdpa_backend: Literal["default", "cudnn", "flash", "efficient", "math"] = Field(
        "default", json_schema_extra=SDXL_ONLY, description=(
            "The attention kernel of the training forward: 'default' lets PyTorch choose; a named one is used "
            "alone (cudnn and efficient need CUDA)."))
    # "allreduce" is what a CUDA-graphed step needs: DDP's hooks cannot be captured.
    gradient_sync: Literal["auto", "ddp", "allreduce"] = Field("auto", description=(
        "Several processes: 'ddp' averages gradients overlapped with the backward, 'allreduce' in one flat "
        "all-reduce after it; 'auto' is allreduce with cuda_graphs, else ddp."))
    profile_steps: int = Field(0, ge=0, description=(
        "Record this many steps with torch's profiler into <run>/profile (opens in Perfetto) and log where the "
        "step time goes, and on a GPU what holds the memory at their peak; 0 is off."))
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Random seed of the data order, the noise and the adapter's initial weights.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Where to train; 'auto' uses a CUDA GPU if there is one."))
    log_every: int = Field(10, ge=1, description="Log the loss and speed every N steps.")
    # A state is the adapter, optimizer, schedule, RNG and data position: what a resume needs.
    save_every: int = Field(100, ge=0, description="Save the training state every N steps; 0 is off.")
    save_every_epochs: int = Field(0, ge=0, description=(
        "Save the training state every N epochs instead of every save_every steps (as kohya's "
        "save_every_n_epochs; `sdxl-lora export` writes a state's adapter); 0 is off."))
    save_every_minutes: float = Field(10.0, ge=0, description=(
        "Also save it every M minutes, whichever comes first; 0 is off."))
    keep_checkpoints: int = Field(3, ge=1, description="How many of the newest saved states are kept.")
    ema: bool = Field(False, description=(
        "Keep an exponential moving average of the adapter weights; the export and final previews use it."))
    ema_decay: float = Field(0.999, gt=0, lt=1, description=(
        "The EMA's decay per optimizer step; closer to 1 averages over more steps."))
    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, description=(
        "Dashboards that get the run's figures, previews and config: 'tensorboard' (<run>/tensorboard), 'wandb' "
        "(Weights & Biases in <run>/wandb, offline unless WANDB_MODE=online; the wandb extra)."))
    tensorboard: bool = Field(False, description=(
        "The same as 'tensorboard' in train.trackers (the older field)."))
    peak_tflops: float | None = Field(None, gt=0, description=(
        "Your GPU's dense bf16/fp16 peak in TFLOP/s, for the MFU figure; none looks the GPU up by name."))

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        # A config file or run folder written before a setting was removed still loads and resumes.
        if isinstance(data, dict) and REMOVED_TRAIN_FIELDS.keys() & data.keys():
            for name in sorted(REMOVED_TRAIN_FIELDS.keys() & data.keys()):
                log.warning("train.%s is gone and ignored: %s", name, REMOVED_TRAIN_FIELDS[name])
            data = {k: v for k, v in data.items() if k not in REMOVED_TRAIN_FIELDS}
        if isinstance(data, dict) and data.get("lora_matmul") == "concat":
            log.warning("train.lora_matmul='concat' is gone; the run trains with 'merged'")
            data = {**data, "lora_matmul": "merged"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_is_a_tracker(cls, data: Any) -> Any:
        # train.tensorboard, from before train.trackers, keeps meaning TensorBoard's event files.
        if isinstance(data, dict) and data.get("tensorboard") and "tensorboard" not in (data.get("trackers") or []):
            data = {**data, "trackers": [*(data.get("trackers") or []), "tensorboard"]}
        return data

    @model_validator(mode="after")
    def _timestep_range(self) -> "TrainConfig":
        if self.timestep_max is not None and self.timestep_max < self.timestep_min:
            raise ValueError(f"timestep_max={self.timestep_max} is below timestep_min={self.timestep_min}; "
                             "the range is [timestep_min, timestep_max]")
        return self



class PreviewConfig(Section):
    # The entry fields of .toml ([[prompt]] tables), .jsonl and .json files: docs/training.md.
    prompts: str | None = Field(None, json_schema_extra=SDXL_ONLY, description=(
        "Preview prompts, one a line with kohya's options (a cat --n blurry --w 1024 --s 30 --d 42), or a "
        ".toml/.jsonl/.json file; none: a few dataset captions (demo base: its own); empty: no previews."))
    every: int = Field(0, ge=0, description=(
        "Also preview, and compute the validation loss, every N steps; 0: only before and after."))
    every_epochs: int = Field(0, ge=0, description=(
        "Preview, and compute the validation loss, every N epochs instead of every N steps; 0 is off."))
    steps: int = Field(20, ge=1, json_schema_extra=SDXL_ONLY, description="Sampling steps of each preview image.")
    vae_tiling: bool = Field(False, json_schema_extra=SDXL_ONLY, description=(
        "Decode previews in tiles: far less memory at full size, faint seams possible. On by itself with a "
        "quantized base (model.quantize); train.vram_gb turns it on where the budget needs it."))
    guidance: float = Field(5.0, ge=0, json_schema_extra=SDXL_ONLY, description=(
        "Classifier-free guidance scale of the previews."))
    guidance_rescale: float | None = Field(None, ge=0, le=1, json_schema_extra=SDXL_ONLY, description=(
        "Classifier-free guidance rescale (Lin et al. 2023); none means 0.7 with train.zero_terminal_snr, else 0."))
    seed: int = Field(0, ge=0, le=2**32 - 1, json_schema_extra=SDXL_ONLY, description=(
        "Seed of the preview images; the same each time, so previews compare across steps."))
    before: bool = Field(True, description="Preview before training, as a baseline.")
    after: bool = Field(True, description="Preview at the end of training.")
    # A "concept" event per preview, over the prompts naming the concept: prompts naming none of its words
    # are not scored. The detector knows the demo base's shapes only, so the demo base asks for it (its
    # RECOMMENDED_SETTINGS file); other models score nothing unless the config says so.
    concept: str | None = Field(None, json_schema_extra=SDXL_ONLY, description=(
        "Score the previews for this concept with the shapes detector (shape and/or colour words, e.g. 'star'); "
        "none or empty is off (the demo base sets 'star')."))


class OutputConfig(Section):
    runs_dir: str = Field("runs", description="The folder that holds the runs.")
    name: str | None = Field(None, description="The run's folder name; none means a timestamped one.")
    overwrite: bool = Field(False, description="Replace an existing run of the same name.")


class LLMConfig(Section):
    """Fields of the causal-LM task only (`task = "llm"`, docs/llm.md); the other sections are shared."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True, json_schema_extra=LLM_ONLY)

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


class Config(Section):
    task: Literal["sdxl", "llm"] = Field("sdxl", description=(
        "Which task trains: the SDXL UNet, or a causal LM (`sdxl-lora llm train` sets 'llm')."))
    # Not adapter.preset (which layers get adapters): these fill other fields where the config is silent.
    card: Literal[tuple(presets.CARDS)] | None = Field(None, json_schema_extra=SDXL_ONLY, description=(
        "A card preset (--preset 8gb): the GPU memory budget of a card that size, the planner choosing what fits; "
        "-fast cards also compile. none: no preset. docs/training.md, Presets."))
    goal: Literal[tuple(presets.GOALS)] | None = Field(None, json_schema_extra=SDXL_ONLY, description=(
        "A goal preset (--preset style): rank, alpha, learning rate, layers and caption dropout for a character, "
        "a style or a concept, where the config sets none of them. docs/training.md, Presets."))
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

    @model_validator(mode="after")
    def _kind_fits_the_base(self) -> "Config":
        kind, quant = self.adapter.kind, self.model.quantize
        # peft sizes LoHa/LoKr factors from the weight's shape, which a packed 4-bit weight does not have; its
        # DoRA reads an LLM.int8 or fp8 weight's raw storage as the norm of the weight.
        if kind in ("loha", "lokr") and quant in ("nf4", "fp4"):
            raise ValueError(f"adapter.kind={kind!r} does not train over a 4-bit base (model.quantize={quant!r}): "
                             "use model.quantize='int8' or 'fp8', or kind='lora' / 'dora'")
        if kind == "dora" and quant in ("int8", "fp8"):
            raise ValueError(f"adapter.kind='dora' needs the base weight's norm, which peft cannot read from "
                             f"model.quantize={quant!r}: use model.quantize='nf4' or 'fp4', or kind='lora'")
        if kind == "dora" and self.model.quantize_convs == "fp8" and self.adapter.preset == "locon":
            raise ValueError("adapter.kind='dora' with preset='locon' needs the convolutions' weight norms, which "
                             "peft cannot read from model.quantize_convs='fp8': set quantize_convs='none'")
        init = self.adapter.init
        if init == "loftq" and quant not in ("nf4", "fp4"):
            raise ValueError(f"adapter.init='loftq' starts the adapter from the error of a 4-bit base, and "
                             f"model.quantize={quant!r}: set model.quantize='nf4' (or 'fp4'), or use adapter.init="
                             "'pissa' / 'olora' on an unquantized base")
        if init in ("pissa", "olora") and quant != "none":
            raise ValueError(f"adapter.init={init!r} moves part of each weight into the adapter, which a quantized "
                             f"base (model.quantize={quant!r}) cannot give back: use adapter.init='loftq' with a "
                             "4-bit base, or model.quantize='none'")
        if init != "default" and self.task != "llm":
            raise ValueError(f"adapter.init={init!r} is for task='llm' (its PEFT export converts it back to a plain "
                             "LoRA); SDXL adapters use adapter.init='default'")
        if self.train.loraplus_ratio and kind not in ("lora", "dora"):
            raise ValueError(f"train.loraplus_ratio={self.train.loraplus_ratio:g} gives LoRA's B matrix a larger "
                             f"learning rate; adapter.kind={kind!r} has no B: leave it unset")
        return self

    def in_epochs(self, steps_per_epoch: int) -> "Config":
        """The config with train.epochs, save_every_epochs and preview.every_epochs turned into steps, at
        `steps_per_epoch` optimizer steps an epoch; unchanged where none is set."""
        tc, pc = self.train, self.preview
        train, preview = {}, {}
        if tc.epochs:
            train["steps"] = tc.epochs * steps_per_epoch
        if tc.save_every_epochs:
            train["save_every"] = tc.save_every_epochs * steps_per_epoch
        if pc.every_epochs:
            preview["every"] = pc.every_epochs * steps_per_epoch
        if not (train or preview):
            return self
        return self.model_copy(update={"train": tc.model_copy(update=train),
                                       "preview": pc.model_copy(update=preview)})

    def cache_root(self) -> Path:
        """Where a run's caches live (latents, text embeddings, class images, records of its step): data.cache_dir,
        else .cache in the runs folder."""
        return Path(self.data.cache_dir) if self.data.cache_dir else Path(self.output.runs_dir) / ".cache"

    def settings_key(self, train_fields: tuple[str, ...], versions: dict[str, str]) -> str:
        """A short hash of what a run's step depends on: the model, adapter and data sections, the named train.*
        fields and `versions` (a library's, say); the name of a cache entry that holds for runs like this one."""
        import hashlib
        import json

        what = {**versions, "model": self.model.model_dump(mode="json"),
                "adapter": self.adapter.model_dump(mode="json"), "data": self.data.model_dump(mode="json"),
                "train": {k: getattr(self.train, k) for k in train_fields}}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def to_toml(self, leave_unset: tuple[str, ...] = ()) -> str:
        """The config as TOML, without the fields that do nothing for its task: the file is read again (a run's
        config.toml on resume, a run the UI queued), where every field in it counts as the user's setting.
        leave_unset: dotted fields left out where this config did not set them (a run decides them)."""
        tree = self.model_dump(mode="json")
        for name, info in type(self).model_fields.items():
            if isinstance(tree[name], dict):
                section = getattr(self, name)
                for f in info.annotation.model_fields:
                    if self.task not in field_tasks(info.annotation, f) or (
                            f"{name}.{f}" in leave_unset and f not in section.model_fields_set):
                        del tree[name][f]
        return tomli_w.dumps(_drop_none({k: v for k, v in tree.items() if v != {}}))


TASKS: tuple[str, ...] = get_args(Config.model_fields["task"].annotation)
ADAPTER_KINDS: tuple[str, ...] = get_args(AdapterConfig.model_fields["kind"].annotation)


def field_tasks(section: type[BaseModel], name: str) -> tuple[str, ...]:
    """The tasks that field `name` of `section` does something for: its "tasks" mark, else its section's,
    else every task."""
    for marks in (section.model_fields[name].json_schema_extra, section.model_config.get("json_schema_extra")):
        if isinstance(marks, dict) and "tasks" in marks:
            return tuple(marks["tasks"])
    return TASKS


def fields_for_other_tasks(cfg: Config) -> list[str]:
    """The fields `cfg` sets explicitly (in a config file, by --set or from the form) that do nothing for
    cfg.task, as dotted names, e.g. ["train.fuse_qkv"] for an LLM run. Fields left at their defaults never count."""
    out = []
    for name, info in Config.model_fields.items():
        section = getattr(cfg, name)
        if isinstance(section, Section):
            out += [f"{name}.{f}" for f in info.annotation.model_fields
                    if f in section.model_fields_set and cfg.task not in field_tasks(info.annotation, f)]
    return out


def _drop_none(d: Any) -> Any:
    # TOML has no null; a missing key means "default", which is what None means here.
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    if isinstance(d, list):
        return [_drop_none(v) for v in d]
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
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
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
    from typing import get_origin

    model: type[BaseModel] = Config
    for p in loc:
        if isinstance(p, int):
            continue  # a position in a list of tables (data.datasets[1]): the table's own model
        f = model.model_fields.get(str(p))
        annotation = f.annotation if f is not None else None
        if get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


class TOMLError(ValueError):
    """A TOML document does not parse; the message says where and, for a key set twice, which key."""


_TOML_AT = re.compile(r"\(at line (\d+), column \d+\)|\(at end of document\)")
_TOML_TABLE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_TOML_KEY = re.compile(r"^\s*([^=#\[]+?)\s*=")


def parse_toml(text: str) -> dict:
    """The TOML document `text`. A UTF-8 byte-order mark before it is dropped: editors on Windows write one, and
    tomllib takes it for the start of a statement. TOMLError where it does not parse, naming the key set twice
    where that is why (tomllib names the line only)."""
    try:
        return tomllib.loads(text.removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError as e:
        raise TOMLError(_toml_problem(str(e), text.removeprefix("\ufeff"))) from None


def _toml_problem(message: str, text: str) -> str:
    """tomllib's `message` about `text`, with the key or table it means by position only named."""
    at = _TOML_AT.search(message)
    lines = text.splitlines()
    if at is None or not lines:
        return message
    n = int(at.group(1)) if at.group(1) else max(i for i, line in enumerate(lines, 1) if line.strip())
    declared = re.match(r"Cannot declare \((.*)\) twice", message)
    if declared:
        table = ".".join(part.strip(" '\"") for part in declared.group(1).split(",") if part.strip())
        return f"table [{table}] is declared twice (the second time at line {n}); merge the two into one"
    key = _TOML_KEY.match(lines[n - 1]) if message.startswith("Cannot overwrite a value") else None
    if key is None:
        return message
    table = next((m.group(1) for line in reversed(lines[:n - 1]) if (m := _TOML_TABLE.match(line))), None)
    dotted = ".".join(filter(None, (table, key.group(1))))
    full = re.sub(r"\s*\.\s*", ".", dotted).replace('"', "").replace("'", "")
    return f"{full} is set twice (the second time at line {n}); keep one of them"


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
            tree = parse_toml(p.read_text(encoding="utf-8"))
        except TOMLError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                              "save it as UTF-8 TOML") from None
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
        recommended = _without_linked(recommended, set(_dotted_keys(tree)))
        applied = sorted(set(_dotted_keys(recommended)) - set(_dotted_keys(tree)))
        if applied:
            import logging

            logging.getLogger(__name__).info("%s: the model's recommended settings apply where the config is "
                                             "silent: %s", rec_path, ", ".join(applied))
            source = f"{source} + {rec_path}"
        tree = _merged(recommended, tree)
    preset, named = preset_settings(tree)
    if preset:
        import logging

        applied = sorted(set(_dotted_keys(preset)) - set(_dotted_keys(tree)))
        kept = sorted(set(_dotted_keys(preset)) & set(_dotted_keys(tree)))
        logging.getLogger(__name__).info("preset %s sets %s%s", named, ", ".join(
            f"{k}={preset_value(preset, k)!r}" for k in applied) or "nothing",
            f"; kept as the config or the model's recommended settings set them: {', '.join(kept)}" if kept else "")
        source = f"{source} + preset {named}"
        tree = _merged(preset, tree)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source), e.errors()) from None


def preset_settings(tree: dict) -> tuple[dict, str]:
    """The settings tree of the card and goal presets a (not yet validated) config tree names, and their names
    as the log says them ("card 8gb + goal style"); ({}, "") when it names none. Raises ConfigError for an
    unknown name (listing the choices) or a preset on the LLM task."""
    card, goal = tree.get("card"), tree.get("goal")
    if card is None and goal is None:
        return {}, ""
    if tree.get("task", "sdxl") != "sdxl":
        raise ConfigError(f"card={card!r}, goal={goal!r}: presets are for the SDXL task; leave card and goal unset "
                          "for task='llm'")
    try:
        flat = presets.settings(*(None if v is None else str(v) for v in (card, goal)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out: dict = {}
    for key, value in flat.items():
        _set_dotted(out, key, value)
    return out, " + ".join(f"{k} {v}" for k, v in (("card", card), ("goal", goal)) if v is not None)


def preset_value(tree: dict, dotted: str, default: Any = None) -> Any:
    """The value at a dotted key of a settings tree, or `default` where the tree does not set it."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _read_recommended(tree: dict) -> tuple[dict, dict, Path | None]:
    """The RECOMMENDED_SETTINGS file of the model a (not yet validated) config tree names, parsed into its
    general settings and its [kind.<kind>.*] ones: ({}, {}, None) when the model folder has none, or the task
    is not SDXL."""
    if tree.get("task", "sdxl") != "sdxl":
        return {}, {}, None
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    name = str(model.get("path", ModelConfig.model_fields["path"].default))
    folder = DEMO_DIR if name == DEMO_NAME else Path(name).expanduser()
    path = folder / RECOMMENDED_SETTINGS
    if not path.is_file():
        return {}, {}, None
    try:
        rec = parse_toml(path.read_text(encoding="utf-8"))
    except TOMLError as e:
        raise ConfigError(f"{path} (the model's recommended training settings) is not valid TOML: {e}; fix or "
                          "remove it") from None
    sections = {"data", "adapter", "train", "preview"}
    bad = sorted(set(rec) - sections - {"kind"})
    if bad:
        raise ConfigError(f"{path}: a model's recommended settings may hold [data], [adapter], [train], "
                          f"[preview] and [kind.<adapter kind>.*] only, not {', '.join(bad)}; fix or remove the file")
    # [kind.loha.train] and the like: settings for one adapter kind (a learning rate LoHa or LoKr needs),
    # over the rest where the run trains that kind.
    by_kind = rec.pop("kind", {})
    bad = ["kind"] if not isinstance(by_kind, dict) else [
        f"kind.{kind}" for kind, settings in by_kind.items()
        if kind not in ADAPTER_KINDS or not isinstance(settings, dict) or set(settings) - sections]
    if bad:
        raise ConfigError(f"{path}: [{'], ['.join(bad)}] must name an adapter kind ({', '.join(ADAPTER_KINDS)}) "
                          "and hold [data], [adapter], [train] or [preview] tables; fix or remove it")
    return rec, by_kind, path


def _for_kind(rec: dict, by_kind: dict, kind: str) -> dict:
    return _merged(rec, by_kind[kind]) if kind in by_kind else rec


def recommended_settings(tree: dict) -> tuple[dict, Path | None]:
    """The model's recommended settings for the run a config tree describes (its adapter kind's over the
    general ones), and the file they came from: ({}, None) when there is none."""
    rec, by_kind, path = _read_recommended(tree)
    adapter = tree.get("adapter") if isinstance(tree.get("adapter"), dict) else {}
    kind = adapter.get("kind", rec.get("adapter", {}).get("kind", AdapterConfig.model_fields["kind"].default))
    return _for_kind(rec, by_kind, kind), path


def kind_recommendations(model_path: str) -> dict[str, dict[str, Any]]:
    """For a model whose recommended settings hold [kind.<kind>.*] sections: each adapter kind's value of
    every field some kind section sets (the kind's own, else the model's general recommendation, else the
    schema's default), so a form can follow a change of kind. {} when no kind has settings of its own."""
    rec, by_kind, _ = _read_recommended({"model": {"path": model_path}})
    keys = sorted({k for settings in by_kind.values() for k in _dotted_keys(settings)})

    def default(key: str) -> Any:
        section, name = key.split(".", 1)
        return Config.model_fields[section].annotation.model_fields[name].default

    return {kind: {k: preset_value(_for_kind(rec, by_kind, kind), k, default(k)) for k in keys}
            for kind in ADAPTER_KINDS} if keys else {}


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


# Fields that only make sense together: a model's recommended value of one is left out where the config sets
# another of its group (a timestep range the user chose is theirs whole, the base's bound would not fit it).
LINKED_FIELDS = (("train.timestep_min", "train.timestep_max"),)


def _without_linked(recommended: dict, set_keys: set[str]) -> dict:
    """`recommended` less the fields whose linked group (LINKED_FIELDS) the config sets any of."""
    drop = {k for group in LINKED_FIELDS if set_keys & set(group) for k in group}
    out = {}
    for section, fields in recommended.items():
        kept = {f: v for f, v in fields.items() if f"{section}.{f}" not in drop} if isinstance(fields, dict) else fields
        if kept or not isinstance(fields, dict):
            out[section] = kept
    return out


def _merged(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (a field set in `top` wins whole)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = (_merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict)
                  and k not in _table_fields() else v)
    return out
