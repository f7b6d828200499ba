"""`sdxl-lora`: parses the command line, builds a config, calls the library. Nothing else lives here.

The entry (`main`, `build_parser`) and the train, generate, plan, presets, dataset and ui commands; the adapter
commands (export, resize, extract, inspect, merge) and `llm` are in sdxl_lora/commands/, with what they share."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import training

training.stay_offline()  # before anything imports transformers or diffusers

# The sub-command groups and what the commands share; imported after stay_offline, like everything else here.
from .commands import adapters, llm  # noqa: E402
from .commands.common import (PRESET_HELP, TRAIN_FLAGS, add_config_arguments, card_for,  # noqa: E402
                              config_from_args, preset_fields, resume_job, train_job)


def cmd_train(args) -> int:
    # The resumed run (its config and newest state, read and verified once) or the new run's config.
    job = resume_job(args) if args.resume else None
    cfg = job.cfg if job else config_from_args(args)
    if cfg.task == "llm":
        return llm.cmd_llm_train(args, job)  # the LLM command, same flags
    return train_job(job or training.new_job(cfg))


def cmd_generate(args) -> int:
    import torch

    from .sdxl.config import ModelConfig
    from .core.fsutil import check_destination
    from .core.fsutil import relpath
    from .sdxl.formats.merge import applied
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
    run = plan_run(cfg, card_for(args))
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


def _plan_config(args) -> "Config":  # noqa: F821
    """The config of a plan or presets command line: the CONFIG file, --set, then the flags."""
    from .core.config import load_config

    extra = {k: v for k, v in (("model.path", args.model), ("adapter.preset", getattr(args, "layers", None)),
                                ("adapter.rank", args.rank), ("data.resolution", args.resolution),
                                ("train.batch_size", args.batch_size), ("train.vram_gb", getattr(args, "vram", None)))
             if v is not None}
    extra.update(preset_fields(getattr(args, "preset", None)))
    return load_config(args.config, args.set, extra)


def _preset_report(cfg) -> dict[str, str]:
    """Each field the config's presets name, with its value in the config: the preset's, or yours where you set
    another (which wins)."""
    from .sdxl import presets

    out = {}
    for key, value in presets.settings(cfg.card, cfg.goal).items():
        section, field = key.split(".")
        now = getattr(getattr(cfg, section), field)
        out[key] = f"{now!r}" if now == value else f"{now!r} (yours; the preset says {value!r})"
    return out


def cmd_presets(args) -> int:
    import json

    from .sdxl import presets
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


def task_of(argv: list[str]) -> str:
    """The task a `train` command line would run (its config's, or the resumed run's): for launch scripts."""
    from .core.config import load_config

    args = build_parser().parse_args(["train", *argv])
    if args.resume:
        return load_config(training.find_run(args.resume, args.out) / "config.toml").task
    return config_from_args(args).task


def cmd_ui(args) -> int:
    from .ui.app import launch

    return launch(args)


def _add_ui_parser(sub) -> None:
    from .ui.app import add_arguments

    u = sub.add_parser("ui", help="the Gradio UI in your browser (http://127.0.0.1:7860 by default)")
    add_arguments(u)
    u.set_defaults(func=cmd_ui)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdxl-lora", description="Train LoRA adapters for SDXL, offline.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train an adapter (no arguments: the demo base, tiny-sdxl-demo, on sample_data/)")
    add_config_arguments(t, TRAIN_FLAGS, "train.lr=1e-4")
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

    adapters.add_parsers(sub)
    llm.add_parser(sub)
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
