"""SDXL's settings: its sections over the core's (sdxl_lora/core/config.py), the fields only the SDXL task reads
(the image data, the diffusion loss, the UNet's speed levers, the previews' sampling), the card and goal presets
and a model's recommended settings, applied where the config is silent. core.config.load_config returns an
SDXLConfig for task = "sdxl"; the TOML keys are the same as in one schema.
"""
from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ..core import config as core
from . import presets
from ..core.config import (ADAPTER_KINDS, SAMPLE_DATA, ConfigError, Section, TOMLError, _set_dotted, parse_toml,
                           preset_value)

log = logging.getLogger(__name__)

# The shipped demo base (model.path = "tiny-sdxl-demo"): the tiny SDXL pretrained on shapes, SDXL's default model.
DEMO_NAME = "tiny-sdxl-demo"
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / DEMO_NAME
TINY_NAME = "tiny-sdxl"  # the same build with random weights (sdxl/demo/tiny.py)

# A model folder may hold the training settings it is meant to be trained with (TOML sections as in a
# config, no [model]): they apply wherever the user's config is silent. A 9M-parameter base wants other
# settings than SDXL's 2.6B; the demo base ships one (docs/demo_base.md).
RECOMMENDED_SETTINGS = "sdxl_lora.toml"

_EXTENSION = re.compile(r"\.[A-Za-z0-9_.-]{1,32}")


class ModelConfig(core.ModelConfig):
    """SDXL's [model]: the core's fields, the tokenizers of a single file, the UNet's prediction, its storage."""
    path: str = Field(DEMO_NAME, description=(
        "Base model: 'tiny-sdxl-demo' (the shipped demo), 'tiny-sdxl' (random weights), a diffusers SDXL folder or "
        "a single-file .safetensors."))
    tokenizer: str | None = Field(None, description=(
        "Folder holding tokenizer/ and tokenizer_2/, for single-file checkpoints (they carry none)."))
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field("auto", description=(
        "What the UNet predicts; 'auto' reads the model's scheduler config."))
    quantize_convs: Literal["none", "fp8"] = Field("none", description=(
        "Also keep the frozen UNet's convolutions (not conv_in/conv_out) in fp8: less memory, fp8's rounding "
        "error; works with any model.quantize."))
    tiled_vae_encode: bool = Field(False, description=(
        "Encode images in tiles when caching latents: far less memory at full size; the latents differ slightly "
        "near tile seams. train.vram_gb turns it on where the budget needs it."))

    @field_validator("path")
    @classmethod
    def _embedded(cls, v: str) -> str:
        return v or DEMO_NAME  # empty means the task's embedded default (core.ModelConfig.path)


class DataConfig(Section):
    """The image dataset ([data]; the LLM task reads llm.data)."""
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


class AdapterConfig(core.AdapterConfig):
    """SDXL's [adapter]: the core's fields, the convolutions' rank, the rank schedule, the text encoders."""
    # A convolution's update sees 9x more inputs per output than a projection's; LyCORIS' conv_dim/conv_alpha.
    conv_rank: int | None = Field(None, ge=1, le=1024, description=(
        "The rank of the convolution layers the plan adapts (preset locon, or overrides naming convs), scaled "
        "with resolution as rank is; none means adapter.rank."))
    conv_alpha: float | None = Field(None, gt=0, description=(
        "The convolutions' alpha; none keeps the alpha/rank ratio of adapter.alpha."))
    scale_rank_with_resolution: bool = Field(True, description=(
        "Scale the rank by sqrt(resolution / native resolution), rounded and kept in [min_rank, max_rank]."))
    # Every slot shrinks in proportion to its planned rank, by SVD truncation of its update; the optimizer's
    # moments of a shrunk adapter restart from zero.
    rank_schedule: dict[int, int] = Field(default_factory=dict, description=(
        "{step = base rank}: at each step the adapters shrink to that rank, e.g. rank = 64 with {200 = 16}; "
        "the export has the final ranks."))
    train_text_encoder: bool = Field(False, description=(
        "LoRA on both text encoders' attention too (at train.text_encoder_lr); text embeddings are then "
        "computed each step, not cached."))
    text_encoder_rank: int | None = Field(None, ge=1, le=1024, description=(
        "The text encoders' rank; none means adapter.rank."))

    @field_validator("rank_schedule")
    @classmethod
    def _schedule(cls, v: dict[int, int]) -> dict[int, int]:
        bad = {k: r for k, r in v.items() if k < 1 or r < 1}
        if bad:
            raise ValueError(f"steps and ranks must be at least 1, got {bad}; e.g. {{200 = 16}}")
        return dict(sorted(v.items()))

    @model_validator(mode="after")
    def _schedule_needs_lora(self) -> "AdapterConfig":
        # The schedule cuts ranks by an SVD of LoRA's B x A.
        if self.kind in ("loha", "lokr") and self.rank_schedule:
            raise ValueError(f"adapter.rank_schedule={self.rank_schedule!r} is for lora and dora (an SVD of LoRA's "
                             f"B x A), not adapter.kind={self.kind!r}: leave it unset or use kind='lora' or 'dora'")
        return self


class TrainConfig(core.TrainConfig):
    """SDXL's [train]: the core's fields, the diffusion loss and timesteps, the UNet's levers."""
    unet_lr: float | None = Field(None, gt=0, description=(
        "Learning rate of the UNet's adapters; none means train.lr."))
    text_encoder_lr: float | None = Field(None, gt=0, description=(
        "Learning rate of the text encoders' adapters; none means train.lr."))
    lr_multipliers: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict, description=(
        "Per-layer lr factors: glob on a UNet module path or kohya block id -> multiplier; the last match wins. "
        "E.g. {\"OUT0[0-2]\" = 0.5}."))
    # The losses and their weighting: docs/training.md.
    loss: Literal["l2", "huber"] = Field("l2", description=(
        "The diffusion loss: l2 is the usual MSE; huber is quadratic within huber_delta of the target and "
        "linear beyond, so outliers pull less."))
    huber_delta: float = Field(1.0, gt=0, description=(
        "huber: the distance where the loss turns from quadratic to linear."))
    prior_loss_weight: float = Field(1.0, ge=0, description=(
        "Regularization images (a dataset with is_regularization): each one's loss is multiplied by this, as "
        "kohya does; 0 leaves them out of the loss."))
    prior_prediction: bool = Field(False, description=(
        "Regularization images learn the base model's own prediction (the adapter off) instead of their noise, as "
        "OneTrainer's prior prediction: the images need not be good, only their captions matter."))
    noise_offset: float = Field(0.0, ge=0, description=(
        "Adds offset x N(0,1) per image and channel to the noise; ~0.05-0.1 helps very dark or bright images. "
        "0 is off."))
    min_snr_gamma: float = Field(0.0, ge=0, description=(
        "Min-SNR-gamma loss weighting (5 is the paper's value); 0 is off."))
    debiased_estimation: bool = Field(False, description=(
        "Weight each image's loss by 1/sqrt(SNR) (v-prediction: 1/(SNR+1)), debiased estimation as kohya offers it; "
        "with min_snr_gamma both weights apply."))
    multires_noise_iterations: int = Field(0, ge=0, le=20, description=(
        "Multi-resolution noise: adds this many coarser noise levels, so the model learns overall colour and layout "
        "(6-10 are usual); 0 is off."))
    multires_noise_discount: float = Field(0.3, gt=0, le=1, description=(
        "With multires_noise_iterations: level i of the coarser noise is weighted by this to the power i."))
    ip_noise_gamma: float = Field(0.0, ge=0, description=(
        "Input perturbation: the model sees latents noised with noise + gamma x N(0,1) while it predicts the noise, "
        "against exposure bias (0.1 is the paper's value); 0 is off."))
    zero_terminal_snr: bool = Field(False, description=(
        "Rescale the noise schedule to zero terminal SNR (pairs with v-prediction models)."))
    timestep_min: int = Field(0, ge=0, description=(
        "The lowest timestep trained on (timesteps are drawn uniformly in the range)."))
    timestep_max: int | None = Field(None, ge=0, description=(
        "The highest timestep trained on; none means the schedule's last."))
    checkpoint_budget_gb: float | None = Field(None, gt=0, description=(
        "A memory budget in GiB (activations and weights): only as many blocks are checkpointed as it takes "
        "to fit."))
    # With compile="regional" the ResNets' surroundings and backward keep that layout too.
    channels_last: bool = Field(False, description=(
        "Run the UNet's convolutions in channels-last (NHWC) memory layout."))
    fuse_qkv: bool = Field(True, description=(
        "Compute each attention's q/k/v projections and their LoRA in one matmul instead of three: the same "
        "loss and gradients, fewer kernels."))
    fused_geglu: bool = Field(True, description=(
        "CUDA: the feed-forward's GEGLU backward as one Triton kernel that reads each input once (the same "
        "gradients)."))
    # "merged" rounds the summed weight once to bf16, which stays as close to fp32 as peft's products (tested),
    # and gives A and B peft's gradients. Projections with fewer tokens than the weight's input width keep
    # peft's products (the weight-sized copy would cost more than it saves); quantized bases take "merged"
    # dequantized per call.
    lora_matmul: Literal["peft", "merged"] = Field("merged", description=(
        "With fuse_qkv: how the attention projections' LoRA is computed. 'merged': x @ (W + sBA)^T; "
        "'peft': peft's own products."))
    # On SDXL's attention shapes torch's own choice already runs cuDNN's kernel, the fastest (docs/speed.md).
    sdpa_backend: Literal["default", "cudnn", "flash", "efficient", "math"] = Field(
        "default", description=(
            "The attention kernel of the training forward: 'default' lets PyTorch choose; a named one is used "
            "alone (cudnn and efficient need CUDA)."))

    @model_validator(mode="before")
    @classmethod
    def _concat_is_merged(cls, data: Any) -> Any:
        # A run folder from before 'concat' was removed still loads and resumes.
        if isinstance(data, dict) and data.get("lora_matmul") == "concat":
            log.warning("train.lora_matmul='concat' is gone; the run trains with 'merged'")
            data = {**data, "lora_matmul": "merged"}
        return data

    @model_validator(mode="after")
    def _timestep_range(self) -> "TrainConfig":
        if self.timestep_max is not None and self.timestep_max < self.timestep_min:
            raise ValueError(f"timestep_max={self.timestep_max} is below timestep_min={self.timestep_min}; "
                             "the range is [timestep_min, timestep_max]")
        return self


class PreviewConfig(core.PreviewConfig):
    """SDXL's [preview]: the core's fields and how the preview images are sampled."""
    # The entry fields of .toml ([[prompt]] tables), .jsonl and .json files: docs/training.md.
    prompts: str | None = Field(None, description=(
        "Preview prompts, one a line with kohya's options (a cat --n blurry --w 1024 --s 30 --d 42), or a "
        ".toml/.jsonl/.json file; none: a few dataset captions (demo base: its own); empty: no previews."))
    steps: int = Field(20, ge=1, description="Sampling steps of each preview image.")
    vae_tiling: bool = Field(False, description=(
        "Decode previews in tiles: far less memory at full size, faint seams possible. On by itself with a "
        "quantized base (model.quantize); train.vram_gb turns it on where the budget needs it."))
    guidance: float = Field(5.0, ge=0, description=(
        "Classifier-free guidance scale of the previews."))
    guidance_rescale: float | None = Field(None, ge=0, le=1, description=(
        "Classifier-free guidance rescale (Lin et al. 2023); none means 0.7 with train.zero_terminal_snr, else 0."))
    seed: int = Field(0, ge=0, le=2**32 - 1, description=(
        "Seed of the preview images; the same each time, so previews compare across steps."))
    # A "concept" event per preview, over the prompts naming the concept: prompts naming none of its words
    # are not scored. The detector knows the demo base's shapes only, so the demo base asks for it (its
    # RECOMMENDED_SETTINGS file); other models score nothing unless the config says so.
    concept: str | None = Field(None, description=(
        "Score the previews for this concept with the shapes detector (shape and/or colour words, e.g. 'star'); "
        "none or empty is off (the demo base sets 'star')."))


class SDXLConfig(core.Config):
    """A config of the SDXL task: the core's sections with SDXL's fields, its [data], the card and goal presets."""
    task: Literal["sdxl"] = Field("sdxl", description=core.Config.model_fields["task"].description)
    # Not adapter.preset (which layers get adapters): these fill other fields where the config is silent.
    card: Literal[tuple(presets.CARDS)] | None = Field(None, description=(
        "A card preset (--preset 8gb): the GPU memory budget of a card that size, the planner choosing what fits; "
        "-fast cards also compile. none: no preset. docs/training.md, Presets."))
    goal: Literal[tuple(presets.GOALS)] | None = Field(None, description=(
        "A goal preset (--preset style): rank, alpha, learning rate, layers and caption dropout for a character, "
        "a style or a concept, where the config sets none of them. docs/training.md, Presets."))
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    preview: PreviewConfig = Field(default_factory=PreviewConfig)

    @classmethod
    def settings_over(cls, tree: dict, source: str) -> tuple[dict, str]:
        """The model's recommended settings, then the card and goal presets, where the config is silent."""
        recommended, rec_path = recommended_settings(tree)
        if recommended:
            recommended = _without_linked(recommended, set(_dotted_keys(tree)))
            applied = sorted(set(_dotted_keys(recommended)) - set(_dotted_keys(tree)))
            if applied:
                log.info("%s: the model's recommended settings apply where the config is silent: %s", rec_path,
                         ", ".join(applied))
                source = f"{source} + {rec_path}"
            tree = _merged(recommended, tree)
        preset, named = preset_settings(tree)
        if preset:
            applied = sorted(set(_dotted_keys(preset)) - set(_dotted_keys(tree)))
            kept = sorted(set(_dotted_keys(preset)) & set(_dotted_keys(tree)))
            log.info("preset %s sets %s%s", named, ", ".join(
                f"{k}={preset_value(preset, k)!r}" for k in applied) or "nothing",
                f"; kept as the config or the model's recommended settings set them: {', '.join(kept)}" if kept else "")
            source = f"{source} + preset {named}"
            tree = _merged(preset, tree)
        return tree, source

    @model_validator(mode="after")
    def _convs_keep_their_norms(self) -> "SDXLConfig":
        if self.adapter.kind == "dora" and self.model.quantize_convs == "fp8" and self.adapter.preset == "locon":
            raise ValueError("adapter.kind='dora' with preset='locon' needs the convolutions' weight norms, which "
                             "peft cannot read from model.quantize_convs='fp8': set quantize_convs='none'")
        return self

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


def preset_settings(tree: dict) -> tuple[dict, str]:
    """The settings tree of the card and goal presets a (not yet validated) config tree names, and their names
    as the log says them ("card 8gb + goal style"); ({}, "") when it names none. Raises ConfigError for an
    unknown name (listing the choices)."""
    card, goal = tree.get("card"), tree.get("goal")
    if card is None and goal is None:
        return {}, ""
    try:
        flat = presets.settings(*(None if v is None else str(v) for v in (card, goal)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out: dict = {}
    for key, value in flat.items():
        _set_dotted(out, key, value)
    return out, " + ".join(f"{k} {v}" for k, v in (("card", card), ("goal", goal)) if v is not None)




def _read_recommended(tree: dict) -> tuple[dict, dict, Path | None]:
    """The RECOMMENDED_SETTINGS file of the model a (not yet validated) config tree names, parsed into its
    general settings and its [kind.<kind>.*] ones: ({}, {}, None) when the model folder has none."""
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    name = str(model.get("path") or DEMO_NAME)  # unset or empty: the demo base (ModelConfig.path)
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
        return SDXLConfig.model_fields[section].annotation.model_fields[name].default

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
