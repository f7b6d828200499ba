"""`sdxl-lora`: parses the command line, builds a config, calls the library. Nothing else lives here."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import training

training.stay_offline()  # before anything imports transformers or diffusers

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


PRESET_HELP = ("recommended settings where yours are silent: a card (6gb, 8gb, 12gb, 16gb, 16gb-fast, 24gb, "
               "24gb-fast, 48gb, none) and/or a goal (character, style, concept), e.g. 8gb,style [card, goal]")


def _config_from_args(args, flags=None, **fixed) -> "Config":  # noqa: F821
    """The config of a train command line: the CONFIG file, then --set, then the flags (`flags`, default
    TRAIN_FLAGS) and `fixed` top-level fields (the LLM command's task="llm")."""
    from .core.config import load_config

    extra = dict(fixed)
    for flag, field, _, _ in flags or TRAIN_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        extra[field] = list(value) if field in ("data.dirs", "llm.data") else value
    if getattr(args, "overwrite", False):
        extra["output.overwrite"] = True
    extra.update(_preset_fields(getattr(args, "preset", None)))
    return load_config(args.config, args.set, extra)


def _preset_fields(names: list[str] | None) -> dict[str, str]:
    """--preset 8gb,style as {"card": "8gb", "goal": "style"}; a layer preset's name points at --layers."""
    from typing import get_args

    from .core import presets
    from .core.config import AdapterConfig, ConfigError

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


def _resume_job(args) -> training.Job:
    """The run --resume names, its own config (plus any --set and --steps given now) and its newest state."""
    from .core.config import ConfigError

    if args.config:
        raise ConfigError("--resume uses the run's own config.toml; drop the CONFIG argument")
    return training.resume_job(args.resume, args.set, {"train.steps": args.steps, "train.epochs": None} if args.steps else None,
                               runs_dir=args.out)


def _train(job: training.Job) -> int:
    """Train the job and print how it went (where the adapter is, or how to resume)."""
    outcome = training.fit(job)
    for line in training.report(outcome):
        print(line)
    return outcome.exit_code


def cmd_train(args) -> int:
    # The resumed run (its config and newest state, read and verified once) or the new run's config.
    job = _resume_job(args) if args.resume else None
    cfg = job.cfg if job else _config_from_args(args)
    if cfg.task == "llm":
        return cmd_llm_train(args, job)  # the LLM command, same flags
    return _train(job or training.new_job(cfg))


def cmd_generate(args) -> int:
    import torch

    from .core.fsutil import check_destination
    from .sdxl.config import ModelConfig
    from .core.runs import relpath
    from .sdxl.merge import applied
    from .sdxl.model import load_pipeline, native_resolution
    from .sdxl.preview import Sampler, grid, render, save_png

    out = Path(args.out)
    paths = [out / f"seed{args.seed + i}.png" for i in range(args.num)]
    written = paths + ([out / f"seed{args.seed}-grid.png"] if args.num > 1 else [])
    for path in written:  # before the model loads and renders
        check_destination(relpath(path), args.overwrite, [args.model, args.tokenizer, *(args.lora or [])],
                          "the render")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    pipe = load_pipeline(ModelConfig(path=args.model, tokenizer=args.tokenizer), torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=False)
    loras = [Path(lora) for lora in args.lora or []]
    for lp in loras:
        if not lp.is_file():
            raise FileNotFoundError(f"--lora {lp}: no such file")
    scales = args.scale or [1.0]
    if len(scales) == 1:
        scales = scales * len(loras)
    if loras and len(scales) != len(loras):
        raise ValueError(f"--scale given {len(scales)} times for {len(loras)} --lora files; give one or one each")
    size = args.size or native_resolution(pipe)
    with applied(pipe, list(zip(loras, scales))):  # merged for the render, as previews and the UI's tabs do
        images = render(pipe, [args.prompt] * args.num, seed=args.seed, steps=args.steps, guidance=args.guidance,
                        width=size, height=size, negative=args.negative, sampler=Sampler())
    out.mkdir(parents=True, exist_ok=True)
    for im, path in zip(images, paths):
        save_png(im, path)
        print(f"image: {relpath(path)}")
    if len(images) > 1:
        save_png(grid(images), out / f"seed{args.seed}-grid.png")
    return 0


def cmd_plan(args) -> int:
    import json

    from .core import inject
    from .sdxl.plan import plan_run

    cfg = _plan_config(args)
    preset = _preset_report(cfg)
    # On the meta device: structure only. train.mixed_precision "auto" is taken as bf16 (a GPU run).
    run = plan_run(cfg, _card(args))
    planned, whole = run.planned, run.memory
    plan, memory, resolution, native = planned.plan, planned.memory, planned.resolution, planned.native
    if args.json:
        card = run.card
        print(json.dumps({"model": cfg.model.path, "preset": cfg.adapter.preset, "resolution": resolution,
                          "card": cfg.card, "goal": cfg.goal, "preset_settings": preset, "slowdown": run.slowdown,
                          "base_rank": plan.base_rank, "modules": len(plan.targets),
                          "trainable_params": plan.trainable_params,
                          "adapter_mb": round(plan.trainable_params * 4 / 2**20, 3),
                          "groups": plan.groups(), "memory": memory.as_dict(), "run_memory": whole.as_dict(),
                          "budget_choices": run.choices, "budget_gib": run.budget_gib,
                          "gpu": None if card is None else {"name": card.name, "gib": round(card.total / 2**30, 2),
                                                            "free_gib": round(card.free / 2**30, 2),
                                                            "budget_gib": card.budget_gib},
                          "verdict": run.verdict()}, indent=1))
        return 0
    print(f"model {cfg.model.path}, preset {cfg.adapter.preset}, resolution {resolution} (native {native})")
    if args.verbose:
        print(inject.format_plan(plan))
    else:
        print(f"adapter: {len(plan.targets)} layers, {plan.trainable_params:,} trainable parameters "
              f"({plan.trainable_params * 4 / 2**20:.1f} MB); the layer table with -v")
    print(memory.format())
    print(whole.format())
    if cfg.card or cfg.goal:
        named = " + ".join(f"{k} {v}" for k, v in (("card", cfg.card), ("goal", cfg.goal)) if v)
        print(f"preset {named}: " + "; ".join(f"{k} {v}" for k, v in preset.items()))
    print(f"card: {run.verdict()}")
    return 0


def _card(args):
    """The card a plan is for: --card N (GB), else this machine's first GPU (from nvidia-smi: the plan holds no
    CUDA context), else none."""
    from .core.card import card_without_context, pretend_card

    gb = getattr(args, "card", None)
    return pretend_card(gb) if gb is not None else card_without_context()


def _plan_config(args) -> "Config":  # noqa: F821
    """The config of a plan or presets command line: the CONFIG file, --set, then the flags."""
    from .core.config import load_config

    extra = {k: v for k, v in (("model.path", args.model), ("adapter.preset", getattr(args, "layers", None)),
                                ("adapter.rank", args.rank), ("data.resolution", args.resolution),
                                ("train.batch_size", args.batch_size), ("train.vram_gb", getattr(args, "vram", None)))
             if v is not None}
    extra.update(_preset_fields(getattr(args, "preset", None)))
    return load_config(args.config, args.set, extra)


def _preset_report(cfg) -> dict[str, str]:
    """Each field the config's presets name, with its value in the config: the preset's, or yours where you set
    another (which wins)."""
    from .core import presets

    out = {}
    for key, value in presets.settings(cfg.card, cfg.goal).items():
        section, field = key.split(".")
        now = getattr(getattr(cfg, section), field)
        out[key] = f"{now!r}" if now == value else f"{now!r} (yours; the preset says {value!r})"
    return out


def cmd_presets(args) -> int:
    import json

    from .core import presets
    from .sdxl.plan import card_plans, format_cards

    cfg = _plan_config(args)
    plans = card_plans(cfg)
    if args.json:
        print(json.dumps({"model": cfg.model.path, "batch_size": cfg.train.batch_size,
                          "resolution": cfg.data.resolution, "cards": [p.as_dict() for p in plans],
                          "goals": {n: {"about": g.about, "settings": g.settings} for n, g in presets.GOALS.items()}},
                         indent=1))
        return 0
    print(f"card presets for {cfg.model.path}, batch {cfg.train.batch_size}, resolution "
          f"{cfg.data.resolution or 'native'} (planned from the model's config, no weights read):")
    print(format_cards(plans))
    print("\ngoal presets (combine with a card: --preset 8gb,style):")
    for name, goal in presets.GOALS.items():
        print(f"  {name:<10} {goal.about}")
        print(f"  {'':<10} " + ", ".join(f"{k}={v!r}" for k, v in goal.settings.items()))
    return 0


def cmd_dataset_inspect(args) -> int:
    from .core.config import ConfigError, load_config
    from .sdxl.data import inspect_text

    # Folders on the command line replace the config's datasets; without any, the config's own are inspected.
    given = {"data.dirs": list(args.dirs), "data.datasets": []} if args.dirs else {}
    if not args.dirs and not args.config:
        raise ConfigError("dataset inspect: give dataset folder(s), or --config with [[data.datasets]] or data.dirs")
    cfg = load_config(args.config, args.set, given)
    resolution = cfg.data.resolution or args.resolution
    if resolution is None:  # what training would use: the model's native resolution
        from .sdxl.model import unet_skeleton

        resolution = unet_skeleton(cfg.model)[1]
    print(inspect_text(cfg.data, resolution, doctor=not args.no_doctor, batch_size=cfg.train.batch_size))
    return 0


def cmd_dataset_caption(args) -> int:
    from .sdxl.captioner import caption_folder

    report = caption_folder(args.dir, args.model, extension=args.caption_extension, overwrite=args.overwrite,
                            prompt=args.prompt, prefix=args.prefix, max_new_tokens=args.max_new_tokens,
                            batch_size=args.batch_size, device=args.device)
    for line in report.lines():
        print(line)
    return 0


def cmd_dataset_tag(args) -> int:
    from .sdxl.tagger import tag_folder

    report = tag_folder(args.dir, args.tagger, extension=args.caption_extension, overwrite=args.overwrite,
                        general_threshold=args.general_threshold, character_threshold=args.character_threshold,
                        ratings=args.ratings, trigger=args.trigger, underscores=args.keep_underscores,
                        batch_size=args.batch_size, device=args.device)
    for line in report.lines():
        print(line)
    return 0


def _adapter_source(source: str, model: str | None) -> tuple[Path, str | None]:
    """The adapter (file or PEFT folder) a path names, and the model its layer names refer to: a run
    folder gives its main adapter file and the model it was trained on."""
    p = Path(source)
    if p.is_dir() and (p / "config.toml").is_file():
        from .core.config import load_config

        for cand in (p / f"{p.name}.safetensors", p / f"{p.name}.diffusers.safetensors"):
            if cand.is_file():
                run_model = load_config(p / "config.toml").model.path
                return cand, model or run_model
        raise FileNotFoundError(f"run folder {p} has no adapter ({p.name}.safetensors): has the run finished?")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such adapter file, PEFT folder or run folder")
    return p, model or _trained_on(p)


def _trained_on(adapter: Path) -> str | None:
    """The model an adapter file says it was trained on, where that is known here: the run folder it sits in
    (its config.toml), else a built-in model its metadata names (ss_sd_model_name); none means SDXL base."""
    from .core.config import DEMO_NAME, load_config
    from .sdxl.tiny import TINY_NAME

    run_config = adapter.parent / "config.toml"
    if adapter.is_file() and run_config.is_file():
        try:
            return load_config(run_config).model.path
        except (ValueError, OSError):  # not a run's config: the metadata may still say
            pass
    if adapter.is_file() and adapter.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(adapter), "pt") as fh:
                name = (fh.metadata() or {}).get("ss_sd_model_name")
        except (SafetensorError, OSError):  # not a safetensors file: load_adapter says what it is
            return None
        if name in (DEMO_NAME, TINY_NAME):
            return name
    return None


def _true_alpha_source(src: Path) -> Path:
    """For --true-alpha: a file whose training alphas were folded into its weights (a run's main kohya file)
    cannot give them back; the run's diffusers file beside it keeps them, so it is read instead. LoHa/LoKr files
    are written with alpha = rank whatever is asked (sdxl/export.py: kohya_layers), so theirs is read as it is."""
    import json

    from safetensors import safe_open

    from .sdxl.export import AdapterError

    if not (src.is_file() and src.suffix == ".safetensors"):
        return src
    with safe_open(str(src), "pt") as fh:
        meta = fh.metadata() or {}
    try:
        args = json.loads(meta.get("ss_network_args", "{}"))
        folded = "training_alphas_folded" in args and args.get("algo") not in ("loha", "lokr")
    except (json.JSONDecodeError, TypeError, AttributeError):
        folded = False
    if not folded:
        return src
    twin = src.with_name(src.name[:-len(".safetensors")] + ".diffusers.safetensors")
    if twin.is_file():
        return twin
    raise AdapterError(f"{src}: its layers' training alphas were folded into the weights, so --true-alpha cannot "
                       f"recover them from it; export from the run folder, or from the diffusers file the run wrote "
                       f"beside it ({twin.name}), or drop --true-alpha")


def _read_adapter(args, verb: str, redirect=None, source: str | None = None, table=None):
    """The adapter `source` (default args.source) names, read against `table` or args.model (else the run's,
    else SDXL base): (the file read, its layer table, the Adapter). `redirect(path)` may name another file to
    read. Keys that fit no layer of the model are refused unless args.drop_unknown."""
    from .sdxl.export import AdapterError, layer_table, load_adapter

    src, model = _adapter_source(args.source if source is None else source, args.model)
    if redirect is not None:
        src = redirect(src)
    table = layer_table(model) if table is None else table
    adapter = load_adapter(src, table)
    if adapter.unknown and not args.drop_unknown:
        raise AdapterError(f"{src}: {adapter.problems[0]}; pass --drop-unknown to {verb} the other layers")
    return src, table, adapter


def cmd_export(args) -> int:
    from .sdxl.export import AdapterError, export_adapter
    from .core.runs import relpath

    try:
        src, table, adapter = _read_adapter(args, "export", _true_alpha_source if args.true_alpha and
                                            args.format == "kohya" else None)
        out = export_adapter(adapter, args.out, args.format, metadata=not args.no_metadata, names=args.names,
                             unet_config=table.unet_config, uniform_alpha=not args.true_alpha,
                             overwrite=args.overwrite, reads=(args.source, src, args.model))
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.format} adapter: {relpath(out)}  ({len(adapter.layers)} layers, read from {relpath(src)}, "
          f"{adapter.format})")
    if args.format == "kohya":
        from .sdxl.loaders import file_notes

        for line in file_notes(out):
            print(f"tools      : {line}")
    return 0


def _layer_progress():
    """progress(i, n) for a walk over an adapter's layers: a line on stderr at each tenth of the way."""
    shown = [0]

    def progress(i: int, n: int) -> None:
        if i * 10 // n > shown[0]:
            shown[0] = i * 10 // n
            print(f"  {i}/{n} layers", file=sys.stderr, flush=True)
    return progress


def cmd_resize(args) -> int:
    from .core.runs import relpath
    from .sdxl.export import AdapterError, check_dest, export_adapter
    from .sdxl.merge import parse_lora_arg
    from .sdxl.resize import provenance, resize_adapters

    try:
        picked = [parse_lora_arg(x) for x in args.source]
        read, table = [], None
        for path, strength in picked:
            src, table, adapter = _read_adapter(args, "resize", source=str(path), table=table)
            read.append((src, adapter, strength))
        reads = [*(given for given, _ in picked), *(src for src, _, _ in read), args.model]
        check_dest(Path(args.out), args.overwrite, reads, reader="the resize")  # before the SVDs
        resized = resize_adapters([(a, s) for _, a, s in read], args.rank, args.dynamic_method, args.dynamic_param,
                                  args.device, _layer_progress())
        made_from = " + ".join(src.name if s == 1.0 else f"{src.name}:{s:g}" for src, _, s in read)
        out = export_adapter(resized.adapter, args.out, args.format, names=args.names,
                             metadata=provenance(made_from, args.rank, args.dynamic_method, args.dynamic_param),
                             unet_config=table.unet_config, overwrite=args.overwrite, reads=reads)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = (lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size)
    print(f"resized {resized.summary()}")
    sources = "; ".join(f"{relpath(src)}, {a.format}, {size(src) / 2**20:.1f} MiB" + ("" if s == 1.0 else f", x {s:g}")
                        for src, a, s in read)
    print(f"{args.format} adapter: {relpath(out)}  ({size(out) / 2**20:.1f} MiB; read from {sources})")
    return 0


def cmd_extract(args) -> int:
    from .core.runs import relpath
    from .sdxl.export import AdapterError, check_dest, export_adapter, layer_table
    from .sdxl.extract import extract_adapter

    try:
        reads = (args.base, args.tuned)
        check_dest(Path(args.out), args.overwrite, reads, reader="the extraction")  # before minutes of loading and SVDs
        done = extract_adapter(args.base, args.tuned, args.rank, conv_rank=args.conv_rank, preset=args.preset,
                               method=args.dynamic_method, param=args.dynamic_param,
                               text_encoders=not args.no_text_encoders, min_diff=args.min_diff,
                               device=args.device, progress=_layer_progress())
        table = layer_table(args.base)
        out = export_adapter(done.adapter, args.out, args.format, names=args.names, unet_config=table.unet_config,
                             overwrite=args.overwrite, reads=reads)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"extracted {done.summary()}")
    print(f"{args.format} adapter: {relpath(out)}")
    return 0


def cmd_inspect(args) -> int:
    from .sdxl.export import AdapterError, inspect_adapter

    try:
        src, model = _adapter_source(args.file, args.model)
        _, text = inspect_adapter(src, model)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def cmd_merge(args) -> int:
    from .sdxl.export import AdapterError
    from .sdxl.merge import merge_checkpoint, parse_lora_arg
    from .core.runs import relpath

    loras = [parse_lora_arg(a) for a in args.lora]
    try:
        out = merge_checkpoint(args.model, loras, args.out, tokenizer=args.tokenizer, dtype=args.dtype,
                               overwrite=args.overwrite, as_trained=args.as_trained)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    merged = ", ".join(f"{p.name} x {s:g}" for p, s in loras)
    kind = "single-file checkpoint" if out.suffix == ".safetensors" else "diffusers folder"
    print(f"merged     : {merged}")
    print(f"checkpoint : {relpath(out)}  ({kind})")
    return 0


# ---- the causal-LM path (`sdxl-lora llm ...`, docs/llm.md) ----
LLM_FLAGS = [
    ("--model", "model.path", str, "local transformers causal-LM folder, or tiny-llm"),
    ("--data", "llm.data", str, "JSONL file of alpaca or chat lines (repeat for several)"),
    ("--steps", "train.steps", int, "optimizer steps"),
    ("--epochs", "train.epochs", int, "train this many epochs instead of --steps (each dataset's repeats counted)"),
    ("--rank", "adapter.rank", int, "LoRA rank"),
    ("--kind", "adapter.kind", str, "adapter kind: lora, dora, loha or lokr"),
    ("--batch-size", "train.batch_size", int, "rows per step"),
    ("--max-length", "llm.max_length", int, "tokens per row"),
    ("--out", "output.runs_dir", str, "folder that holds the runs"),
    ("--name", "output.name", str, "run name (folder under --out)"),
    ("--seed", "train.seed", int, "random seed"),
    ("--device", "train.device", str, "cpu, cuda or auto"),
    ("--vram", "train.vram_gb", float, "GPU memory the run may use, GiB: checkpointing, a smaller batch or an "
                                       "nf4 base where needed"),
]


def _llm_config_from_args(args) -> "Config":  # noqa: F821
    return _config_from_args(args, LLM_FLAGS, task="llm")


def task_of(argv: list[str]) -> str:
    """The task a `train` command line would run (its config's, or the resumed run's): for launch scripts."""
    from .core.config import load_config

    args = build_parser().parse_args(["train", *argv])
    if args.resume:
        return load_config(training.find_run(args.resume, args.out) / "config.toml").task
    return _config_from_args(args).task


def cmd_llm_plan(args) -> int:
    """The adapter plan for a causal LM, from its config.json alone (the model is built on the meta device:
    no weights read), and the frozen weights, adapter, gradients, optimizer state and activations it implies;
    with train.vram_gb, the settings the budget chose."""
    import json

    from .core import inject
    from .core.memory import GiB
    from .llm.memory import config_memory, fit_budget, fit_card, format_activations
    from .llm.model import check_causal_lm_folder, resolve_llm_path

    cfg = _llm_config_from_args(args)
    config = check_causal_lm_folder(resolve_llm_path(cfg.model), weights=False)
    choices, card, fit, given = None, _card(args), None, bool(cfg.train.vram_gb)
    if given:
        fit = fit_budget(cfg, config, cfg.train.vram_gb)
    elif card is not None:
        fit = fit_card(cfg, config, card)  # None: the settings as given fit the card
    if fit is not None:
        cfg, choices = fit.cfg, fit.choices
    if card is None and not given:
        verdict = "no GPU here: give --card N to plan for a card of N GB"
    elif fit is None:
        verdict = f"fits {card.describe()} as set"
    else:
        where = f"train.vram_gb={cfg.train.vram_gb:g}" if given else card.describe()
        verdict = (f"{where}: " + (", ".join(f"{k}={v}" for k, v in choices.items()) or "fits as set")
                   + f" (~{fit.slowdown:.2f}x the time per token of the settings as given)")
    plan, memory = config_memory(cfg, config)
    state, acts, weights = memory.parts, memory.acts, memory.weights
    n, compute = plan.trainable_params, memory.compute_dtype
    ckpt = cfg.train.gradient_checkpointing
    method = cfg.model.quantize if cfg.model.quantize != "none" else None
    if args.json:
        print(json.dumps({"model": cfg.model.path, "model_type": config.model_type, "base_rank": plan.base_rank,
                          "modules": len(plan.targets), "trainable_params": n, "adapter_mb": round(n * 4 / 2**20, 3),
                          "groups": plan.groups(), "weights_gib": {k: round(v / GiB, 3) for k, v in weights.items()},
                          "host_embedding_gib": round(memory.host_embedding / GiB, 3),
                          "memory_gib": {k: round(v / GiB, 3) for k, v in state.items()},
                          "peak_gib": round(sum(state.values()) / GiB, 3),
                          "process_peak_gib": round(memory.peak / GiB, 3), "batch_size": cfg.train.batch_size,
                          "grad_accum": cfg.train.grad_accum, "max_length": cfg.llm.max_length,
                          "gradient_checkpointing": ckpt, "quantize": cfg.model.quantize,
                          "vram_gb": cfg.train.vram_gb, "budget_choices": choices,
                          "budget_slowdown": fit.slowdown if choices is not None else None,
                          "verdict": verdict}, indent=1))
        return 0
    print(f"model {cfg.model.path} ({config.model_type}), preset {cfg.adapter.preset}")
    print(inject.format_plan(plan))
    print(f"card: {verdict}")
    print(f"memory estimate ({method or 'unquantized'} base, {cfg.train.optimizer}, batch {cfg.train.batch_size} "
          f"x {cfg.llm.max_length} tokens, {'checkpointing' if ckpt else 'no checkpointing'}):")
    print(f"  frozen weights {state['frozen weights'] / GiB:8.2f} GiB  ("
          + ", ".join(f"{k} {v / GiB:.2f}" for k, v in weights.items())
          + (f"; the input embedding's {memory.host_embedding / GiB:.2f} in host memory" if memory.host_embedding
             else "") + ")")
    for k in ("adapter (fp32)", "gradients", "optimizer"):
        print(f"  {k:14s} {state[k] / GiB:8.2f} GiB")
    print("\n".join(format_activations(acts, ckpt, compute, cfg.llm.offload_activations)))
    print(f"  peak           {sum(state.values()) / GiB:8.2f} GiB (the accelerator's; the whole process with the "
          f"CUDA context about {memory.peak / GiB:.2f} GiB)")
    return 0


def cmd_llm_train(args, resumed: training.Job | None = None) -> int:
    """`resumed`: the job cmd_train already found for --resume."""
    if args.resume:
        job = resumed or _resume_job(args)
        if job.cfg.task != "llm":
            raise FileNotFoundError(f"--resume {job.run.dir}: an SDXL run; resume it with `sdxl-lora train --resume`")
    else:
        job = training.new_job(_llm_config_from_args(args))
    return _train(job)


def _adapter_base(adapter: Path, model: str | None) -> tuple[Path, tuple]:
    """The base model folder (given, or the one the adapter names) and the quantization it trained with."""
    from safetensors import safe_open

    from .core.config import ModelConfig
    from .llm.export import ADAPTER_WEIGHTS, read_adapter_config
    from .llm.model import resolve_llm_path

    base = model or read_adapter_config(adapter).get("base_model_name_or_path") or "tiny-llm"
    with safe_open(str(adapter / ADAPTER_WEIGHTS), "pt") as f:
        meta = f.metadata() or {}
    q = meta.get("sdxl_lora.quantize", "none")
    opts = {"double_quant": meta.get("sdxl_lora.quant_double", "True") == "True"}
    return resolve_llm_path(ModelConfig(path=base)), ((None if q == "none" else q), opts if q != "none" else {})


def cmd_llm_generate(args) -> int:
    import torch

    from .core.config import ModelConfig
    from .llm.config import LLMConfig
    from .llm.data import chat_template
    from .llm.export import adapter_folder, load_with_adapter
    from .llm.model import check_causal_lm_folder, load_tokenizer, resolve_llm_path
    from .llm.preview import answer

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if args.adapter:
        adapter = adapter_folder(args.adapter)
        base, _ = _adapter_base(adapter, args.model)
        model, tok = load_with_adapter(base, adapter, dtype, device)
    else:
        from transformers import AutoModelForCausalLM

        base = resolve_llm_path(ModelConfig(path=args.model or "tiny-llm"))
        check_causal_lm_folder(base)
        tok = load_tokenizer(base)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype, local_files_only=True,
                                                     use_safetensors=True).to(device)
    template = chat_template(LLMConfig(chat_template=args.chat_template), tok)
    for prompt in args.prompt:
        reply = answer(model, tok, template, [prompt], args.max_new_tokens, args.system)[0]
        # Several prompts: each answer under its prompt, so they can be told apart.
        print(f"prompt: {prompt}\nanswer: {reply}\n" if len(args.prompt) > 1 else reply)
    return 0


def cmd_llm_merge(args) -> int:
    import torch

    from .llm.export import adapter_folder, merge_adapter
    from .core.runs import relpath

    adapter = adapter_folder(args.adapter)
    base, quant = _adapter_base(adapter, args.model)
    if quant[0]:
        logging.getLogger(__name__).warning(
            "%s was trained on a %s-quantized base: merged into the base quantized and dequantized again",
            adapter, quant[0])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = "cuda" if quant[0] and torch.cuda.is_available() else "cpu"
    out = merge_adapter(base, adapter, Path(args.out), dtype=dtype, overwrite=args.overwrite, quantize=quant,
                        device=device)
    print(f"merged     : {relpath(adapter)} into {relpath(base)}")
    print(f"model      : {relpath(out)}  (transformers folder)")
    return 0


def _add_llm_parser(sub) -> None:
    lp = sub.add_parser("llm", help="LoRA/QLoRA for causal language models (docs/llm.md)")
    lsub = lp.add_subparsers(dest="llm_command", required=True)
    t = lsub.add_parser("train", help="train an adapter (no arguments: the embedded tiny Llama on sample_data/llm)")
    t.add_argument("config", nargs="?", help="TOML config file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set llm.max_length=1024 (repeatable)")
    for flag, field, typ, help_ in LLM_FLAGS:
        kw = {"action": "append"} if field == "llm.data" else {}
        t.add_argument(flag, type=typ, help=f"{help_} [{field}]", **kw)
    t.add_argument("--overwrite", action="store_true", help="replace an existing run folder of the same name")
    t.add_argument("--resume", metavar="RUN_DIR|latest", help="continue a run from its newest complete state")
    t.set_defaults(func=cmd_llm_train)

    pl = lsub.add_parser("plan", help="print the adapter plan and weight memory of a causal LM (no weights read)")
    pl.add_argument("config", nargs="?", help="TOML config file")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    pl.add_argument("--model", help="local transformers causal-LM folder, or tiny-llm [model.path]")
    pl.add_argument("--rank", type=int, help="LoRA rank [adapter.rank]")
    pl.add_argument("--batch-size", type=int, help="rows per step [train.batch_size]")
    pl.add_argument("--max-length", type=int, help="tokens per row [llm.max_length]")
    pl.add_argument("--vram", type=float, help="plan the step to fit this much GPU memory, GiB [train.vram_gb]")
    pl.add_argument("--card", type=float, metavar="GB", help="plan for a card of this many GB, as a run on it "
                                                             "would plan itself (default: this machine's GPU)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_llm_plan)

    g = lsub.add_parser("generate", help="answer prompts with a base model and (optionally) an adapter")
    g.add_argument("prompt", nargs="+", help="prompt(s), each answered greedily")
    g.add_argument("--model", help="base model folder or tiny-llm (default: the one the adapter names)")
    g.add_argument("--adapter", help="PEFT adapter folder or run folder")
    g.add_argument("--system", help="system prompt")
    g.add_argument("--chat-template", help="Jinja template or .jinja file (default: the tokenizer's)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.set_defaults(func=cmd_llm_generate)

    m = lsub.add_parser("merge", help="bake an adapter into its base model (a transformers folder)")
    m.add_argument("--adapter", required=True, help="PEFT adapter folder or run folder")
    m.add_argument("--model", help="base model folder or tiny-llm (default: the one the adapter names)")
    m.add_argument("--out", required=True, help="folder to write")
    m.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(func=cmd_llm_merge)


def cmd_ui(args) -> int:
    from .ui.app import launch

    return launch(args)


def _add_ui_parser(sub) -> None:
    from .ui.app import add_arguments

    u = sub.add_parser("ui", help="the Gradio UI in your browser (http://127.0.0.1:7860 by default)")
    add_arguments(u)
    u.set_defaults(func=cmd_ui)


def _svd_output_args(p: argparse.ArgumentParser) -> None:
    """resize's and extract's shared options: the rank choice per layer, where the SVDs run, the file written."""
    p.add_argument("--dynamic-method", choices=["sv_fro", "sv_cumulative", "sv_ratio"],
                   help="per layer, the fewest ranks that keep --dynamic-param of the update's Frobenius norm "
                        "(sv_fro) or of its singular values' sum (sv_cumulative), or every singular value within a "
                        "factor --dynamic-param of the largest (sv_ratio)")
    p.add_argument("--dynamic-param", type=float, help="sv_fro/sv_cumulative: a share in (0, 1]; sv_ratio: 1 or more")
    p.add_argument("--device", default="cpu", help="where the SVDs run: cpu or cuda")
    p.add_argument("--out", required=True, help="the file to write (a folder for --format peft)")
    p.add_argument("--format", default="kohya", choices=["kohya", "diffusers", "peft"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p.add_argument("--names", default="sgm", choices=["sgm", "diffusers"],
                   help="kohya layer names: SDXL's original (sgm) or diffusers' blocks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdxl-lora", description="Train LoRA adapters for SDXL, offline.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train an adapter (no arguments: the demo base, tiny-sdxl-demo, on sample_data/)")
    t.add_argument("config", nargs="?", help="TOML config file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=1e-4 (repeatable)")
    for flag, field, typ, help_ in TRAIN_FLAGS:
        kw = {"action": "append"} if field == "data.dirs" else {}
        t.add_argument(flag, type=typ, help=f"{help_} [{field}]", **kw)
    t.add_argument("--preset", action="append", metavar="NAME[,NAME]", help=PRESET_HELP)
    t.add_argument("--overwrite", action="store_true", help="replace an existing run folder of the same name")
    t.add_argument("--resume", metavar="RUN_DIR|latest",
                   help="continue a run from its newest complete training state (with its own config)")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="render images with a base model and LoRA adapters")
    g.add_argument("--model", default="tiny-sdxl-demo",
                   help="tiny-sdxl-demo (default), tiny-sdxl, a diffusers SDXL folder or single .safetensors file")
    g.add_argument("--tokenizer", help="folder with tokenizer/ and tokenizer_2/ (for single-file models)")
    g.add_argument("--lora", action="append", help="adapter .safetensors (repeatable)")
    g.add_argument("--scale", type=float, action="append", help="adapter strength (one, or one per --lora)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--guidance", type=float, default=5.0)
    g.add_argument("--size", type=int, help="image side in pixels (default: the model's native resolution)")
    g.add_argument("--num", type=int, default=1, help="images, at seeds seed, seed+1, ...")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--out", default="outputs")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="print the adapter plan: slots, ranks, alphas, parameters, size")
    pl.add_argument("config", nargs="?", help="TOML config file")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--model", help="tiny-sdxl-demo, tiny-sdxl, arch:sdxl (SDXL base's structure, no weights), "
                                    "a folder or file")
    pl.add_argument("--layers", help="which layers get adapters: attn, cross-attn, topology, full or locon "
                                     "[adapter.preset]")
    pl.add_argument("--preset", action="append", metavar="NAME[,NAME]", help=PRESET_HELP)
    pl.add_argument("--rank", type=int, help="base rank [adapter.rank]")
    pl.add_argument("--resolution", type=int, help="training resolution [data.resolution]")
    pl.add_argument("--batch-size", type=int, help="images per step [train.batch_size]")
    pl.add_argument("--vram", type=float, help="plan the run to fit this much GPU memory, GiB [train.vram_gb]")
    pl.add_argument("--card", type=float, metavar="GB", help="plan for a card of this many GB, as a run on it "
                                                             "would plan itself (default: this machine's GPU)")
    pl.add_argument("-v", "--verbose", action="store_true", help="the adapter's layer table too")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_plan)

    ps = sub.add_parser("presets", help="every card preset's whole-run peak and time per image for this model, "
                                        "batch and resolution (no weights read), and the goal presets")
    ps.add_argument("config", nargs="?", help="TOML config file")
    ps.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ps.add_argument("--model", help="tiny-sdxl-demo, tiny-sdxl, arch:sdxl (SDXL base's structure), a folder or file")
    ps.add_argument("--layers", help="which layers get adapters [adapter.preset]")
    ps.add_argument("--preset", action="append", metavar="GOAL", help="a goal preset to plan the cards with")
    ps.add_argument("--rank", type=int, help="base rank [adapter.rank]")
    ps.add_argument("--resolution", type=int, help="training resolution [data.resolution]")
    ps.add_argument("--batch-size", type=int, help="images per step [train.batch_size]")
    ps.add_argument("--json", action="store_true", help="machine-readable output")
    ps.set_defaults(func=cmd_presets)

    d = sub.add_parser("dataset", help="dataset tools")
    dsub = d.add_subparsers(dest="dataset_command", required=True)
    di = dsub.add_parser("inspect", help="image count, caption coverage, bucket histogram, problems")
    di.add_argument("dirs", nargs="*", help="dataset folder(s); none: the config's [[data.datasets]] or data.dirs")
    di.add_argument("--config", help="TOML config whose [data] settings (and datasets) apply")
    di.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    di.add_argument("--resolution", type=int,
                    help="bucket resolution when the config sets none (default: the config's model's native one, "
                         "as training uses)")
    di.add_argument("--no-doctor", action="store_true",
                    help="leave out the doctor's checks (duplicates, trigger words, tags, small subjects, steps)")
    di.set_defaults(func=cmd_dataset_inspect)
    dc = dsub.add_parser("caption", help="write sidecar captions with a local image-to-text model (BLIP, ...)")
    dc.add_argument("dir", help="dataset folder (subfolders too)")
    dc.add_argument("--model", required=True, help="local transformers folder of the captioning model (never downloaded)")
    dc.add_argument("--caption-extension", default=".txt", help="extension of the caption files (default .txt)")
    dc.add_argument("--overwrite", action="store_true", help="replace captions that are already there")
    dc.add_argument("--prompt", help="text the caption starts from, for models that take one (BLIP: 'a photo of')")
    dc.add_argument("--prefix", default="", help="text put before every caption written (e.g. the trigger word)")
    dc.add_argument("--max-new-tokens", type=int, default=40, help="the longest caption, in tokens")
    dc.add_argument("--batch-size", type=int, default=4, help="images per model call")
    dc.add_argument("--device", default="cpu", help="cpu or cuda")
    dc.set_defaults(func=cmd_dataset_caption)
    from .sdxl.tagger import CHARACTER_THRESHOLD, GENERAL_THRESHOLD

    dt = dsub.add_parser("tag", help="write booru-style tag captions with a local WD14-style ONNX tagger")
    dt.add_argument("dir", help="dataset folder (subfolders too)")
    dt.add_argument("--tagger", required=True, help="local folder holding model.onnx and selected_tags.csv "
                                                    "(never downloaded)")
    dt.add_argument("--trigger", default="", help="the trigger word, put first in every caption written")
    dt.add_argument("--general-threshold", type=float, default=GENERAL_THRESHOLD,
                    help=f"the least probability of a general tag written (default {GENERAL_THRESHOLD})")
    dt.add_argument("--character-threshold", type=float, default=CHARACTER_THRESHOLD,
                    help=f"the least probability of a character tag written (default {CHARACTER_THRESHOLD})")
    dt.add_argument("--ratings", action="store_true", help="also write the likeliest rating tag (general, "
                                                           "sensitive, ...), first")
    dt.add_argument("--keep-underscores", action="store_true", help="write tags as the list spells them "
                                                                    "(long_hair), not with spaces")
    dt.add_argument("--caption-extension", default=".txt", help="extension of the caption files (default .txt)")
    dt.add_argument("--overwrite", action="store_true", help="replace captions that are already there")
    dt.add_argument("--batch-size", type=int, default=8, help="images per model call")
    dt.add_argument("--device", default="cpu", help="cpu or cuda (onnxruntime-gpu)")
    dt.set_defaults(func=cmd_dataset_tag)

    e = sub.add_parser("export", help="write an adapter as kohya (ComfyUI/A1111/Forge), diffusers or peft")
    e.add_argument("source", metavar="RUN_DIR_OR_FILE", help="a run folder, an adapter file or a PEFT folder")
    e.add_argument("--format", required=True, choices=["kohya", "diffusers", "peft"])
    e.add_argument("--out", required=True, help="the file to write (a folder for --format peft)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing file")
    e.add_argument("--no-metadata", action="store_true", help="write no ss_*/modelspec.* (or any) metadata")
    e.add_argument("--names", default="sgm", choices=["sgm", "diffusers"],
                   help="kohya layer names: SDXL's original (sgm, what A1111/ComfyUI expect) or diffusers' blocks")
    e.add_argument("--true-alpha", action="store_true",
                   help="kohya: keep each layer's training alpha instead of one alpha with the rest folded into the "
                        "weights (A1111/ComfyUI read both right; diffusers only the default)")
    e.add_argument("--model", help="the model the adapter's layer names refer to (default: the run's, or SDXL base)")
    e.add_argument("--drop-unknown", action="store_true", help="export even when some keys fit no layer of the model")
    e.set_defaults(func=cmd_export)

    r = sub.add_parser("resize", help="cut an adapter's ranks by SVD: a fixed rank, or per layer the fewest that keep "
                                      "a share of its update (LoHa/LoKr come out as LoRA); several adapters, each "
                                      "at a strength, resize into one")
    r.add_argument("source", metavar="RUN_DIR_OR_FILE[:STRENGTH]", nargs="+",
                   help="a run folder, an adapter file or a PEFT folder; several: their updates times their "
                        "strengths (default 1) are added layer by layer")
    r.add_argument("--rank", type=int, required=True,
                   help="the new rank (with --dynamic-method: the most any layer gets)")
    _svd_output_args(r)
    r.add_argument("--model", help="the model the adapter's layer names refer to (default: the run's, or SDXL base)")
    r.add_argument("--drop-unknown", action="store_true", help="resize even when some keys fit no layer of the model")
    r.set_defaults(func=cmd_resize)

    x = sub.add_parser("extract", help="a LoRA from a fine-tuned SDXL: each layer's difference from the base, "
                                       "cut by SVD to a rank")
    x.add_argument("--base", required=True, help="the model it was tuned from: diffusers folder, single file or "
                                                 "a built-in name")
    x.add_argument("--tuned", required=True, help="the fine-tuned (or merged) model, the same architecture")
    x.add_argument("--rank", type=int, required=True, help="the linears' rank (with --dynamic-method: the most)")
    x.add_argument("--conv-rank", type=int, help="the ResNet convolutions' rank (default: --rank)")
    x.add_argument("--preset", default="locon", choices=["attn", "cross-attn", "full", "locon"],
                   help="which UNet layers (docs/injector.md); locon: attention, feed-forward, proj and ResNet convs")
    x.add_argument("--no-text-encoders", action="store_true", help="the UNet's layers only")
    x.add_argument("--min-diff", type=float, default=0.0,
                   help="leave out layers whose difference is at most this share of the base weight's norm "
                        "(default 0: only equal layers)")
    _svd_output_args(x)
    x.set_defaults(func=cmd_extract)

    i = sub.add_parser("inspect", help="an adapter's format, base model, per-block rank and alpha, metadata, problems")
    i.add_argument("file", metavar="FILE", help="an adapter file, a PEFT folder or a run folder")
    i.add_argument("--model", help="the model the adapter's layer names refer to (default: the run's, or SDXL base)")
    i.set_defaults(func=cmd_inspect)

    m = sub.add_parser("merge", help="bake adapters into a full SDXL checkpoint (diffusers folder or single file)")
    m.add_argument("--model", required=True, help="base: diffusers SDXL folder, single-file .safetensors, tiny-sdxl-demo or tiny-sdxl")
    m.add_argument("--lora", action="append", required=True, metavar="FILE[:STRENGTH]",
                   help="adapter and its strength (default 1.0); repeatable, merged in order")
    m.add_argument("--out", required=True, help="a .safetensors path (single file) or a folder (diffusers)")
    m.add_argument("--tokenizer", help="folder with tokenizer/ and tokenizer_2/ (for a single-file base)")
    m.add_argument("--dtype", default="auto", choices=["auto", "fp16", "bf16", "fp32"],
                   help="weights of the result (auto: as the base stores them)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    m.add_argument("--as-trained", action="store_true",
                   help="for an adapter trained on a quantized base (QLoRA): merge into the base quantized the "
                        "same way and dequantized, the weights the adapter saw (docs/qlora.md)")
    m.set_defaults(func=cmd_merge)
    _add_llm_parser(sub)
    _add_ui_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    training.prefer_expandable_segments()  # before torch's first CUDA allocation
    training.setup_logging(args.verbose, diffusers=args.command != "llm")
    # Bad input prints its message (which carries the fix), no traceback; training.failure has the codes.
    return training.guarded(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
