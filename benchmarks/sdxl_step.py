"""SDXL UNet LoRA training step on the GPU: the plain diffusers + peft recipe beside this trainer's own step
with the settings a user can choose, in one run. The UNet is SDXL base's real config with random weights
(same FLOPs and memory as the real one), 1024x1024 (128x128 latents), text embeddings precomputed (random
tensors of the real shapes), bf16 frozen weights, fp32 LoRA rank 16 on to_q/to_k/to_v/to_out.0, AdamW.

    python benchmarks/sdxl_step.py [--only NAME ...] [--batches B ...] [--steps 20] [--warmup 5]
                                   [--set train.KEY=VALUE ...] [--profile N [--top K] [--shapes]]

Settings. "recipe" is diffusers' add_adapter with the module list of its training examples, autocast bf16,
MSE on the noise, fused AdamW. Every "ours" setting is a config: today's defaults (what `sdxl-lora train`
runs) with the train.* / model.* values below; "+x" turns a lever on, "-x" turns a default one off.

  recipe                       the plain recipe
  recipe+ckpt                  the recipe with unet.enable_gradient_checkpointing()
  ours                         the defaults: fuse_qkv, lora_matmul="merged", fused_geglu on; no compile,
                               CUDA graphs or channels_last
  ours+graphs                  cuda_graphs=true
  ours+compile                 compile="regional", channels_last=true (no graphs: --profile --shapes can then
                               name the operator behind each copy)
  ours+compile+graphs          the fastest: compile="regional", channels_last=true, cuda_graphs=true (with
                               channels_last and compile="regional" every layout lever of docs/speed.md is on)
  ours+compile-tf+graphs       the fastest with compile="transformer" (the shortest first compilation)
  ours+compile+graphs-cl       the fastest with channels_last=false (the layout levers off)
  ours+compile+graphs-fuse     the fastest with fuse_qkv=false (peft's own projections and LoRA products)
  ours+compile+graphs+peft     the fastest with lora_matmul="peft"
  ours+compile+graphs-geglu    the fastest with fused_geglu=false
  ours+compile+graphs+cudnn    the fastest with sdpa_backend="cudnn"
  ours+compile+graphs+keep45   the fastest with compile_activation_budget=0.45 (batch 4 under 16 GiB)
  ours+compile+graphs-guard    the fastest with nan_guard=false
  ours+ckpt                    gradient_checkpointing=true
  ours+ckpt+graphs             gradient_checkpointing=true, cuda_graphs=true
  ours+ckpt+compile+graphs     the fastest with gradient_checkpointing=true
  ours+budget16                checkpoint_budget_gb=16
  ours+budget16+graphs         checkpoint_budget_gb=16, cuda_graphs=true
  ours+nf4+ckpt+graphs         model.quantize="nf4" (QLoRA), gradient_checkpointing, cuda_graphs: against
                               ours+ckpt+graphs
  ours+fp8+ckpt+graphs         the same with model.quantize="fp8"
  ours+compile+graphs+dora     the fastest with adapter.kind="dora" (the adapter kinds, each against
  ours+compile+graphs+locon    ours+compile+graphs: LoRA on the attention projections only), adapter.preset="locon"
  ours+compile+graphs+loha     (attention, feed-forward, ResNet convolutions at the same rank), kind="loha",
  ours+compile+graphs+lokr     kind="lokr"; adapter.* in --set changes them all, e.g. --set adapter.preset=locon

--set KEY=VALUE applies a config value to every setting over its own (e.g. --set
train.compile_activation_budget=0.4); the recipe reads train.gradient_checkpointing and adapter.rank only.
--batches replaces each setting's batch sizes. A setting named twice in --only runs twice in one process: the
second compilation's first step is the one with inductor's cache warm. --inductor KEY=VALUE sets
torch._inductor.config options for an experiment.

"ours" is the trainer's step: SDXLTask.loss (latent sampling from cached mean/std, noise, timesteps, the UNet,
the loss), backward, gradient clipping, the NaN guard (its verdict read a step later, as the trainer does with
fused AdamW), fused AdamW. Prints one JSON row per setting and batch: ms/step, images/s, peak GiB allocated
and reserved, MFU (3 x 6.76 TFLOPs per image for forward + backward against 790 TFLOP/s dense bf16 measured
on the H200), time to the first step (set-up, compilation and capture included), and with CUDA graphs the
largest difference of loss and gradients from the eager step on the same batch. --profile N adds GPU time by
kind of kernel. --tiny runs the embedded tiny UNet on the CPU, compiling with aot_eager: a smoke test of the
script, with CPU stand-ins for what needs CUDA (checkpoint_budget_gb 0.01, sdpa_backend "math" for
"cudnn"; CUDA graphs and the GEGLU kernel are skipped by the trainer there).
Figures: benchmarks/RESULTS.md#sdxl-step-speed.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from types import SimpleNamespace

import torch
import torch._dynamo

FWD_TFLOPS_PER_IMAGE = 6.76   # torch FlopCounterMode, SDXL UNet forward at 1024x1024
PEAK_TFLOPS = 790.0           # bf16 matmul measured on this H200 (device/KINDS.md)

# The benchmark's adapter, for every setting: rank 16 (--rank) on every attention's q/k/v/out, one rank, no
# overrides (the default model.path, the demo model, recommends LoRA on the ResNets' convolutions too).
ADAPTER = {"adapter.preset": "attn", "adapter.scale_rank_with_resolution": False, "adapter.overrides": {}}

GRAPHS = {"train.cuda_graphs": True}
COMPILE = {"train.compile": "regional", "train.channels_last": True}
FASTEST = {**COMPILE, **GRAPHS}
CKPT = {"train.gradient_checkpointing": True}

SETTINGS = {
    # name: (mode, batch sizes, config values over the defaults)
    "recipe": ("recipe", [1, 4, 8], {}),
    "recipe+ckpt": ("recipe", [4], CKPT),
    "ours": ("ours", [1, 4, 8], {}),
    "ours+graphs": ("ours", [1, 4, 8], GRAPHS),
    "ours+compile": ("ours", [1, 16], COMPILE),
    "ours+compile+graphs": ("ours", [1, 4, 16], FASTEST),
    "ours+compile-tf+graphs": ("ours", [1, 8], {**FASTEST, "train.compile": "transformer"}),
    "ours+compile+graphs-cl": ("ours", [1, 16], {**FASTEST, "train.channels_last": False}),
    "ours+compile+graphs-fuse": ("ours", [1, 16], {**FASTEST, "train.fuse_qkv": False}),
    "ours+compile+graphs+peft": ("ours", [16], {**FASTEST, "train.lora_matmul": "peft"}),
    "ours+compile+graphs-geglu": ("ours", [1, 16], {**FASTEST, "train.fused_geglu": False}),
    "ours+compile+graphs+cudnn": ("ours", [1, 16], {**FASTEST, "train.sdpa_backend": "cudnn"}),
    "ours+compile+graphs+keep45": ("ours", [4], {**FASTEST, "train.compile_activation_budget": 0.45}),
    "ours+compile+graphs-guard": ("ours", [1], {**FASTEST, "train.nan_guard": False}),
    "ours+ckpt": ("ours", [4], CKPT),
    "ours+ckpt+graphs": ("ours", [1, 4], {**CKPT, **GRAPHS}),
    "ours+ckpt+compile+graphs": ("ours", [4], {**CKPT, **FASTEST}),
    "ours+budget16": ("ours", [4], {"train.checkpoint_budget_gb": 16.0}),
    "ours+budget16+graphs": ("ours", [4], {"train.checkpoint_budget_gb": 16.0, **GRAPHS}),
    "ours+nf4+ckpt+graphs": ("ours", [1, 4], {"model.quantize": "nf4", **CKPT, **GRAPHS}),
    "ours+fp8+ckpt+graphs": ("ours", [4], {"model.quantize": "fp8", **CKPT, **GRAPHS}),
    "ours+compile+graphs+dora": ("ours", [16], {**FASTEST, "adapter.kind": "dora"}),
    "ours+compile+graphs+locon": ("ours", [16], {**FASTEST, "adapter.preset": "locon"}),
    "ours+compile+graphs+loha": ("ours", [16], {**FASTEST, "adapter.kind": "loha"}),
    "ours+compile+graphs+lokr": ("ours", [16], {**FASTEST, "adapter.kind": "lokr"}),
}


def setting_config(values: dict, sets: list[str], rank: int, cpu: bool):
    """A setting's Config: the benchmark's adapter, the setting's values, then --set (which wins). On the
    CPU smoke test, stand-ins for what needs CUDA or the real model's size."""
    from sdxl_lora.core.config import load_config

    values = {**ADAPTER, "adapter.rank": rank, **values}
    if cpu:
        if "train.checkpoint_budget_gb" in values:
            values["train.checkpoint_budget_gb"] = 0.01  # the tiny UNet: a budget that checkpoints something
        if values.get("train.sdpa_backend") in ("cudnn", "efficient"):
            values["train.sdpa_backend"] = "math"
    given = {item.partition("=")[0].strip() for item in sets}
    return load_config(overrides=sets, extra={k: v for k, v in values.items() if k not in given})


def build_unet(device, tiny=False):
    from diffusers import UNet2DConditionModel

    from sdxl_lora.sdxl.formats.single_file import unet_config

    torch.manual_seed(0)
    if tiny:
        from sdxl_lora.core.config import ModelConfig
        from sdxl_lora.sdxl.demo.tiny import materialize_tiny

        return UNet2DConditionModel.from_pretrained(str(materialize_tiny(ModelConfig().cache_dir) / "unet"))
    with torch.device(device):
        unet = UNet2DConditionModel.from_config(unet_config())
    return unet.to(dtype=torch.bfloat16)


def recipe_lora(unet, rank):
    """The plain recipe: diffusers' add_adapter with the flat module list of its training examples."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def project_lora(unet, adapter):
    """The trainer's adapter (an AdapterConfig) on `unet`, planned at the UNet's own resolution."""
    from sdxl_lora.core import inject
    from sdxl_lora.sdxl import slots as unet_slots

    res = unet.config.sample_size * 8
    plan = unet_slots.make_plan(unet, adapter, resolution=res, native=res)
    inject.apply_plan(unet, plan)
    return plan


def inputs(unet, batch, device):
    g = torch.Generator(device).manual_seed(0)
    c = unet.config
    s = c.sample_size
    pooled_dim = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    res = float(s * 8)
    return {"latent_mean": torch.randn(batch, 4, s, s, device=device, generator=g),
            "latent_std": 0.05 * torch.rand(batch, 4, s, s, device=device, generator=g),
            "prompt_embeds": torch.randn(batch, 77, c.cross_attention_dim, device=device, generator=g),
            "pooled": torch.randn(batch, pooled_dim, device=device, generator=g),
            "time_ids": torch.tensor([[res, res, 0, 0, res, res]] * batch, device=device)}


def our_task(cfg, device, data):
    """The SDXL task with `cfg` and its own loss, without dataset or pipeline (those are not in the step):
    its data loader gives `data`, the batch every step trains on."""
    from diffusers import DDPMScheduler

    from sdxl_lora.sdxl.task import SDXLTask

    task = SDXLTask(cfg)
    task.device = torch.device(device)
    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    task.pipe = SimpleNamespace(vae=SimpleNamespace(config=SimpleNamespace(scaling_factor=0.13025)), scheduler=sched)
    task.noise_scheduler = task._noise_scheduler()
    task.accelerator = SimpleNamespace(num_processes=1, mixed_precision="bf16" if device == "cuda" else "no",
                                       autocast=lambda: torch.autocast(
        device, dtype=torch.bfloat16, enabled=device == "cuda", cache_enabled=False))
    run = SimpleNamespace(event=lambda *a, **k: print(json.dumps({"event": a[0], **k}), flush=True))
    task.dataloader = lambda shard=True: [data]
    task.dataset = SimpleNamespace(bucket_histogram=lambda: {tuple(data["latent_mean"].shape[-2:]): 1})  # one shape
    task.unet_call.graph_inputs = lambda args: []  # no other shapes to capture
    return task, run


def prepare(unet, mode, cfg, device):
    """The adapter on a fresh UNet: the recipe's, or the trainer's after model.quantize as the trainer does it."""
    if mode == "recipe":
        recipe_lora(unet, cfg.adapter.rank)
        return
    if cfg.model.quantize != "none" or cfg.model.quantize_convs != "none":
        from sdxl_lora.sdxl.quantize import quantize_unet

        quantize_unet(unet, cfg.model, "bf16" if device == "cuda" else "no", device)
    project_lora(unet, cfg.adapter)


def bench(unet, batch, steps, warmup, device, mode, cfg, profile=0, top=15, shapes=False):
    from diffusers import DDPMScheduler

    unet.train()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    data = inputs(unet, batch, device)
    check = None
    setup_s = 0.0
    pending = None  # the NaN guard's verdict of the step before
    nan_guard = mode != "recipe" and cfg.train.nan_guard
    if mode == "recipe":
        if cfg.train.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
        lat = data["latent_mean"]

        def loss_fn():
            noise = torch.randn_like(lat)
            t = torch.randint(0, 1000, (batch,), device=device)
            noisy = sched.add_noise(lat, noise, t)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                pred = unet(noisy, t, encoder_hidden_states=data["prompt_embeds"],
                            added_cond_kwargs={"text_embeds": data["pooled"], "time_ids": data["time_ids"]}).sample
            return torch.nn.functional.mse_loss(pred.float(), noise)
    else:
        from sdxl_lora.sdxl.unet_call import CallState

        task, run = our_task(cfg, device, data)
        t_setup = time.perf_counter()
        task.unet_call.setup(unet, run)  # every train.* lever, as the trainer's set-up applies them
        setup_s = time.perf_counter() - t_setup
        if task.unet_call.state is not CallState.EAGER:
            # The check's passes compile (with train.compile) and capture: counted in the first step.
            t_check = time.perf_counter()
            check = graph_check(task, unet, data, params)
            setup_s += time.perf_counter() - t_check

        def loss_fn():
            with task.accelerator.autocast():
                return task.loss(unet, data)

    def step():
        nonlocal pending
        loss = loss_fn()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if nan_guard:
            # As the trainer runs it with fused AdamW: the optimizer skips a flagged step on the device and the
            # host reads the verdict a step later.
            from sdxl_lora.core.nan_guard import PendingFlag

            flag = (~torch.isfinite(loss.detach()) | ~torch.isfinite(norm)).float()
            opt.found_inf = flag
            if pending is not None:
                pending.bad()
            pending = PendingFlag(flag, 0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - t0 + setup_s
    for _ in range(warmup - 1):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1000
    ips = batch / (ms / 1000)
    cuda = device == "cuda"
    row = {"ms_per_step": round(ms, 1), "images_per_s": round(ips, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           # A replayed CUDA graph allocates nothing: its activations sit in the graph's private pool, which
           # the allocated peak does not see; reserved memory holds it.
           "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
           # MFU against SDXL's FLOPs: not for the tiny UNet.
           "mfu": round(3 * FWD_TFLOPS_PER_IMAGE * ips / PEAK_TFLOPS, 3) if cuda else None,
           "first_step_s": round(first_s, 1), "loss": round(loss.item(), 4),
           "trainable": sum(p.numel() for p in params)}
    if check:
        row.update(check)
    if profile:  # on the CPU (--tiny): a smoke test of the profile's tables, without GPU kernels
        row.update(profile_steps(step, profile, ms, top, shapes))
    return row


COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat", "aten::add")


def _op_us(e) -> float:
    """An operator's time in microseconds: on the GPU, its kernels'; on the CPU smoke test, its own."""
    return e.device_time_total or (0 if torch.cuda.is_available() else e.cpu_time_total)


def copy_sources(events, n, top):
    """Where the eager copies, concatenations and adds come from: each innermost one (copy_, cat, add) grouped
    by its first input's shape and the four nearest operators or Python functions it ran under (copy operators
    and torch's own Python plumbing left out; AOTAutograd's runtime kept: its copies of incoming gradients
    show there), e.g. an autograd node of the backward, the eager GroupNorm, a diffusers forward."""
    def shown(name):
        if name in COPY_OPS or name.startswith("<built-in method") or "pybind11" in name:
            return False
        return "/torch/" not in name and not name.startswith("torch/") or "_aot_autograd" in name

    groups = {}
    for e in events:
        us = _op_us(e)
        if e.name not in ("aten::copy_", "aten::cat", "aten::add", "aten::add_") or not us:
            continue
        chain, p = [], e.cpu_parent
        while p is not None and len(chain) < 4:
            if shown(p.name):
                chain.append(p.name[-80:])
            p = p.cpu_parent
        key = (e.name, str(e.input_shapes[:1])[:40], " < ".join(chain))
        calls, total = groups.get(key, (0, 0.0))
        groups[key] = (calls + 1, total + us)
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"op": k[0], "shape": k[1], "under": k[2], "calls": c // n, "ms": round(t / 1000 / n, 3)}
            for k, (c, t) in rows]


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def matmul_flops(op: str, shapes: list) -> int:
    """2 * M * K * N (times the batch for bmm) from a matmul operator's recorded input shapes."""
    a, b = (shapes[1], shapes[2]) if op in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def matmul_shapes(events, n, top):
    """The matmuls launched as operators (eager, and inductor's calls of aten's mm outside its generated
    kernels), grouped by input shapes: calls and time a step and the TFLOP/s each shape reaches, the
    costliest first: which GEMMs fall short of the hardware."""
    rows = []
    for e in events:
        us = _op_us(e)
        if e.key not in MATMUL_OPS or not us or not e.input_shapes:
            continue
        flops = matmul_flops(e.key, e.input_shapes) * e.count
        rows.append({"op": e.key, "shapes": str([s for s in e.input_shapes if s])[:90], "calls": e.count // n,
                     "ms": round(us / 1000 / n, 3), "tflops": round(flops / us / 1e6, 1)})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def profile_steps(step, n, ms_per_step, top=15, shapes=False):
    """n more steps under torch's profiler: GPU time by kind of kernel and the kernels that take the most.
    shapes: also the copies, casts, concatenations and adds launched from Python (outside compiled code) by
    input shape, with their GPU time; a graphed step's replay hides which operator launched a kernel, so
    this is for settings without CUDA graphs."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from sdxl_lora.core.profile import kernel_kind, kernel_kinds

    cuda = torch.cuda.is_available()
    with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, record_shapes=shapes,
                       with_stack=shapes) as prof:
        for _ in range(n):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    copies = {}
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True)
        ops = [e for e in by_shape if e.key in COPY_OPS and e.device_time_total]
        ops.sort(key=lambda e: -e.device_time_total)
        copies = {"eager_copies": [{"op": e.key, "shapes": str(e.input_shapes)[:120], "calls": e.count // n,
                                    "ms": round(e.device_time_total / 1000 / n, 3)} for e in ops[:top]],
                  "copy_sources": copy_sources(prof.events(), n, top),
                  "matmul_shapes": matmul_shapes(by_shape, n, top)}
    kinds = kernel_kinds(events, n)
    kernels = sorted((e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                      and not getattr(e, "is_user_annotation", False)),
                     key=lambda e: -e.self_device_time_total)[:top]
    return {"gpu_busy_ms": round(sum(kinds.values()), 2), "gpu_busy_share": round(sum(kinds.values()) / ms_per_step, 3),
            "kinds_ms": {k: round(v, 2) for k, v in kinds.items()},
            "top_kernels": [{"ms": round(e.self_device_time_total / 1000 / n, 3), "calls": e.count // n,
                             "kind": kernel_kind(e.key), "name": e.key[:160]} for e in kernels], **copies}


def graph_check(task, unet, data, params):
    """Loss and gradients of the graphed step against the eager one, on the same batch and noise."""
    from sdxl_lora.sdxl.unet_call import CallState

    call = task.unet_call
    state = {"graphed": (call.state, call.graphed)}

    def once(graphed):
        call.state, call.graphed = state["graphed"] if graphed else (CallState.EAGER, None)
        torch.manual_seed(123)
        for p in params:
            p.grad = None
        with task.accelerator.autocast():
            loss = task.loss(unet, data)
        loss.backward()
        if graphed:
            state["graphed"] = (call.state, call.graphed)
        return loss.item(), [p.grad.detach().float().clone() for p in params]

    eager_loss, eager_grads = once(False)
    once(True)  # the first graphed call captures (and runs warm-up iterations)
    g_loss, g_grads = once(True)
    call.state, call.graphed = state["graphed"]
    for p in params:
        p.grad = None
    rel = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(g_grads, eager_grads))
    return {"graph_loss_diff": abs(g_loss - eager_loss), "graph_grad_rel_diff": round(rel, 6)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="NAME",
                    help="the settings to run, in this order (default: all; the list above)")
    ap.add_argument("--batches", type=int, nargs="+", help="these batch sizes instead of each setting's own")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config value for every setting, over the setting's own, e.g. "
                         "--set train.compile_activation_budget=0.4 (repeatable)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, N more steps under torch's profiler: GPU time by kind of kernel")
    ap.add_argument("--top", type=int, default=15, help="with --profile: how many of the longest kernels to list")
    ap.add_argument("--shapes", action="store_true",
                    help="with --profile: the eager copies, casts and adds by input shape, and the matmuls by shape "
                         "with the TFLOP/s each reaches (settings without graphs)")
    ap.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config options for every compiled setting (an experiment's switch), "
                         "e.g. coordinate_descent_tuning=True")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny UNet on the CPU: a smoke test")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.inductor:
        import ast

        import torch._inductor.config as inductor_config

        for item in args.inductor:
            key, _, value = item.partition("=")
            *parents, name = key.split(".")  # "triton.multi_kernel": a sub-config's option
            section = inductor_config
            for parent in parents:
                section = getattr(section, parent, None)
            if section is None or not hasattr(section, name):
                ap.error(f"--inductor {item}: torch._inductor.config has no option {key!r}")
            setattr(section, name, ast.literal_eval(value))
        print(f"# inductor options: {' '.join(args.inductor)}", flush=True)
    if args.tiny:
        from sdxl_lora.core import speed
        speed.COMPILE_BACKEND = "aot_eager"  # no C++ build per graph on the CPU smoke test
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for name in args.only:
        mode, batches, values = SETTINGS[name]
        for batch in args.batches or batches:
            unet = build_unet(device, args.tiny)
            try:
                cfg = setting_config(values, args.set, args.rank, cpu=device == "cpu")
                prepare(unet, mode, cfg, device)
                row = {"setting": name, "batch": batch, "adapter": f"{cfg.adapter.kind}/{cfg.adapter.preset}",
                       **bench(unet, batch, args.steps, args.warmup, device, mode, cfg, args.profile, args.top,
                               args.shapes)}
            except torch.OutOfMemoryError as e:
                row = {"setting": name, "batch": batch, "error": f"out of memory: {str(e)[:120]}"}
            except Exception as e:  # one failing setting must not cost the others' figures
                row = {"setting": name, "batch": batch, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(row), flush=True)
            del unet
            # The graphed callables can sit in reference cycles with their autograd functions: collect them, so
            # their memory pools are released before the next setting.
            torch._dynamo.reset()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
