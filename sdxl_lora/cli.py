"""`sdxl-lora`: parses the command line, builds a config, calls the library. Nothing else lives here."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# Offline by contract: no library may try a hub, whatever the user's environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Each flag is a shortcut for one config field; the default lives in the schema, not here.
TRAIN_FLAGS = [
    ("--model", "model.path", str, "diffusers SDXL folder, single-file .safetensors, or tiny-sdxl"),
    ("--data", "data.dirs", str, "dataset folder (repeat for several)"),
    ("--steps", "train.steps", int, "optimizer steps"),
    ("--resolution", "data.resolution", int, "training resolution (side of the square of equal area)"),
    ("--rank", "adapter.rank", int, "LoRA rank"),
    ("--batch-size", "train.batch_size", int, "images per step"),
    ("--out", "output.runs_dir", str, "folder that holds the runs"),
    ("--name", "output.name", str, "run name (folder under --out)"),
    ("--seed", "train.seed", int, "random seed"),
    ("--device", "train.device", str, "cpu, cuda or auto"),
]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    from diffusers.utils import logging as dlog
    dlog.disable_progress_bar()


def _config_from_args(args) -> "Config":  # noqa: F821
    from .config import load_config

    extra = {}
    for flag, field, _, _ in TRAIN_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        extra[field] = value if field != "data.dirs" else list(value)
    if getattr(args, "overwrite", False):
        extra["output.overwrite"] = True
    return load_config(args.config, args.set, extra)


def cmd_train(args) -> int:
    from .runs import attach_log_file, create_run, relpath
    from .sdxl.task import SDXLTask
    from .train import Trainer

    cfg = _config_from_args(args)
    run = create_run(cfg)
    attach_log_file(run)
    logging.getLogger(__name__).info("run folder: %s", run.dir)
    trainer = Trainer(cfg, SDXLTask(cfg), run)
    trainer.setup()
    result = trainer.fit()
    if not trainer.accelerator.is_main_process:
        return 0
    print()
    print(f"run folder : {relpath(run.dir)}")
    for kind, path in result.adapter.items():
        print(f"adapter    : {relpath(path)}  ({kind} format)")
    grids = [p for p in result.samples if p.name.endswith("grid.png")]
    for g in grids:
        print(f"previews   : {relpath(g)}")
    print(f"eval loss  : {result.eval_before:.4f} before -> {result.eval_after:.4f} after "
          "(training images, fixed timesteps and noise)")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .config import ModelConfig
    from .runs import relpath
    from .sdxl.model import load_pipeline, native_resolution
    from .sdxl.preview import grid, render, save_png

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    pipe = load_pipeline(ModelConfig(path=args.model, tokenizer=args.tokenizer), torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=False)
    for i, lora in enumerate(args.lora or []):
        lp = Path(lora)
        if not lp.is_file():
            raise FileNotFoundError(f"--lora {lora}: no such file")
        pipe.load_lora_weights(str(lp), adapter_name=f"lora{i}")
    if args.lora:
        scales = args.scale or [1.0]
        if len(scales) == 1:
            scales = scales * len(args.lora)
        if len(scales) != len(args.lora):
            raise ValueError(f"--scale given {len(scales)} times for {len(args.lora)} --lora files; give one or one each")
        pipe.set_adapters([f"lora{i}" for i in range(len(args.lora))], adapter_weights=scales)
    size = args.size or native_resolution(pipe)
    images = render(pipe, [args.prompt] * args.num, seed=args.seed, steps=args.steps, guidance=args.guidance,
                    width=size, height=size, negative=args.negative)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        path = out / f"seed{args.seed + i}.png"
        if path.exists() and not args.overwrite:
            raise FileExistsError(f"{path} exists; choose another --out or pass --overwrite")
        save_png(im, path)
        print(f"image: {relpath(path)}")
    if len(images) > 1:
        save_png(grid(images), out / f"seed{args.seed}-grid.png")
    return 0


def cmd_dataset_inspect(args) -> int:
    from .config import load_config
    from .sdxl.data import inspect_text

    cfg = load_config(args.config, args.set, {"data.dirs": list(args.dirs)})
    resolution = cfg.data.resolution or args.resolution
    print(inspect_text(cfg.data, resolution))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdxl-lora", description="Train LoRA adapters for SDXL, offline.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train an adapter (no arguments: the embedded tiny SDXL on sample_data/)")
    t.add_argument("config", nargs="?", help="TOML config file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=1e-4 (repeatable)")
    for flag, field, typ, help_ in TRAIN_FLAGS:
        kw = {"action": "append"} if field == "data.dirs" else {}
        t.add_argument(flag, type=typ, help=f"{help_} [{field}]", **kw)
    t.add_argument("--overwrite", action="store_true", help="replace an existing run folder of the same name")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="render images with a base model and LoRA adapters")
    g.add_argument("--model", default="tiny-sdxl")
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

    d = sub.add_parser("dataset", help="dataset tools")
    dsub = d.add_subparsers(dest="dataset_command", required=True)
    di = dsub.add_parser("inspect", help="image count, caption coverage, bucket histogram, problems")
    di.add_argument("dirs", nargs="+", help="dataset folder(s)")
    di.add_argument("--config", help="TOML config whose [data] settings apply")
    di.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    di.add_argument("--resolution", type=int, default=1024,
                    help="bucket resolution when the config sets none (default 1024, SDXL's)")
    di.set_defaults(func=cmd_dataset_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .sdxl.data import DataError
    from .sdxl.model import ModelError
    from .sdxl.single_file import SingleFileError

    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    # The errors we raise for bad input carry the fix in their message: print it, no traceback.
    except (ConfigError, DataError, ModelError, SingleFileError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
