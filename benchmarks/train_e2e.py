"""`sdxl-lora train` end to end, as a user runs it: a full-size SDXL diffusers folder (SDXL base's real
configs, random weights: the same FLOPs and memory as the real model) and a captioned dataset in several
aspect buckets, trained through the CLI in a subprocess, previews and evaluation on, the defaults unless
a setting says otherwise.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults recipe --batch 4 --steps 60

For each setting it reports, from the run's events.jsonl and a sampler of the GPU's memory in use (the
whole process: CUDA context, caches, graphs, everything):
  launch->step1   seconds from starting the process to the end of the first training step
  log marks       seconds from the launch to the run log's lines of the launch's steps (the run folder, the
                  dataset report, the adapter plan, the FLOP count, the first CUDA graph capture, ...)
  setup phases    seconds spent loading + caching, in the step-0 previews and eval, compiling (first steps)
  images/s        steady throughput: the step events after the first `--warmup` steps
  peak GiB        the GPU memory in use at its highest, for the whole run and for each phase
  previews %      the share of the run's wall time spent rendering previews
  checkpointing   what train.checkpoint_budget_gb checkpointed (units, share of the forward recomputed), and any
                  micro-batch split: what the planner's time model is fitted against

Settings (each a list of `--set` overrides on top of the defaults):
  defaults  nothing: what `sdxl-lora train --model M --data D --batch-size B` does
  best      train.cuda_graphs, train.compile="regional", train.channels_last all on
  eager     train.speed="off": no CUDA graphs, no compilation, no channels_last (the levers that stay
            on by default, fuse_qkv, lora_matmul, fused_geglu, stay on)
  recipe    train.speed="off" and fuse_qkv, fused_geglu off, lora_matmul "peft": peft's LoRA on diffusers'
            UNet, as the diffusers training example runs it
  qlora     model.quantize="nf4"
  ckpt, fp8 train.gradient_checkpointing=true; model.quantize="fp8": levers set by hand, to compare with what the
            planner picks for a card (--card)
  one-bucket the defaults on the square images only
  dora, locon, loha, lokr
            the defaults with adapter.kind="dora", adapter.preset="locon", kind="loha", kind="lokr": the
            adapter kinds beside `defaults` (plain LoRA)
  vram8, vram12, vram24
            the defaults under a memory budget (train.vram_gb = 8, 12, 24): the run plans its levers to fit
            and caps torch's allocator; reported beside the run's own estimate of each phase

--again runs each setting twice (the second launch finds inductor's and the latents' caches warm); --profile
runs the CLI under cProfile (the top functions by cumulative time beside each run's log).
--card N caps the CLI's process to an N GiB card before it starts (the run plans for the card it finds, as on a
card of that size); --cells SETTING:BATCH[xACCUM][@CARD] ... runs a matrix of such cells (a refusal at start is a
result; xM: M batches accumulated a step, set by hand).
--tiny builds the embedded tiny SDXL instead (the CPU smoke test of this script).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The CLI under a cap of torch's allocator that leaves a card of {gib} GiB for the whole process (the CUDA context
# outside the allocator: core/memory.py's CAP_CONTEXT), as train.vram_gb caps it, but set before the run starts.
# The allocator's options are set first, as the CLI sets them before torch's first CUDA call.
CARD_LAUNCHER = ("import sys; from sdxl_lora.core.allocator import prefer_expandable_segments; "
                 "prefer_expandable_segments(); import torch; from sdxl_lora.core.memory import CAP_CONTEXT; "
                 "total = torch.cuda.mem_get_info(0)[1]; "
                 "torch.cuda.set_per_process_memory_fraction(({gib} * 2**30 - CAP_CONTEXT) / total, 0); "
                 "sys.argv[0] = 'sdxl-lora'; from sdxl_lora.cli import main; sys.exit(main())")
SDXL_CONFIGS = REPO / "sdxl_lora" / "assets" / "sdxl-base"
DEMO = REPO / "sdxl_lora" / "assets" / "tiny-sdxl-demo"

SETTINGS = {
    "defaults": [],
    "best": ["train.cuda_graphs=true", "train.compile='regional'", "train.channels_last=true"],
    "eager": ["train.speed='off'"],
    "recipe": ["train.speed='off'", "train.fuse_qkv=false", "train.fused_geglu=false", "train.lora_matmul='peft'"],
    "qlora": ["model.quantize='nf4'"],
    "ckpt": ["train.gradient_checkpointing=true"],
    "fp8": ["model.quantize='fp8'"],
    "one-bucket": [],
    "dora": ["adapter.kind='dora'"],
    "locon": ["adapter.preset='locon'"],
    "loha": ["adapter.kind='loha'"],
    "lokr": ["adapter.kind='lokr'"],
    "vram8": ["train.vram_gb=8"],
    "vram12": ["train.vram_gb=12"],
    "vram24": ["train.vram_gb=24"],
}
# Three aspect buckets of about 1024x1024 pixels each, as a user's photos fall.
BUCKETS = ((1024, 1024), (1152, 896), (896, 1152))
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
SUBJECTS = ("a sks dog on a lawn", "a sks dog on a sofa", "a sks dog at the beach", "a sks dog in the snow")


def build_model(out: Path, tiny: bool) -> Path:
    """A diffusers SDXL folder with random weights from SDXL base's configs (fp16, safetensors), built once.
    The tokenizers are the demo base's (small vocabularies; every id is valid for CLIP's embeddings)."""
    if (out / "model_index.json").is_file():
        return out
    import torch

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if tiny:
        shutil.copytree(DEMO, tmp)
    else:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        shutil.copytree(SDXL_CONFIGS, tmp)
        for name in ("tokenizer", "tokenizer_2"):
            shutil.rmtree(tmp / name)
            shutil.copytree(DEMO / name, tmp / name)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        with torch.device(device):  # initialising 2.6B parameters is much faster on the GPU
            parts = {
                "unet": UNet2DConditionModel.from_config(json.loads((tmp / "unet" / "config.json").read_text())),
                "vae": AutoencoderKL.from_config(json.loads((tmp / "vae" / "config.json").read_text())),
                "text_encoder": CLIPTextModel(CLIPTextConfig.from_json_file(tmp / "text_encoder" / "config.json")),
                "text_encoder_2": CLIPTextModelWithProjection(
                    CLIPTextConfig.from_json_file(tmp / "text_encoder_2" / "config.json")),
            }
        for name, module in parts.items():
            # The VAE stays fp32 (SDXL's VAE overflows in fp16); the rest is stored as SDXL's files are.
            dtype = torch.float32 if name == "vae" else torch.float16
            module.to(dtype).save_pretrained(tmp / name, safe_serialization=True)
            del module
    tmp.rename(out)
    return out


def build_apart(out: Path, tiny: bool) -> Path:
    """build_model in a child process: this one, which launches every cell, then holds no CUDA context and none
    of the build's cached GPU memory (it held 13.5 GiB, and a whole-card cell planned for 65 of 80 GiB)."""
    if not (out / "model_index.json").is_file():
        subprocess.run([sys.executable, __file__, "--build-model", str(out)] + (["--tiny"] if tiny else []),
                       check=True)
    return out


def build_dataset(out: Path, n: int, tiny: bool, square_only: bool = False) -> Path:
    """`n` captioned images spread over BUCKETS (or the square one), simple drawn scenes."""
    if out.is_dir() and len(list(out.glob("*.png"))) == n:
        return out
    from PIL import Image, ImageDraw

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sizes = [BUCKETS[0]] if square_only else BUCKETS
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        if tiny:
            w, h = w // 8, h // 8
        img = Image.new("RGB", (w, h), (40 + 9 * i % 200, 90, 160))
        d = ImageDraw.Draw(img)
        d.ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=(200, 30 * (i % 8), 60))
        d.rectangle((w // 8, 5 * h // 8, 3 * w // 8, 7 * h // 8), fill=(20, 200, 40 + 20 * (i % 10)))
        img.save(out / f"{i:03d}.png")
        (out / f"{i:03d}.txt").write_text(f"{SUBJECTS[i % len(SUBJECTS)]}, {COLOURS[i % len(COLOURS)]} collar\n")
    return out


class MemorySampler:
    """The GPU's memory in use, sampled every `every` seconds (nvidia-smi: the whole process, context and all)."""

    def __init__(self, every: float = 0.25):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            return float(out.split()[0]) / 1024  # MiB -> GiB
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            v = self._read()
            if v is not None:
                self.samples.append((time.time(), v))
            self._stop.wait(self.every)

    def __enter__(self):
        self.base = self._read() or 0.0
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> float | None:
        vals = [v for t, v in self.samples if t0 <= t <= t1]
        return round(max(vals) - self.base, 2) if vals else None


def phases(events: list[dict], launch: float) -> dict[str, tuple[float, float]]:
    """Wall-clock spans of a run's phases, from its events."""
    t = {}
    for e in events:
        t.setdefault(e["event"] + (f"@{e['step']}" if e["event"] in ("samples", "eval") else ""), e["time"])
    start = t.get("start", launch)
    steps = [e for e in events if e["event"] == "step"]
    first_step = steps[0]["time"] if steps else start
    spans = {"load+cache": (launch, t.get("plan", start))}
    # Its parts: imports and reading the model (to the dataset's report), the latent and text caches (to the
    # memory estimate), the UNet to the device with its adapter and levers (to the plan).
    if "dataset" in t and "memory_estimate" in t and "plan" in t:
        spans["  load"] = (launch, t["dataset"])
        spans["  cache"] = (t["dataset"], t["memory_estimate"])
        spans["  to device, adapter, levers"] = (t["memory_estimate"], t["plan"])
    if "samples@0" in t:
        spans["previews before"] = (t.get("plan", launch), t["samples@0"])
    spans["eval before"] = (t.get("samples@0", t.get("plan", launch)), start)
    spans["first step"] = (start, first_step)
    last_step = steps[-1]["time"] if steps else first_step
    spans["training"] = (first_step, last_step)
    end = t.get("done", last_step)
    spans["finish (eval, export, previews)"] = (last_step, end)
    return spans


# The launch's steps that leave a log line but no event: seconds from launch to each line's first occurrence.
LOG_MARKS = {"run folder": "run folder:", "dataset report": "dataset:", "adapter plan": "adapter plan:",
             "FLOP count done": "MFU:", "warm-up done": "warmed up in",
             "first graph capture": "capturing CUDA graphs", "compiling": "compiling the UNet's blocks"}


def log_marks(path: Path, launch: float) -> dict[str, float]:
    """Seconds from `launch` (time.time()) to the first log line of each LOG_MARKS entry in the run's train.log
    (its lines start with the local time, to the millisecond)."""
    import datetime

    marks = {}
    if not path.is_file():
        return marks
    for line in path.read_text(errors="replace").splitlines():
        for name, text in LOG_MARKS.items():
            if name not in marks and text in line[24:]:
                try:
                    at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue  # a continuation line of a multi-line message
                marks[name] = round(at - launch, 1)
    return marks


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _measured(events: list[dict], args) -> bool:
    """Whether a long run has given what is measured: --steps steps, and at least two step events of the steady
    window measure() times (step events come every train.log_every steps, so a window of fewer steps than that
    needs more)."""
    steps = [e for e in events if e["event"] == "step"]
    steady = [e for e in steps if e["step"] > args.warmup]
    return len(steady) >= 2 and steps[-1]["step"] >= args.steps


def steps_of(args) -> int:
    return args.run_steps or args.steps


def measure(name: str, args, model: Path, data: Path, out: Path, again: bool = False) -> dict:
    run_name = (f"{name}-b{args.batch}" + (f"x{args.accum}" if args.accum > 1 else "")
                + (f"-card{args.card:g}" if args.card else "") + ("-again" if again else ""))
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / run_name, ignore_errors=True)
    steps = args.run_steps or args.steps
    # --profile: the run under cProfile, its functions by cumulative time written beside its log
    prof = ["-m", "cProfile", "-o", str(out / f"{run_name}.prof")] if args.profile else []
    # --card N: the CLI's process capped to an N GB card before it starts, as a card of that size would hold it
    # (train.vram_gb stays unset: the run finds the card's memory and plans for it itself).
    launcher = ["-m", "sdxl_lora.cli"] if not args.card else ["-c", CARD_LAUNCHER.format(gib=args.card)]
    cmd = [sys.executable, *prof, *launcher, "train", "--model", str(model), "--data", str(data),
           "--batch-size", str(args.batch), "--steps", str(steps), "--out", str(out), "--name", run_name,
           "--set", "train.save_every=0", "--set", "train.save_every_minutes=0"]
    # A cell's xM: M batches accumulated a step, by hand (what the planner does when a batch does not fit).
    accum = [f"train.grad_accum={args.accum}"] if args.accum > 1 else []
    for s in SETTINGS[name] + accum + list(args.set):
        cmd += ["--set", s]
    print(f"$ {' '.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    events_path = out / run_name / "events.jsonl"
    launch = time.time()
    stopped = False
    with MemorySampler() as mem, open(out / f"{run_name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            time.sleep(1.0)
            # A long run (its length decides what train.speed="auto" chooses) measured for --steps steps, then
            # stopped as a user would (Ctrl-C: the step finishes and the state is saved).
            if args.run_steps and not stopped and events_path.is_file():
                if _measured(_events(events_path), args):
                    proc.send_signal(signal.SIGINT)
                    stopped = True
        proc.wait()
    wall = time.time() - launch
    if args.profile and (out / f"{run_name}.prof").is_file():
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(str(out / f"{run_name}.prof"), stream=text).sort_stats("cumulative").print_stats(60)
        (out / f"{run_name}.prof.txt").write_text(text.getvalue())
    events = _events(events_path) if events_path.is_file() else []
    steps = [e for e in events if e["event"] == "step"]
    result = {"setting": name + (" (again: caches warm)" if again else ""), "batch": args.batch, "accum": args.accum,
              "card_gib": args.card or None, "steps": steps[-1]["step"] if steps else 0, "run_steps": steps_of(args),
              "rc": proc.returncode, "wall_s": round(wall, 1), "peak_gib": mem.peak()}
    budget = next((e for e in events if e["event"] == "budget_plan"), None)
    if budget:
        result["budget"] = {k: budget.get(k) for k in ("vram_gb", "choices", "slowdown", "card_budget", "card")}
    if proc.returncode not in ((0, 130) if stopped else (0,)) or not steps:
        text = (out / f"{run_name}.log").read_text()
        # A refusal at start is one paragraph after "error:"; anything else, the end of the log.
        result["error"] = text[text.rindex("error:"):][:1500] if "error:" in text else text[-3000:]
        return result
    steady = [e for e in steps if e["step"] > args.warmup]
    if len(steady) >= 2:
        images = args.batch * args.accum * (steady[-1]["step"] - steady[0]["step"])
        result["images_per_s"] = round(images / (steady[-1]["time"] - steady[0]["time"]), 2)
    result["launch_to_first_step_s"] = round(steps[0]["time"] - launch, 1)
    result["log_marks_s"] = log_marks(out / run_name / "train.log", launch)
    spans = phases(events, launch)
    result["phases_s"] = {k: round(b - a, 1) for k, (a, b) in spans.items()}
    result["peak_gib"] = mem.peak()
    result["phase_peak_gib"] = {k: mem.peak(a, b) for k, (a, b) in spans.items()}
    # Each rendered set's own time and its parts (a step-0 set from the cache is a file copy, not counted).
    rendered = [e for e in events if e["event"] == "previews_rendered"]
    result["previews_s"] = [{k: v for k, v in e.items() if k not in ("event", "time")} for e in rendered]
    result["previews_share"] = round(sum(e["seconds"] for e in rendered) / wall, 3)
    estimate = next((e for e in events if e["event"] == "memory_estimate"), None)
    if estimate:
        result["estimate_gib"] = estimate["run"]
    chosen = [e for e in events if e["event"] == "speed"]
    if chosen:
        result["speed"] = {k: v for k, v in chosen[0].items() if k not in ("event", "time")}
    # What train.checkpoint_budget_gb checkpointed (the share of the forward recomputed): the planner's time
    # model (sdxl/plan.py: CHECKPOINT_SLOWDOWN) is fitted to images/s against it. Micro-batches: a fallback that split them.
    ckpt = [e for e in events if e["event"] == "checkpointing"]
    if ckpt:  # the first: the fit's choice; a later one: more units after the graphs' capture ran out
        result["checkpointing"] = {"units": len(ckpt[0]["blocks"]), "recomputed_flops": ckpt[0]["recomputed_flops"],
                                   "trials": ckpt[0]["trials"], "units_after_fallback": len(ckpt[-1]["blocks"])}
    result["micro_batches"] = [e["parts"] for e in events if e["event"] == "micro_batches"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/sdxl-e2e"), help="model, dataset and runs go here")
    ap.add_argument("--settings", nargs="+", default=["defaults", "recipe"], choices=list(SETTINGS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60, help="steps measured")
    ap.add_argument("--run-steps", type=int, help="the run's train.steps when longer than --steps: it is stopped "
                                                 "with Ctrl-C after --steps (what auto chooses depends on it)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the steady images/s")
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--card", type=float, default=0, help="cap the CLI's process to a card of this many GiB before "
                                                          "it starts (train.vram_gb unset: the run plans for the "
                                                          "card it finds); 0: the whole GPU")
    ap.add_argument("--cells", nargs="+", metavar="SETTING:BATCH[xACCUM][@CARD]",
                    help="a matrix instead of --settings x --batch: each cell a setting, a batch, optionally the "
                         "batches accumulated a step and a card (e.g. defaults:16 defaults:8x2 qlora:1@8 locon:4@12)")
    ap.add_argument("--set", action="append", default=[], help="more overrides for every setting")
    ap.add_argument("--tiny", action="store_true", help="the tiny SDXL on the CPU: a smoke test of this script")
    ap.add_argument("--json", type=Path, help="also append each run's result here, one JSON line each")
    ap.add_argument("--again", action="store_true", help="run each setting a second time right after the first: "
                                                           "inductor's cache and the latent cache warm, as a "
                                                           "user's next run on the same machine")
    ap.add_argument("--profile", action="store_true", help="run the CLI under cProfile; RUN.prof and the top "
                                                             "functions by cumulative time (RUN.prof.txt) go "
                                                             "beside the runs")
    ap.add_argument("--build-model", type=Path, help=argparse.SUPPRESS)  # the child process of build_apart
    args = ap.parse_args()
    if args.build_model:
        build_model(args.build_model, args.tiny)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_apart(args.work / ("tiny-sdxl" if args.tiny else "sdxl-random"), args.tiny)
    print(f"# model {model} ({time.time() - t0:.0f} s)", flush=True)
    results = []
    cells = [(name, args.batch, 1, args.card) for name in args.settings]
    if args.cells:
        cells = []
        for cell in args.cells:
            name, _, rest = cell.partition(":")
            rest, _, card = rest.partition("@")
            batch, _, accum = rest.partition("x")
            cells.append((name, int(batch or args.batch), int(accum or 1), float(card or args.card)))
    for name, batch, accum, card in cells:
        args.batch, args.accum, args.card = batch, accum, card
        data = build_dataset(args.work / ("data-square" if name == "one-bucket" else "data"), args.images, args.tiny,
                             square_only=name == "one-bucket")
        for again in (False, True) if args.again else (False,):
            r = measure(name, args, model, data, args.work / "runs", again=again)
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.json:  # appended as each run ends: calls that share a file keep every run's line
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    # A refusal at start (exit 2) is a result of a card matrix, not a failure of this script.
    return 0 if all(r["rc"] in ((0, 2) if args.cells else (0,)) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
