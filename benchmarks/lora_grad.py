"""One Triton kernel for the two products of a LoRA'd projection's backward that read the output's gradient
dy: dh = dy B (the rank-r input of A's gradient) and B's gradient dy^T h. Measured by
benchmarks/lora_linear.py (variant `merged_fusedgrad`) and not kept: faster alone, but inside the projections no
faster (benchmarks/RESULTS.md#levers-measured-and-not-kept).

Why: with train.lora_matmul="merged" a projection's backward still runs dy @ B and dy^T @ h as two cuBLAS
calls, each reading all of dy (N or K = r: bound by the memory), so dy is read twice where once would do. Here each program reads its rows of dy once,
block by block along N, and from each block adds its share to both: dh's rows stay in registers, B's
gradient (N x r, small) is summed in fp32 by atomic adds.

On the CPU (and without Triton) `lora_dy_products` is the two matmuls.
"""
from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


if triton is not None:
    @triton.jit
    def _dy_products_kernel(dy, b, h, dh, db, m, n, r, sdy, sb, sh, sdh, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, R: tl.constexpr):
        # One program: BLOCK_M rows of dy, walked along N in BLOCK_N columns; R >= r (a power of 2, >= 16).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, R)
        row_ok = rows < m
        rank_ok = ranks < r
        h_blk = tl.load(h + rows[:, None] * sh + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n
            dy_blk = tl.load(dy + rows[:, None] * sdy + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                             other=0.0)
            b_blk = tl.load(b + cols[:, None] * sb + ranks[None, :], mask=col_ok[:, None] & rank_ok[None, :],
                            other=0.0)
            acc += tl.dot(dy_blk, b_blk)
            part = tl.dot(tl.trans(dy_blk), h_blk)  # [BLOCK_N, R]: this block's rows' share of B's gradient
            tl.atomic_add(db + cols[:, None] * R + ranks[None, :], part, mask=col_ok[:, None] & rank_ok[None, :],
                          sem="relaxed")
        tl.store(dh + rows[:, None] * sdh + ranks[None, :], acc.to(dh.dtype.element_ty),
                 mask=row_ok[:, None] & rank_ok[None, :])


def lora_dy_products(dy: torch.Tensor, b: torch.Tensor, h: torch.Tensor, block_m: int = 64, block_n: int = 64,
                     warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy @ b, dy^T @ h) for dy [M, N], b [N, r], h [M, r], in dy's dtype (B's gradient summed in fp32)."""
    m, n = dy.shape
    r = b.shape[1]
    if triton is None or not dy.is_cuda and not _interpreting():
        return dy @ b, dy.t() @ h
    dy, b, h = (t if t.stride(-1) == 1 else t.contiguous() for t in (dy, b, h))
    big_r = max(16, triton.next_power_of_2(r))
    dh = torch.empty(m, r, dtype=dy.dtype, device=dy.device)
    db = torch.zeros(n, big_r, dtype=torch.float32, device=dy.device)
    _dy_products_kernel[(triton.cdiv(m, block_m),)](dy, b, h, dh, db, m, n, r, dy.stride(0), b.stride(0),
                                                     h.stride(0), dh.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                                                     R=big_r, num_warps=warps)
    return dh, db[:, :r].to(dy.dtype)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


# Batch 16's shapes (rows M, dy's width N, rank r) and how many projections of each a step has (merged LoRA:
# the 32x32 stages' out, cross-attention q and out, and fused q/k/v; the 64x64 stages' likewise).
SHAPES = {"32 single": (16384, 1280, 16, 180), "32 q/k/v": (16384, 3840, 48, 60),
          "64 single": (65536, 640, 16, 30), "64 q/k/v": (65536, 1920, 48, 10)}
SETTINGS = [(bm, bn, w) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8)]


def main(argv=None) -> None:
    """python benchmarks/lora_grad.py [--iters 20]: GPU time of the kernel's launch settings against cuBLAS's
    two products, per shape and summed over a batch-16 step, and the largest difference from fp32 math."""
    import argparse
    import json

    from timing import gpu_ms  # benchmarks/timing.py (this script's folder is on the path)

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    best = {}
    for name, (m, n, r, calls) in SHAPES.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        dy, b, h = (torch.randn(*s, generator=g).cuda().bfloat16() for s in ((m, n), (n, r), (m, r)))
        ref = (dy.float() @ b.float(), dy.float().t() @ h.float())
        rows = [{"setting": "cublas", "gpu_ms": gpu_ms(lambda: (dy @ b, dy.t() @ h), args.iters)}]
        for bm, bn, w in SETTINGS:
            try:
                got = lora_dy_products(dy, b, h, bm, bn, w)
                err = max(((u.float() - v).abs().max() / v.abs().max()).item() for u, v in zip(got, ref))
                rows.append({"setting": [bm, bn, w], "gpu_ms": gpu_ms(lambda: lora_dy_products(dy, b, h, bm, bn, w),
                                                                     args.iters), "max_rel_err": round(err, 5)})
            except Exception as e:  # a setting Triton cannot build (registers, shared memory) must not stop the rest
                rows.append({"setting": [bm, bn, w], "error": str(e)[:120]})
        for row in rows:
            print(json.dumps({"shape": name, "M": m, "N": n, "r": r, **row}), flush=True)
        timed = [row for row in rows[1:] if "gpu_ms" in row]
        if timed:
            best[name] = (rows[0]["gpu_ms"] * calls, min(timed, key=lambda row: row["gpu_ms"]), calls)
    print(json.dumps({"per_step_ms": {name: {"cublas": round(c, 2), "kernel": round(k["gpu_ms"] * calls, 2),
                                             "setting": k["setting"]} for name, (c, k, calls) in best.items()},
                      "cublas_total": round(sum(c for c, _, _ in best.values()), 2),
                      "kernel_total": round(sum(k["gpu_ms"] * calls for _, k, calls in best.values()), 2)}), flush=True)


if __name__ == "__main__":
    main()
