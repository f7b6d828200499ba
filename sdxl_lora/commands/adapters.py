"""`sdxl-lora export | resize | extract | inspect | merge`: an adapter file (or run folder, or PEFT folder) read
against its model's layers and written, resized, extracted, inspected or baked into a checkpoint."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _adapter_source(source: str, model: str | None) -> tuple[Path, str | None]:
    """The adapter (file or PEFT folder) a path names, and the model its layer names refer to: a run
    folder gives its main adapter file and the model it was trained on."""
    p = Path(source)
    if p.is_dir() and (p / "config.toml").is_file():
        from ..core.config import load_config

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
    from ..core.config import load_config
    from ..sdxl.config import DEMO_NAME, TINY_NAME

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
    are written with alpha = rank whatever is asked (sdxl/formats/export.py: kohya_layers), so theirs is read as it is."""
    import json

    from safetensors import safe_open

    from ..sdxl.formats.export import AdapterError

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
    from ..sdxl.formats.export import AdapterError, layer_table, load_adapter

    src, model = _adapter_source(args.source if source is None else source, args.model)
    if redirect is not None:
        src = redirect(src)
    table = layer_table(model) if table is None else table
    adapter = load_adapter(src, table)
    if adapter.unknown and not args.drop_unknown:
        raise AdapterError(f"{src}: {adapter.problems[0]}; pass --drop-unknown to {verb} the other layers")
    return src, table, adapter


def cmd_export(args) -> int:
    from ..sdxl.formats.export import AdapterError, export_adapter
    from ..core.fsutil import relpath

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
        from ..sdxl.formats.loaders import file_notes

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
    from ..core.fsutil import relpath
    from ..sdxl.formats.export import AdapterError, check_dest, export_adapter
    from ..sdxl.formats.merge import parse_lora_arg
    from ..sdxl.formats.resize import provenance, resize_adapters

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
    from ..core.fsutil import relpath
    from ..sdxl.formats.export import AdapterError, check_dest, export_adapter, layer_table
    from ..sdxl.formats.extract import extract_adapter

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
    from ..sdxl.formats.export import AdapterError, inspect_adapter

    try:
        src, model = _adapter_source(args.file, args.model)
        _, text = inspect_adapter(src, model)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def cmd_merge(args) -> int:
    from ..sdxl.formats.export import AdapterError
    from ..sdxl.formats.merge import merge_checkpoint, parse_lora_arg
    from ..core.fsutil import relpath

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


def add_parsers(sub) -> None:
    """The adapter commands, in the order `sdxl-lora --help` lists them."""
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
