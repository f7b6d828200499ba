"""What the CLI's commands share: the train flags and the config a command line makes, --resume's job, and
training a job with its report."""
from __future__ import annotations

from .. import training

# Each flag is a shortcut for one config field; the default lives in the schema, not here.
TRAIN_FLAGS = [
    ("--model", "model.path", str, "diffusers SDXL folder, single-file .safetensors, tiny-sdxl-demo (the shipped "
                                   "demo base) or tiny-sdxl (random weights)"),
    ("--data", "data.dirs", str, "dataset folder (repeat for several)"),
    ("--steps", "train.steps", int, "optimizer steps"),
    ("--epochs", "train.epochs", int, "train this many epochs instead of --steps (each dataset's repeats counted)"),
    ("--resolution", "data.resolution", int, "training resolution (side of the square of equal area)"),
    ("--rank", "adapter.rank", int, "LoRA rank"),
    ("--kind", "adapter.kind", str, "adapter kind: lora, dora, loha or lokr"),
    ("--batch-size", "train.batch_size", int, "images per step"),
    ("--out", "output.runs_dir", str, "folder that holds the runs"),
    ("--name", "output.name", str, "run name (folder under --out)"),
    ("--seed", "train.seed", int, "random seed"),
    ("--device", "train.device", str, "cpu, cuda or auto"),
    ("--profile", "train.profile_steps", int, "record N steps with torch's profiler into <run>/profile"),
    ("--vram", "train.vram_gb", float, "GPU memory the whole run may use, GiB: the fastest settings that fit"),
]


# Fields whose flag repeats (--data A --data B): a list.
LIST_FIELDS = ("data.dirs", "llm.data")


def add_config_arguments(parser, flags, example: str) -> None:
    """A train command's CONFIG file, --set (`example`: a KEY=VALUE for its help) and its flags."""
    parser.add_argument("config", nargs="?", help="TOML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config field, e.g. --set {example} (repeatable)")
    for flag, field, typ, help_ in flags:
        parser.add_argument(flag, type=typ, help=f"{help_} [{field}]",
                            **({"action": "append"} if field in LIST_FIELDS else {}))


PRESET_HELP = ("recommended settings where yours are silent: a card (6gb, 8gb, 12gb, 16gb, 16gb-fast, 24gb, "
               "24gb-fast, 48gb, none) and/or a goal (character, style, concept), e.g. 8gb,style [card, goal]")


def config_from_args(args, flags=None, **fixed) -> "Config":  # noqa: F821
    """The config of a train command line: the CONFIG file, then --set, then the flags (`flags`, default
    TRAIN_FLAGS) and `fixed` top-level fields (the LLM command's task="llm")."""
    from ..core.config import load_config

    extra = dict(fixed)
    for flag, field, _, _ in flags or TRAIN_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        extra[field] = list(value) if field in LIST_FIELDS else value
    if getattr(args, "overwrite", False):
        extra["output.overwrite"] = True
    extra.update(preset_fields(getattr(args, "preset", None)))
    return load_config(args.config, args.set, extra)


def preset_fields(names: list[str] | None) -> dict[str, str]:
    """--preset 8gb,style as {"card": "8gb", "goal": "style"}; a layer preset's name points at --layers."""
    from typing import get_args

    from ..sdxl import presets
    from ..core.config import AdapterConfig, ConfigError

    layers = [n.strip() for item in names or [] for n in item.split(",")
              if n.strip() in get_args(AdapterConfig.model_fields["preset"].annotation)]
    if layers:
        raise ConfigError(f"--preset {layers[0]}: {layers[0]!r} names which layers get adapters (adapter.preset): "
                          f"use --layers {layers[0]} (plan) or --set adapter.preset={layers[0]}; --preset takes "
                          f"{presets.choices()}")
    try:
        return presets.split_names(names or [])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resume_job(args) -> training.Job:
    """The run --resume names, its own config (plus any --set and --steps given now) and its newest state."""
    from ..core.config import ConfigError

    if args.config:
        raise ConfigError("--resume uses the run's own config.toml; drop the CONFIG argument")
    return training.resume_job(args.resume, args.set, {"train.steps": args.steps, "train.epochs": None} if args.steps else None,
                               runs_dir=args.out)


def train_job(job: training.Job) -> int:
    """Train the job and print how it went (where the adapter is, or how to resume)."""
    outcome = training.fit(job)
    for line in training.report(outcome):
        print(line)
    return outcome.exit_code


def card_for(args):
    """The card a plan is for: --card N (GB), else this machine's first GPU (from nvidia-smi: the plan holds no
    CUDA context), else none."""
    from ..core.card import card_without_context, pretend_card

    gb = getattr(args, "card", None)
    return pretend_card(gb) if gb is not None else card_without_context()
