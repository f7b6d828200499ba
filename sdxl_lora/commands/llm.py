"""`sdxl-lora llm train | plan | generate | merge`: the causal-LM path (docs/llm.md)."""
from __future__ import annotations

import logging
from pathlib import Path

from .. import training
from .common import add_config_arguments, card_for, config_from_args, resume_job, train_job

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


def llm_config_from_args(args) -> "Config":  # noqa: F821
    """The config of an `llm train` or `llm plan` command line (task="llm")."""
    return config_from_args(args, LLM_FLAGS, task="llm")


def cmd_llm_plan(args) -> int:
    """The adapter plan for a causal LM, from its config.json alone (the model is built on the meta device:
    no weights read), and the frozen weights, adapter, gradients, optimizer state and activations it implies;
    with train.vram_gb, the settings the budget chose."""
    import json

    from ..core import inject
    from ..core.memory import GiB
    from ..llm.memory import config_memory, fit_budget, fit_card, format_activations
    from ..llm.model import check_causal_lm_folder, resolve_llm_path

    cfg = llm_config_from_args(args)
    config = check_causal_lm_folder(resolve_llm_path(cfg.model), weights=False)
    choices, card, fit, given = None, card_for(args), None, bool(cfg.train.vram_gb)
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
        job = resumed or resume_job(args)
        if job.cfg.task != "llm":
            raise FileNotFoundError(f"--resume {job.run.dir}: an SDXL run; resume it with `sdxl-lora train --resume`")
    else:
        job = training.new_job(llm_config_from_args(args))
    return train_job(job)


def _adapter_base(adapter: Path, model: str | None) -> tuple[Path, tuple]:
    """The base model folder (given, or the one the adapter names) and the quantization it trained with."""
    from safetensors import safe_open

    from ..llm.config import TINY_LLM, ModelConfig
    from ..llm.export import ADAPTER_WEIGHTS, read_adapter_config
    from ..llm.model import resolve_llm_path

    base = model or read_adapter_config(adapter).get("base_model_name_or_path") or TINY_LLM
    with safe_open(str(adapter / ADAPTER_WEIGHTS), "pt") as f:
        meta = f.metadata() or {}
    q = meta.get("sdxl_lora.quantize", "none")
    opts = {"double_quant": meta.get("sdxl_lora.quant_double", "True") == "True"}
    return resolve_llm_path(ModelConfig(path=base)), ((None if q == "none" else q), opts if q != "none" else {})


def cmd_llm_generate(args) -> int:
    import torch

    from ..llm.config import TINY_LLM, LLMConfig, ModelConfig
    from ..llm.data import chat_template
    from ..llm.export import adapter_folder, load_with_adapter
    from ..llm.model import check_causal_lm_folder, load_tokenizer, resolve_llm_path
    from ..llm.preview import answer

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if args.adapter:
        adapter = adapter_folder(args.adapter)
        base, _ = _adapter_base(adapter, args.model)
        model, tok = load_with_adapter(base, adapter, dtype, device)
    else:
        from transformers import AutoModelForCausalLM

        base = resolve_llm_path(ModelConfig(path=args.model or TINY_LLM))
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

    from ..llm.export import adapter_folder, merge_adapter
    from ..core.fsutil import relpath

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


def add_parser(sub) -> None:
    """`llm` and its sub-commands."""
    lp = sub.add_parser("llm", help="LoRA/QLoRA for causal language models (docs/llm.md)")
    lsub = lp.add_subparsers(dest="llm_command", required=True)
    t = lsub.add_parser("train", help="train an adapter (no arguments: the embedded tiny Llama on sample_data/llm)")
    add_config_arguments(t, LLM_FLAGS, "llm.max_length=1024")
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
