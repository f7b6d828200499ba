"""PyTorch SDPA backends on the SDXL UNet's attention shapes at 1024x1024: forward + backward time per
backend (flash, cuDNN, memory-efficient; FlexAttention, torch's Triton-generated attention, compiled; the
math path compiled, "math-compiled"; FlashAttention 4, "fa4", flash_attn.cute's kernels where that package
is installed, called directly or, "fa4-sdpa", as torch's flash backend through
torch.nn.attention.activate_flash_attention_impl; "short", the Triton kernel for a few keys in
benchmarks/short_attention.py, on the cross-attention shapes), bf16, so the trainer's attention choice rests
on a measurement.

    python benchmarks/attention_backends.py [--batch 8] [--iters 20] [--layout bhsd|bshd] [--only NAME ...]
        [--kernel-time]    GPU time of the kernels (torch's profiler) instead of wall time per call
        [--sweep]          short_attention.py's launch settings against cuDNN on the cross-attention shapes

Shapes (batch, heads, query tokens, key tokens, head dim 64): self-attention at the 64x64 level (640
channels, 10 heads, 4096 tokens) and at the 32x32 level (1280 channels, 20 heads, 1024 tokens), and the
cross-attention to the 77 text tokens at both. Prints one JSON row per shape and backend (ms for
forward + backward), and the per-image total over SDXL's layers (10 transformer layers at 64x64, 60 at
32x32) for each backend. --tiny runs small shapes on the CPU (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import gpu_ms, timed  # benchmarks/timing.py (this script's folder is on the path)

# name: (heads, query tokens, key tokens, layers of it in the SDXL UNet)
SHAPES = {"self 64x64": (10, 4096, 4096, 10), "cross 64x64": (10, 4096, 77, 10),
          "self 32x32": (20, 1024, 1024, 60), "cross 32x32": (20, 1024, 77, 60)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH, "flex": "flex",
            "math-compiled": "math-compiled", "fa4": "fa4", "fa4-sdpa": "fa4-sdpa", "short": "short"}


def _flex():
    """torch's FlexAttention, compiled (it is a template for inductor; uncompiled it runs the math path)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _math_compiled():
    """softmax(q k^T / sqrt(d)) v written out and compiled: cuBLAS batched GEMMs around an inductor softmax.
    For the cross-attention to 77 tokens, where a flash kernel's key tiles are mostly padding."""
    def attention(q, k, v):
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return scores.softmax(-1) @ v

    return torch.compile(attention, dynamic=False)


def _short(q, k):
    """short_attention.short_attention (this folder), where it takes the shapes (at most 128 keys, CUDA)."""
    from short_attention import short_attention, short_attention_supported

    if not short_attention_supported(q, k):
        raise RuntimeError(f"short_attention does not take {k.shape[-2]} keys on {q.device.type}")
    return short_attention


def check_short(b, h, q, k, d, device, dtype):
    """The largest difference of short_attention's output and gradients from fp32 math attention on the
    same inputs, relative to the largest reference value."""
    from short_attention import short_attention

    g = torch.Generator(device).manual_seed(1)
    leaves = [torch.randn(b, n, h, d, device=device, dtype=dtype, generator=g).requires_grad_() for n in (q, k, k)]
    grad = torch.randn(b, h, q, d, device=device, dtype=dtype, generator=g)
    out = short_attention(*(x.transpose(1, 2) for x in leaves))
    got = [out, *torch.autograd.grad(out, leaves, grad)]
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ref_leaves))
    want = [ref, *torch.autograd.grad(ref, ref_leaves, grad.float())]
    return {name: round(((a.float() - b).abs().max() / b.abs().max()).item(), 5)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _fa4():
    """FlashAttention 4's function (flash_attn.cute), where installed, on the (batch, heads, tokens, dim) views
    the other backends take: FA4's own layout is the (batch, tokens, heads, dim) memory under them."""
    from flash_attn.cute import flash_attn_func

    def attention(q, k, v):
        out = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)))
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)  # (out, lse) in the 4.0 betas

    return attention


def time_backend(backend, b, h, q, k, d, iters, device, dtype, layout="bhsd", kernel_time=False):
    """ms for forward + backward. layout "bhsd": contiguous (batch, heads, tokens, dim) tensors; "bshd": the
    (batch, tokens, heads, dim) tensors diffusers' attention processor makes, viewed with transpose(1, 2)."""
    if backend == "fa4-sdpa":  # FA4 registered as SDPA's flash kernels for this backend's timing only
        from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

        _fa4()  # ImportError where flash_attn.cute is not installed, before anything is registered
        activate_flash_attention_impl("FA4")
        try:
            return time_backend(SDPBackend.FLASH_ATTENTION, b, h, q, k, d, iters, device, dtype, layout, kernel_time)
        finally:
            restore_flash_attention_impl()
    g = torch.Generator(device).manual_seed(0)
    if layout == "bhsd":
        leaves = [torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for n in (q, k, k)]
        qt, kt, vt = leaves
    else:
        leaves = [torch.randn(b, n, h, d, device=device, dtype=dtype, generator=g).requires_grad_() for n in (q, k, k)]
        qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    grad = torch.randn(b, h, q, d, device=device, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    makers = {"flex": _flex, "math-compiled": _math_compiled, "fa4": _fa4, "short": lambda: _short(qt, kt)}
    function = makers[backend]() if isinstance(backend, str) else None  # else an SDPA backend

    def once():
        if function is not None:
            out = function(qt, kt, vt)
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qt, kt, vt)
        out.backward(grad)
        for x in leaves:
            x.grad = None

    return gpu_ms(once, iters) if kernel_time else timed(once, iters, sync)


SWEEP = [dict(fwd_block_m=fm, fwd_warps=fw, bwd_block_m=bm, bwd_warps=bw, bwd_per_sm=ps)
         for fm, fw, bm, bw, ps in [(128, 8, 64, 8, 4), (128, 4, 64, 4, 4), (64, 4, 32, 4, 4), (64, 4, 64, 4, 8),
                                    (128, 8, 32, 4, 8), (64, 8, 64, 8, 16), (128, 4, 128, 8, 4), (32, 4, 32, 2, 8),
                                    (64, 4, 32, 4, 16), (128, 8, 64, 4, 2)]]


def sweep_short(args, device, dtype):
    """GPU time of short_attention's launch settings (SWEEP) on the cross-attention shapes, beside cuDNN's,
    summed over SDXL's layers: which setting, and whether it beats cuDNN's in kernel time."""
    import short_attention as kernels

    cross = {k: v for k, v in SHAPES.items() if v[2] == 77}
    rows = {"cudnn": sum(time_backend(SDPBackend.CUDNN_ATTENTION, args.batch, h, q, kv, 64, args.iters, device,
                                      dtype, args.layout, True) * n for h, q, kv, n in cross.values())}
    saved = dict(kernels.SHORT_ATTENTION_CONFIG)
    for cfg in SWEEP:
        kernels.SHORT_ATTENTION_CONFIG.update(cfg)
        try:
            rows[json.dumps(cfg)] = sum(time_backend("short", args.batch, h, q, kv, 64, args.iters, device, dtype,
                                                     args.layout, True) * n for h, q, kv, n in cross.values())
        except Exception as e:  # a setting Triton cannot build (registers, shared memory): say so, go on
            print(json.dumps({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
    kernels.SHORT_ATTENTION_CONFIG.update(saved)
    for name, ms in sorted(rows.items(), key=lambda kv: kv[1]):
        print(json.dumps({"cross_attention_gpu_ms_per_step": round(ms, 2), "backend": name, "batch": args.batch}),
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                    help="bshd: the transposed views diffusers' attention processor passes (see time_backend)")
    ap.add_argument("--only", nargs="+", choices=list(BACKENDS), help="these backends (default: all but math)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--kernel-time", action="store_true",
                    help="GPU time of the kernels (torch's profiler) instead of wall time per call")
    ap.add_argument("--sweep", action="store_true",
                    help="short_attention.py's launch settings against cuDNN on the cross-attention shapes, "
                         "GPU time")
    args = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    if args.sweep:
        return sweep_short(args, device, dtype)
    shapes = {k: (h, q // 16, min(kv, 77) if kv == 77 else kv // 16, n) for k, (h, q, kv, n) in SHAPES.items()} \
        if args.tiny else SHAPES
    backends = {k: BACKENDS[k] for k in (args.only or ([] if args.tiny else [k for k in BACKENDS if k != "math"]))} \
        or {"math": BACKENDS["math"]}
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} batch {args.batch}", flush=True)
    totals: dict[str, float] = {}
    for name, (h, q, kv, layers) in shapes.items():
        for bname, backend in backends.items():
            try:
                ms = time_backend(backend, args.batch, h, q, kv, 64, args.iters, device, dtype, args.layout,
                                  args.kernel_time)
            except (RuntimeError, ImportError, AssertionError) as e:  # a backend that does not take this
                # shape/device or is not installed (fa4), or FA4's own checks: say so, time the rest
                print(json.dumps({"shape": name, "backend": bname, "error": str(e).splitlines()[0][:200]}), flush=True)
                totals[bname] = float("nan")
                continue
            totals[bname] = totals.get(bname, 0.0) + ms * layers
            row = {"shape": name, "backend": bname, "ms_fwd_bwd": round(ms, 3), "layers": layers}
            if bname == "short":
                row["max_rel_diff_vs_fp32"] = check_short(args.batch, h, q, kv, 64, device, dtype)
            print(json.dumps(row), flush=True)
    print(json.dumps({"sdxl_attention_ms_per_step": {k: round(v, 1) for k, v in totals.items()},
                      "batch": args.batch, "layout": args.layout}), flush=True)


if __name__ == "__main__":
    main()
