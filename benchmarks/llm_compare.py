"""The LLM path against the tools LLM people use, on one GPU: this project's trainer, TRL's SFTTrainer with its
current defaults, and unsloth (or, where unsloth cannot run, TRL with Liger's kernels). Each contender trains
LoRA rank 16 on every linear layer of a random-weight model, for each base (bf16, nf4 QLoRA) and batch size,
in a subprocess of its own, so peaks and compile caches never mix. Prints one JSON line per (contender, base,
batch) and a markdown table.

  python3 benchmarks/llm_compare.py --json $OUT/llm_compare.jsonl      # H200: Llama-3-8B shapes, seq 2048
  python3 benchmarks/llm_compare.py --model-shape tiny --seq 128 --batches 1 --bases bf16 --steps 3 --warmup 1
                                                                       # CPU smoke test (seconds a run)
  python3 benchmarks/llm_compare.py --wheels-note                      # the wheels the GPU machine needs

What each contender runs (the same model folder, the same JSONL data, the same sequence length):
  ours          `sdxl-lora llm train` as a user runs it (cli.main in the worker): its defaults, plus rank 16 with
                adapter.preset="full" (every projection at one rank), model.quantize="nf4" for QLoRA, previews
                and checkpoints off, train.log_every=1 (one host read a step, as TRL's per-step metrics make too).
  ours-compile  the same with train.compile="regional" (not in the default grid: --only adds it).
  ours-ckpt     ours with train.gradient_checkpointing=true, as TRL's defaults checkpoint: the comparison at
                about TRL's memory (not in the default grid); ours-ckpt-compile adds train.compile="regional".
  ours-offload-compile  ours-ckpt-compile with llm.offload_activations=true: the checkpointed layers' inputs in
                host memory, as unsloth keeps them (not in the default grid).
  trl           SFTTrainer(model=FOLDER) with SFTConfig's defaults (its fused, chunked LM-head loss, gradient
                checkpointing, bf16 autocast, AdamW), plus packing=True, max_length=seq, the batch size, bf16
                weights (model_init_kwargs dtype; TRL loads fp32 otherwise), no saving, no reporting;
                peft LoraConfig(r=16, alpha=16, target_modules="all-linear"); QLoRA: BitsAndBytesConfig nf4,
                double quantization, bf16 compute. Packing "bfd" turns on padding-free batches.
  unsloth       FastLanguageModel.from_pretrained (load_in_4bit for nf4) and get_peft_model (r=16 on q/k/v/o/
                gate/up/down, use_gradient_checkpointing="unsloth"), trained by unsloth's patched SFTTrainer with
                the trl settings above. Probed first in a subprocess; if `import unsloth` fails, its exact error
                is reported and "liger" runs in its place:
  liger         trl with use_liger_kernel=True (Liger's RMSNorm, RoPE and SwiGLU kernels; TRL keeps its own
                fused LM-head loss); skipped, with liger_kernel's import error, if that fails too.

Figures per run: tokens/s over the steps after --warmup (tokens are every non-padding token the step trains on;
the examples are longer than --seq, so every row is full for every contender: tokens_per_step shows it), the
peak of torch's allocator (max_memory_allocated, and reserved; each pool's peaks; the segments left mapped at the
end, by stream and pool), the whole process's peak from nvidia-smi (CUDA context included), and the seconds from
launching the worker to the end of its first optimizer step (imports, loading, quantizing, data, compilation;
ours also measures the loss before training).

Time on the H200 (8B shapes, seq 2048, default --steps 5 --warmup 2): the model folder is written once
(random bf16 weights, about a minute; reused while --work survives, e.g. on a warm machine); each run is
dominated by loading the 16 GB base (plus quantizing for nf4) and takes roughly 30-60 s, so the default grid
(3 contenders x 2 bases x 2 batches) is near the 10-minute limit of one call. --deadline (default 560 s on a GPU)
stops launching runs in time and says which were skipped; --json keeps each line as it comes. To split it, run
`--bases bf16` in one call and `--bases nf4` in the next (the folder is reused on a warm machine). The order is
batch 4 first (the issue's goals are at batch 4), then bf16 before nf4, all contenders of a cell together.
`--repeat N` runs each cell's contenders N times in turns (rows carry "turn"): two contenders minutes apart on
one machine can differ by a few percent between runs of the same code, so a close race needs several turns.

Wheels: the GPU machine (Python 3.12, torch 2.11, transformers 5.17, peft, accelerate, pandas, pyarrow,
xxhash, psutil already there) lacks, beside the project's set (`../shared/gpu/fetch-wheels.sh`: diffusers,
bitsandbytes, pydantic...):
  trl and liger   `../shared/gpu/fetch-wheels.sh pydantic pydantic-core annotated-types typing-inspection tomli_w
                  typing_extensions trl==1.16.0 datasets dill multiprocess liger-kernel` (about 3 MB more;
                  datasets 5.x wants pyarrow>=24: check `pip show pyarrow` there, carry pyarrow if older).
  unsloth         needs trl<=1.15.0 and datasets<5, so it gets its own folder, installed apart and named with
                  --unsloth-site (only the unsloth worker sees it): unsloth unsloth_zoo trl==1.15.0 "datasets<5"
                  tyro docstring-parser typeguard shtab msgspec cut_cross_entropy torchao hf_transfer json5
                  nest-asyncio structlog (about 40 MB, unsloth's wheel alone 29 MB). With the project's wheels and
                  the tree that is over one call's 64 MiB: run unsloth in a call of its own (`--only unsloth`,
                  the project's wheels left out but bitsandbytes), or see its import error first with
                  `--only unsloth --steps 0` (probe only). xformers is left out (large, built per torch version);
                  unsloth says whether it runs without it.
`--wheels-note` prints these lines. Nothing here reaches the network: the model, tokenizer and data are made here,
and the workers run with the Hugging Face libraries offline.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from llm_step import LINEARS, LLAMA3_8B, TINY, build_model
from train_e2e import MemorySampler

REPO = Path(__file__).resolve().parent.parent
SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}
OURS = ("ours", "ours-compile", "ours-ckpt", "ours-ckpt-compile", "ours-offload-compile")
CONTENDERS = (*OURS, "trl", "unsloth", "liger")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
WORDS = ("river stone garden lamp orbit violin maple signal harbor copper lantern meadow cipher glacier "
         "thunder pepper compass marble falcon velvet canyon ember quartz willow nebula saddle tundra").split()


# ---- the inputs, made once under --work ----
def model_folder(args) -> Path:
    """A transformers folder of the chosen shape with random bf16 weights (safetensors) and a small BPE
    tokenizer with a chat template, built once in a worker (the parent never touches the GPU)."""
    dest = Path(args.work) / f"llama-{args.model_shape}-random"
    if not (dest / "config.json").is_file():
        worker = subprocess.run([sys.executable, __file__, "--worker", "build", *_common(args)],
                                env={**os.environ, **OFFLINE})
        if worker.returncode:
            raise SystemExit(f"building the model folder {dest} failed (exit {worker.returncode})")
    return dest


def build_folder(args) -> None:
    import torch

    from sdxl_lora.core.fsutil import build_folder_once
    from sdxl_lora.llm.tiny import build_tokenizer

    shape = SHAPES[args.model_shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def build(scratch: Path, out: Path) -> None:
        tokenizer = build_tokenizer(out)
        tokenizer.model_max_length = shape["max_position_embeddings"]
        tokenizer.save_pretrained(str(out))
        model = build_model(shape, device, "bf16")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(model.config, key, getattr(tokenizer, key))
            setattr(model.generation_config, key, getattr(tokenizer, key))
        model.save_pretrained(str(out), safe_serialization=True)

    build_folder_once(Path(args.work) / f"llama-{args.model_shape}-random", build, "config.json")


def chat_data(args, folder: Path) -> Path:
    """Synthetic chat lines (a short question, a long answer of random words), each longer than --seq once
    rendered with the chat template, so every contender's rows are full: enough for the largest batch. With
    --mixed-lengths each line is instead about a length drawn evenly from 64 to --seq tokens (packing off,
    rows then vary)."""
    from transformers import AutoTokenizer

    mixed = args.mixed_lengths
    path = Path(args.work) / f"chat-{args.model_shape}-{args.seq}{'-mixed' if mixed else ''}.jsonl"
    rows = max(args.batches) * (args.warmup + args.steps) + 8
    if path.is_file() and sum(1 for _ in path.open()) >= rows:
        return path
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        words = []
        msgs = []
        target = rng.randint(64, args.seq) if mixed else args.seq + 16
        while True:
            words += rng.choices(WORDS, k=max(16, target // 8) if mixed else max(64, args.seq // 4))
            msgs = [{"role": "user", "content": f"Tell me about {rng.choice(WORDS)} number {i}."},
                    {"role": "assistant", "content": " ".join(words)}]
            text = tok.apply_chat_template(msgs, tokenize=False)
            if len(tok(text, add_special_tokens=False)["input_ids"]) > target:
                break
        lines.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- the workers: one contender, one base, one batch size, in a process of its own ----
def _cuda_figures(result: dict) -> dict:
    import torch

    if torch.cuda.is_available():
        result["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        # Where the reserve over the allocated peak sits: each pool's peaks (the small pool holds tensors of
        # 1 MiB or less), and the free bytes inside partly used blocks (fragmentation) at their peak.
        stats = torch.cuda.memory_stats()
        result["pools_peak_gib"] = {f"{kind}_{pool}": round(stats.get(f"{kind}_bytes.{pool}_pool.peak", 0) / 2**30, 3)
                                    for kind in ("allocated", "reserved") for pool in ("large", "small")}
        result["pools_peak_gib"]["inactive_split"] = round(stats.get("inactive_split_bytes.all.peak", 0) / 2**30, 3)
        # The segments the run leaves mapped (nothing here empties the cache, so they are what its peak
        # mapped), by the stream that allocated them and the pool: a stream of their own, or large free
        # stretches in the compute stream's, is where the reserve went.
        segments: dict[str, list[float]] = {}
        for seg in torch.cuda.memory_snapshot():
            key = f"stream {seg['stream']} {seg['segment_type']}"
            n, total, used = segments.get(key, [0, 0.0, 0.0])
            segments[key] = [n + 1, total + seg["total_size"] / 2**30, used + seg["allocated_size"] / 2**30]
        result["segments_gib"] = {k: [n, round(t, 3), round(u, 3)] for k, (n, t, u) in segments.items()}
        result["device"] = torch.cuda.get_device_name()
    else:
        result["device"] = "cpu"
    return result


def _versions(*names: str) -> dict:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_ours(args, compile_layers: bool, checkpointing: bool = False, offload: bool = False) -> dict:
    """`sdxl-lora llm train` in this process; tokens/s from its step events (each step logged)."""
    import shutil

    from sdxl_lora import cli
    from sdxl_lora.core.runs import read_events

    name = f"{args.worker}-{args.base}-b{args.batch}"
    runs = Path(args.work) / "runs"
    shutil.rmtree(runs / name, ignore_errors=True)
    sets = ["adapter.preset='full'", "llm.preview_prompts=[]", "train.log_every=1", "train.save_every=0",
            "train.save_every_minutes=0"]
    if args.base == "nf4":
        sets.append("model.quantize='nf4'")
    if compile_layers:
        sets.append("train.compile='regional'")
    if checkpointing or offload:
        sets.append("train.gradient_checkpointing=true")
    if offload:
        sets.append("llm.offload_activations=true")
    argv = ["llm", "train", "--model", args.folder, "--data", args.data, "--steps", str(args.warmup + args.steps),
            "--rank", "16", "--batch-size", str(args.batch), "--max-length", str(args.seq), "--out", str(runs),
            "--name", name] + [x for s in sets + list(args.set) for x in ("--set", s)]
    rc = cli.main(argv)
    if rc:
        raise RuntimeError(f"sdxl-lora {' '.join(argv)} exited {rc}")
    steps = [e for e in read_events(runs / name / "events.jsonl") if e["event"] == "step"]
    # Each window's rate times its length is its tokens: the steady rate over the steps after warm-up.
    timed = [(b["tokens_per_s"], b["time"] - a["time"]) for a, b in zip(steps, steps[1:]) if b["step"] > args.warmup]
    seconds, tokens = sum(d for _, d in timed), sum(r * d for r, d in timed)
    return {"tokens_per_s": tokens / seconds if seconds > 0 else math.nan, "tokens_per_step": round(tokens / len(timed)),
            "first_step_s": steps[0]["time"] - args.launch, "loss": steps[-1]["loss"],
            "versions": _versions("torch", "transformers", "peft", "accelerate", "bitsandbytes")}


def run_sft(args, kind: str) -> dict:
    """TRL's SFTTrainer ("trl", "liger") or unsloth's patched one ("unsloth"); a callback times the steps."""
    if kind == "unsloth":
        import unsloth  # noqa: F401 - first, so that it patches transformers and trl before they load
    import torch
    from datasets import load_dataset
    from transformers import BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU: fp32, as ours trains there
    nf4 = args.base == "nf4"
    dataset = load_dataset("json", data_files=args.data, split="train")
    config = SFTConfig(output_dir=str(Path(args.work) / f"{kind}-{args.base}-b{args.batch}"),
                       max_steps=args.warmup + args.steps, per_device_train_batch_size=args.batch,
                       max_length=args.seq, packing=True, bf16=cuda, report_to="none", save_strategy="no",
                       model_init_kwargs={"dtype": dtype}, use_liger_kernel=kind == "liger", seed=0,
                       # unsloth's patched SFTConfig defaults to 2: every contender steps on one batch.
                       gradient_accumulation_steps=1,
                       # unsloth's patched trainer leaves TRL's own token count at 0: the Trainer's is counted too.
                       include_num_input_tokens_seen="non_padding")

    class StepClock(TrainerCallback):
        """The wall time and TRL's running token count at the end of each optimizer step."""
        def __init__(self):
            self.trainer, self.marks = None, []

        def on_step_end(self, args_, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append((time.time(), getattr(self.trainer, "_total_train_tokens", 0)
                               or state.num_input_tokens_seen))

    clock = StepClock()
    if kind == "unsloth":
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(model_name=args.folder, max_seq_length=args.seq,
                                                             dtype=dtype, load_in_4bit=nf4)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=LINEARS, use_gradient_checkpointing="unsloth",
                                                 random_state=0)
        trainer = SFTTrainer(model=model, processing_class=tokenizer, args=config, train_dataset=dataset,
                             callbacks=[clock])
    else:
        from peft import LoraConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16) if nf4 else None
        trainer = SFTTrainer(model=args.folder, args=config, train_dataset=dataset, quantization_config=quant,
                             peft_config=LoraConfig(r=16, lora_alpha=16, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"),
                             callbacks=[clock])
    clock.trainer = trainer
    mean_loss = trainer.train().training_loss
    marks = clock.marks
    (t0, n0), (t1, n1) = marks[args.warmup - 1], marks[-1]
    # TRL logs the loss every logging_steps (10 by default): the last logged one, else the run's mean.
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else math.nan,
            "tokens_per_step": round((n1 - n0) / (len(marks) - args.warmup)), "first_step_s": marks[0][0] - args.launch,
            "loss": losses[-1] if losses else mean_loss,
            # What the trainer stepped with: unsloth's patched SFTConfig changes TRL's defaults (it did for
            # gradient accumulation), and an 8-bit optimizer's state is a quarter of AdamW's.
            "optim": str(trainer.args.optim), "adapter_dtype": str(next(
                p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad)),
            "versions": _versions("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets",
                                  "liger-kernel", "unsloth", "unsloth_zoo")}


def probe(module: str) -> str | None:
    """None if `module` imports in a fresh process (with unsloth's site for unsloth), else its exact error."""
    code = (f"import {module}" if module != "liger_kernel" else
            "import liger_kernel.transformers; from transformers.utils import is_liger_kernel_available as a; "
            "assert a(), 'transformers does not see liger_kernel'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(module))
    if out.returncode == 0:
        return None
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {out.returncode}"


def _env(contender: str) -> dict:
    env = {**os.environ, **OFFLINE}
    site = os.environ.get("LLM_COMPARE_UNSLOTH_SITE")
    if contender == "unsloth" and site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _common(args) -> list[str]:
    return ["--model-shape", args.model_shape, "--seq", str(args.seq), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--work", args.work, "--batches", *map(str, args.batches),
            *(x for s in args.set for x in ("--set", s))]


def worker(args) -> None:
    if args.worker == "build":
        build_folder(args)
        return
    result = {}
    try:
        if args.worker in OURS:
            result = run_ours(args, compile_layers=args.worker.endswith("compile"),
                              checkpointing="ckpt" in args.worker, offload="offload" in args.worker)
        else:
            result = run_sft(args, args.worker)
    except BaseException as e:  # noqa: BLE001 - the parent reports it beside the other runs
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"[:2000]}
    Path(args.result).write_text(json.dumps(_cuda_figures(result)), encoding="utf-8")


# ---- the parent: the grid, a subprocess per run ----
def run_one(args, contender: str, base: str, batch: int, deadline: float) -> dict:
    work = Path(args.work)
    tag = f"{contender}-{base}-b{batch}"
    result_path, log_path = work / f"{tag}.json", work / f"{tag}.log"
    result_path.unlink(missing_ok=True)
    row = {"contender": contender, "base": base, "batch": batch, "seq": args.seq, "model": args.model_shape,
           "steps": args.steps, "warmup": args.warmup}
    if args.set and contender in OURS:
        row["set"] = list(args.set)
    launch = time.time()
    cmd = [sys.executable, __file__, "--worker", contender, "--base", base, "--batch", str(batch),
           "--launch", str(launch), "--result", str(result_path), "--folder", str(args.folder),
           "--data", str(args.data), *_common(args)]
    with MemorySampler() as mem, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(contender), cwd=REPO)
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            row["error"] = "stopped at --deadline"
    row["wall_s"] = round(time.time() - launch, 1)
    row["smi_peak_gib"] = mem.peak()
    if result_path.is_file():
        row.update(json.loads(result_path.read_text()))
    elif "error" not in row:
        row["error"] = f"worker exited {proc.returncode} with no result"
    if "error" in row:
        row["log_tail"] = log_path.read_text(errors="replace")[-1500:]
    for k in ("tokens_per_s", "first_step_s", "loss"):
        if isinstance(row.get(k), float):
            row[k] = round(row[k], 3 if k == "loss" else 1)
    return row


def table(rows: list[dict], notes: list[str]) -> str:
    """Markdown: per cell (base, batch) each contender, with tokens/s and torch peak against TRL's."""
    def cell(r, k, fmt):
        v = r.get(k)
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    out = ["| base | batch | contender | tok/s | vs trl | peak GiB (torch) | vs trl | peak GiB (nvidia-smi) "
           "| first step s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        trl = next((t for t in rows if t["contender"] == "trl" and t["base"] == r["base"] and t["batch"] == r["batch"]
                    and "error" not in t), None)
        if "error" in r:
            out.append(f"| {r['base']} | {r['batch']} | {r['contender']} | {r['error'][:80]} | | | | | |")
            continue
        speed = f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}x" if trl and trl.get("tokens_per_s") else "—"
        mem = (f"{r['peak_alloc_gib'] / trl['peak_alloc_gib']:.2f}x"
               if trl and r.get("peak_alloc_gib") and trl.get("peak_alloc_gib") else "—")
        out.append(f"| {r['base']} | {r['batch']} | {r['contender']} | {cell(r, 'tokens_per_s', ',.0f')} | {speed} | "
                   f"{cell(r, 'peak_alloc_gib', '.1f')} | {mem} | {cell(r, 'smi_peak_gib', '.1f')} | "
                   f"{cell(r, 'first_step_s', '.0f')} |")
    return "\n".join(out + [""] + notes)


def wheels_note() -> str:
    doc = __doc__
    return doc[doc.index("Wheels:"):doc.index("`--wheels-note`")].rstrip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per row")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--bases", nargs="+", choices=["bf16", "nf4"], default=["bf16", "nf4"])
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps after the warm-up (0: probe only)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s (allocation, compilation)")
    ap.add_argument("--only", nargs="+", choices=CONTENDERS, default=["ours", "trl", "unsloth"],
                    help="contenders; unsloth runs liger in its place where it does not import")
    ap.add_argument("--repeat", type=int, default=1, help="run every contender this many times, in turns "
                    "(ours, unsloth, ours, unsloth, ...), so runs minutes apart on one machine can be told from noise")
    ap.add_argument("--mixed-lengths", action="store_true", help="rows of lengths drawn evenly from 64 to --seq "
                                                                   "tokens instead of full ones (for packing off)")
    ap.add_argument("--json", help="append each run's JSON line to this file as it finishes")
    ap.add_argument("--set", action="append", default=[], help="another override for ours (an `sdxl-lora llm "
                    "train --set`, e.g. llm.loss_chunk=256); the other contenders ignore it")
    ap.add_argument("--work", default="/tmp/llm_compare", help="model folder, data, runs and logs")
    ap.add_argument("--deadline", type=float, help="seconds from start after which no run starts and a running "
                    "one is stopped (default 560 on a GPU, none on a CPU)")
    ap.add_argument("--unsloth-site", help="a folder of packages (pip --target) that only unsloth's worker sees")
    ap.add_argument("--wheels-note", action="store_true", help="print the wheels the GPU machine needs, and exit")
    for name, kw in (("--worker", {}), ("--base", {}), ("--batch", {"type": int}), ("--launch", {"type": float}),
                     ("--result", {}), ("--folder", {}), ("--data", {})):
        ap.add_argument(name, help=argparse.SUPPRESS, **kw)
    args = ap.parse_args()
    if args.warmup < 1:
        ap.error("--warmup must be at least 1: the first step holds the set-up, and tokens/s counts from a step's end")
    if args.wheels_note:
        print(wheels_note())
        return
    if args.worker:
        worker(args)
        return

    import torch

    started = time.time()
    cuda = torch.cuda.is_available()  # the parent only asks; the workers use the GPU
    deadline = started + (args.deadline if args.deadline is not None else (560 if cuda else math.inf))
    if args.unsloth_site:
        os.environ["LLM_COMPARE_UNSLOTH_SITE"] = str(Path(args.unsloth_site).resolve())
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.folder = model_folder(args)
    args.data = chat_data(args, args.folder)
    notes = []
    contenders = list(args.only)
    if "unsloth" in contenders:
        why = probe("unsloth")
        if why:
            notes.append(f"unsloth cannot run here: `import unsloth` fails with: {why}"
                         + ("" if cuda else " (and this machine has no CUDA GPU, which unsloth requires)"))
            liger = probe("liger_kernel")
            contenders.remove("unsloth")
            if liger is None:
                notes.append("in its place: liger (TRL with use_liger_kernel=True)")
                if "liger" not in contenders:
                    contenders.append("liger")
            else:
                notes.append(f"liger cannot stand in either: {liger}")
    for n in notes:
        print(f"# {n}", flush=True)
    rows = []
    for batch in args.batches if args.steps else []:
        for base, turn, contender in ((b, t, c) for b in args.bases for t in range(args.repeat) for c in contenders):
            if base == "nf4" and not cuda:
                row = {"contender": contender, "base": base, "batch": batch, "error": "nf4 needs a CUDA GPU"}
            elif time.time() >= deadline:
                row = {"contender": contender, "base": base, "batch": batch, "error": "skipped: past --deadline"}
            else:
                row = run_one(args, contender, base, batch, deadline)
            if args.repeat > 1:
                row["turn"] = turn + 1
            rows.append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print()
    print(f"# LoRA/QLoRA rank 16 on every linear layer, {args.model_shape} (random weights), seq {args.seq}, {device}; "
          f"{args.steps} timed steps after {args.warmup} warm-up, {time.time() - started:.0f} s in all")
    print()
    print(table(rows, [f"- {n}" for n in notes]))


if __name__ == "__main__":
    main()
