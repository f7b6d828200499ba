"""The config schema every task shares: the sections and fields each task reads (model, adapter, train, preview,
output), their defaults, and how a config is read: a TOML file, `--set section.key=value` overrides, a task's
own settings. Errors name the field, the bad value and what is allowed.

A task's own fields live with the task, in subclasses of these sections and of Config: SDXL's in
sdxl_lora/sdxl/config.py (its data, diffusion loss, UNet levers, card and goal presets, a model's recommended
settings), the causal LM's in sdxl_lora/llm/config.py. load_config returns the class of the config's `task`
(TASK_CONFIGS); the CLI, UI and launch scripts only override what it holds.
"""
from __future__ import annotations

import functools
import importlib
import logging
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO_ROOT / "sample_data"

# Each task's config class, "module:Class", as an entry-point table names a plugin. The core names a task's
# config by this string and imports it (importlib, no import statement) only when a config of that task is
# read: the tasks build on the core, never the other way round (tests/core/test_layering.py).
TASK_CONFIGS = {"sdxl": "sdxl_lora.sdxl.config:SDXLConfig", "llm": "sdxl_lora.llm.config:CausalLMConfig"}
TASKS: tuple[str, ...] = tuple(TASK_CONFIGS)


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


class ModelConfig(Section):
    # Each task's ModelConfig overrides the default with its own embedded model and says what it takes.
    path: str = Field("", description="Base model; empty: the task's own embedded default model.")
    cache_dir: str = Field(str(REPO_ROOT / ".cache" / "models"), description=(
        "Where the built-in tiny models are written out (once) as model folders."))
    # QLoRA (docs/qlora.md): the adapter itself always trains in full precision.
    quantize: Literal["none", "nf4", "fp4", "int8", "fp8"] = Field("none", description=(
        "QLoRA: keep the frozen base's Linear layers quantized to save memory; nf4/fp4/int8 need bitsandbytes "
        "(the qlora extra), fp8 only torch."))
    quant_double: bool = Field(True, description="nf4/fp4: quantize the block scales too (a little less memory).")
    quant_compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description=(
        "The dtype quantized layers compute in; 'auto' follows train.mixed_precision (fp32 when 'no')."))


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
    rslora: bool = Field(False, description=(
        "rsLoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank, every layer with the same alpha, "
        "so high ranks keep learning (lora and dora); exports carry the equivalent alpha."))
    lokr_factor: int | None = Field(None, ge=1, description=(
        "lokr: the size of the Kronecker product's small factor; none: as close to the square root of each "
        "dimension as it divides."))
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")
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

    @model_validator(mode="after")
    def _kind_options(self) -> "AdapterConfig":
        # What peft's LoHa/LoKr layers do not have.
        if self.kind in ("loha", "lokr"):
            for name, value, why in (
                    ("lora_bias", self.lora_bias, "a bias on B, which LoHa/LoKr have not"),
                    ("dropout", self.dropout, "dropout on LoRA's input, which peft's LoHa/LoKr layers have not"),
                    ("rslora", self.rslora, "LoRA's alpha / sqrt(rank) rule")):
                if value:
                    raise ValueError(f"adapter.{name}={value!r} is for lora and dora ({why}), not "
                                     f"adapter.kind={self.kind!r}: leave it unset or use kind='lora' or 'dora'")
        if self.kind == "dora" and self.lora_bias:
            raise ValueError("adapter.lora_bias=True with adapter.kind='dora': peft's DoRA layers have no LoRA "
                             "bias; use kind='lora' or lora_bias=false")
        return self


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
    # LoRA+ (Hayou et al. 2024): B starts at zero and needs a larger step than A; B's group is peft's (B's
    # matrices, biases and DoRA's magnitudes: core/optim.py).
    loraplus_ratio: float | None = Field(None, ge=1, description=(
        "LoRA+: the learning rate of each adapter's B (up) matrix is this multiple of A's, e.g. 16; lora and "
        "dora only. None: one learning rate."))
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
        return data

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_is_a_tracker(cls, data: Any) -> Any:
        # train.tensorboard, from before train.trackers, keeps meaning TensorBoard's event files.
        if isinstance(data, dict) and data.get("tensorboard") and "tensorboard" not in (data.get("trackers") or []):
            data = {**data, "trackers": [*(data.get("trackers") or []), "tensorboard"]}
        return data


class PreviewConfig(Section):
    every: int = Field(0, ge=0, description=(
        "Also preview, and compute the validation loss, every N steps; 0: only before and after."))
    every_epochs: int = Field(0, ge=0, description=(
        "Preview, and compute the validation loss, every N epochs instead of every N steps; 0 is off."))
    before: bool = Field(True, description="Preview before training, as a baseline.")
    after: bool = Field(True, description="Preview at the end of training.")


class OutputConfig(Section):
    runs_dir: str = Field("runs", description="The folder that holds the runs.")
    name: str | None = Field(None, description="The run's folder name; none means a timestamped one.")
    overwrite: bool = Field(False, description="Replace an existing run of the same name.")


def kind_refuses_base(kind: str, quant: str) -> str | None:
    """Why an adapter of `kind` cannot train over a base stored as `quant`, or None; a memory planner choosing the
    base's storage asks it too. peft sizes LoHa/LoKr factors from the weight's shape, which a packed 4-bit weight
    does not have; its DoRA reads an LLM.int8 or fp8 weight's raw storage as the norm of the weight."""
    if kind in ("loha", "lokr") and quant in ("nf4", "fp4"):
        return (f"adapter.kind={kind!r} does not train over a 4-bit base (model.quantize={quant!r}): "
                "use model.quantize='int8' or 'fp8', or kind='lora' / 'dora'")
    if kind == "dora" and quant in ("int8", "fp8"):
        return (f"adapter.kind='dora' needs the base weight's norm, which peft cannot read from "
                f"model.quantize={quant!r}: use model.quantize='nf4' or 'fp4', or kind='lora'")
    return None


class Config(Section):
    """The sections every task reads. A task's config (TASK_CONFIGS) subclasses it, and its sections these."""
    task: Literal[TASKS] = Field("sdxl", description=(
        "Which task trains: the SDXL UNet, or a causal LM (`sdxl-lora llm train` sets 'llm')."))
    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    preview: PreviewConfig = Field(default_factory=PreviewConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @classmethod
    def settings_over(cls, tree: dict, source: str) -> tuple[dict, str]:
        """The (not yet validated) config tree with the settings the task adds where the config is silent (SDXL:
        the model's recommended settings, the card and goal presets), and the source naming them; the core adds
        nothing."""
        return tree, source

    @model_validator(mode="after")
    def _kind_fits_the_base(self) -> "Config":
        kind = self.adapter.kind
        if why := kind_refuses_base(kind, self.model.quantize):
            raise ValueError(why)
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

    def to_toml(self, leave_unset: tuple[str, ...] = ()) -> str:
        """The config as TOML, read again where it is saved (a run's config.toml on resume, a run the UI
        queued), where every field in it counts as the user's setting. leave_unset: dotted fields left out where
        this config did not set them (a run decides them)."""
        tree = self.model_dump(mode="json")
        for key in leave_unset:
            name, f = key.split(".", 1)
            section = getattr(self, name, None)
            if isinstance(section, Section) and f in tree[name] and f not in section.model_fields_set:
                del tree[name][f]
        return tomli_w.dumps(_drop_none({k: v for k, v in tree.items() if v != {}}))


ADAPTER_KINDS: tuple[str, ...] = get_args(AdapterConfig.model_fields["kind"].annotation)


@functools.cache
def config_class(task: str) -> type[Config]:
    """The config class of `task` (TASK_CONFIGS), its module imported on first use."""
    module, _, name = TASK_CONFIGS[task].partition(":")
    return getattr(importlib.import_module(module), name)


def task_keys(task: str) -> frozenset[str]:
    """The dotted keys a config of `task` takes: its top-level fields and every section's fields."""
    return frozenset(_field_keys(config_class(task)))


def _field_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        out.append(f"{prefix}{name}")
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) and not prefix:
            out += _field_keys(f.annotation, f"{name}.")
    return out


def field_tasks(section: type[BaseModel], name: str) -> tuple[str, ...]:
    """The tasks whose config has field `name` in `section` (a section of any task's config, or a Config)."""
    def same(model: type[BaseModel]) -> bool:
        return issubclass(model, section) or issubclass(section, model)

    out = []
    for task in TASKS:
        cls = config_class(task)
        models = [cls] + [f.annotation for f in cls.model_fields.values() if isinstance(f.annotation, type)
                          and issubclass(f.annotation, BaseModel)]
        if any(same(m) and name in m.model_fields for m in models):
            out.append(task)
    return tuple(out)


def schema_field(key: str, task: str | None = None):
    """The pydantic FieldInfo of dotted `key` ("train.lr") in `task`'s config, or in the first task's that has it."""
    for t in [task] if task else TASKS:
        model: Any = config_class(t)
        for part in key.split("."):
            f = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
            if f is None:
                break
            model = f.annotation
        else:
            return f
    raise KeyError(f"{key}: no such field in {task or ' or '.join(TASKS)}'s config")


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


def _format_errors(err: ValidationError, source: str, cls: type[Config]) -> str:
    lines = [f"invalid config ({source}):"]
    task = cls.model_fields["task"].default
    for e in err.errors():
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
        msg, value = e["msg"], e.get("input")
        if e["type"] == "extra_forbidden":
            others = [t for t in TASKS if field in task_keys(t)]
            if others:
                # A whole section of the other task ([llm], [data]) is named key by key, as the user wrote them.
                whole = len(e["loc"]) == 1 and isinstance(value, dict) and value
                named = [(f"{field}.{k}", v) for k, v in value.items()] if whole else [(field, value)]
                lines += [f"  {key}{'' if isinstance(v, dict) else f' = {v!r}'}: a setting of task={others[0]!r}, "
                          f"which does nothing for task={task!r}: remove it from {_where(source)}" for key, v in named]
                continue
            section = _section_at(cls, e["loc"][:-1])
            msg = f"unknown field; allowed here: {', '.join(section.model_fields) if section else ''}"
        elif e["type"] == "literal_error":
            msg = f"must be one of {e['ctx']['expected']}"
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {field}{shown}: {msg}")
    return "\n".join(lines)


def _where(source: str) -> str:
    """Where a config's values came from, as an instruction names it: the file, else the overrides."""
    first = source.split(" + ")[0]
    return first if first != "defaults" else "the settings given (--set or the form)"


def _section_at(cls: type[Config], loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = cls
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
    """The config of the task the settings name (config_class), from an optional TOML file, then `key=value`
    overrides, then a dict of dotted keys, then what the task adds where they are silent (Config.settings_over)."""
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
    task = tree.get("task", Config.model_fields["task"].default)
    # An unknown task is refused by the shared schema's own check, before any task's settings are read.
    cls = config_class(task) if isinstance(task, str) and task in TASKS else Config
    try:
        if cls is Config:
            Config.model_validate({"task": task})
        tree, source = cls.settings_over(tree, source)
        return cls.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, cls), e.errors()) from None


def preset_value(tree: dict, dotted: str, default: Any = None) -> Any:
    """The value at a dotted key of a settings tree, or `default` where the tree does not set it."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
