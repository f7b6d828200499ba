"""A Triton attention for few keys (at most 128: SDXL's cross-attention to its 77 text tokens), measured
against cuDNN's and not kept in the trainer (benchmarks/RESULTS.md#levers-measured-and-not-kept; it was
`train.short_attention` at commit 4372560). benchmarks/attention_backends.py times it ("short") and sweeps its
launch settings.

Why it was tried: SDXL's cross-attention attends from every latent token to the 77 text tokens, and a
flash kernel is built for long key sequences (its backward runs one program per block of keys and walks
every query block in turn: with one block of 77 keys per (image, head), a few hundred programs each loop
over all the queries). Reading and writing the cross-attention's tensors once takes about 7 ms of a batch-16
step on an H200; cuDNN's kernels took about 17 ms there. Here all the keys fit one tile: the forward is
one pass per query block (no running softmax), and the backward splits each (image, head)'s queries over a
few programs that each keep the keys' gradients in registers and add them to the result once, in fp32.
What it gave: about cuDNN's time alone with its best launch settings, and a slower step with its first ones.

On the CPU (and without Triton) the same custom ops run the formulas in torch.
"""
from __future__ import annotations

import math

import torch

try:  # Triton comes with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

_LOG2E = 1.4426950408889634


def _short_attention_reference(q, k, v, scale):
    """(out, lse) in fp32 math: lse is log2-based (log2 of the softmax denominator, the scores in log2
    units), one row per (image, head) pair: [b * heads, queries]."""
    s = (q.float() @ k.float().transpose(-2, -1)) * (scale * _LOG2E)
    lse = torch.logsumexp(s * math.log(2.0), dim=-1) * _LOG2E
    p = torch.exp2(s - lse[..., None])
    out = (p @ v.float()).to(q.dtype)
    b, h, m, _ = q.shape
    return out, lse.reshape(b * h, m)


def _short_attention_backward_reference(grad, q, k, v, out, lse, scale):
    b, h, m, _ = q.shape
    qf, kf, vf, gf = q.float(), k.float(), v.float(), grad.float()
    p = torch.exp2((qf @ kf.transpose(-2, -1)) * (scale * _LOG2E) - lse.reshape(b, h, m, 1))
    delta = (gf * out.float()).sum(-1, keepdim=True)
    ds = p * (gf @ vf.transpose(-2, -1) - delta)
    return ((ds @ kf) * scale).to(q.dtype), ((ds.transpose(-2, -1) @ qf) * scale).to(k.dtype), \
        (p.transpose(-2, -1) @ gf).to(v.dtype)


if triton is not None:
    @triton.jit
    def _short_attention_fwd_kernel(q, k, v, o, lse, qk_scale, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                                    sob, soh, som, heads, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    D: tl.constexpr):
        # One program: BLOCK_M queries of one (image, head) against all n (<= BLOCK_N) keys.
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        keys = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        rmask = rows < m
        kmask = keys < n
        qt = tl.load(q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :], mask=rmask[:, None], other=0.0)
        kt = tl.load(k + b * skb + h * skh + keys[:, None] * skn + dims[None, :], mask=kmask[:, None], other=0.0)
        vt = tl.load(v + b * svb + h * svh + keys[:, None] * svn + dims[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(qt, tl.trans(kt)) * qk_scale  # log2 units
        s = tl.where(kmask[None, :], s, float("-inf"))
        top = tl.max(s, 1)
        p = tl.exp2(s - top[:, None])
        total = tl.sum(p, 1)
        acc = tl.dot(p.to(vt.dtype), vt) / total[:, None]
        tl.store(o + b * sob + h * soh + rows[:, None] * som + dims[None, :], acc.to(o.dtype.element_ty),
                 mask=rmask[:, None])
        tl.store(lse + bh.to(tl.int64) * m + rows, top + tl.log2(total), mask=rmask)

    @triton.jit
    def _short_attention_bwd_kernel(g, q, k, v, o, lse, dq, dk, dv, qk_scale, scale,
                                    sgb, sgh, sgm, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                                    sdb, sdh, sdm, heads, m, n, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr, D: tl.constexpr):
        # One program: the query blocks part, part + SPLIT, ... of one (image, head). dq is written per
        # block; the keys' gradients are summed over the program's blocks, then added to dk/dv (fp32,
        # [b * heads, n, D]) once.
        part = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        keys = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        kmask = keys < n
        kt = tl.load(k + b * skb + h * skh + keys[:, None] * skn + dims[None, :], mask=kmask[:, None], other=0.0)
        vt = tl.load(v + b * svb + h * svh + keys[:, None] * svn + dims[None, :], mask=kmask[:, None], other=0.0)
        dk_acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv_acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        for start in range(0, m, SPLIT * BLOCK_M):
            rows = start + part * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < m
            qt = tl.load(q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :], mask=rmask[:, None], other=0.0)
            gt = tl.load(g + b * sgb + h * sgh + rows[:, None] * sgm + dims[None, :], mask=rmask[:, None], other=0.0)
            ot = tl.load(o + b * sob + h * soh + rows[:, None] * som + dims[None, :], mask=rmask[:, None], other=0.0)
            lt = tl.load(lse + bh.to(tl.int64) * m + rows, mask=rmask, other=0.0)
            s = tl.dot(qt, tl.trans(kt)) * qk_scale
            p = tl.exp2(s - lt[:, None])
            p = tl.where(rmask[:, None] & kmask[None, :], p, 0.0)
            delta = tl.sum(gt.to(tl.float32) * ot.to(tl.float32), 1)
            dv_acc += tl.dot(tl.trans(p.to(gt.dtype)), gt)
            dp = tl.dot(gt, tl.trans(vt))
            ds = (p * (dp - delta[:, None])).to(qt.dtype)
            dqt = tl.dot(ds, kt) * scale
            tl.store(dq + b * sdb + h * sdh + rows[:, None] * sdm + dims[None, :], dqt.to(dq.dtype.element_ty),
                     mask=rmask[:, None])
            dk_acc += tl.dot(tl.trans(ds), qt)
        offsets = bh.to(tl.int64) * n * D + keys[:, None] * D + dims[None, :]
        if SPLIT == 1:
            tl.store(dk + offsets, dk_acc * scale, mask=kmask[:, None])
            tl.store(dv + offsets, dv_acc, mask=kmask[:, None])
        else:
            tl.atomic_add(dk + offsets, dk_acc * scale, mask=kmask[:, None], sem="relaxed")
            tl.atomic_add(dv + offsets, dv_acc, mask=kmask[:, None], sem="relaxed")


# Launch settings of the two kernels (attention_backends.py --sweep tries others): queries per
# program and warps; the backward's programs per multiprocessor (each (image, head)'s query blocks are split
# over enough programs to give every SM this many).
# The best of round 8's sweep (15.94 GPU-ms for SDXL's cross-attention at batch 16, cuDNN 19.12); the step
# measured in round 8 ran the first settings (forward 128/8, backward 64/8: 19.45 in the sweep).
SHORT_ATTENTION_CONFIG = {"fwd_block_m": 128, "fwd_warps": 4, "bwd_block_m": 128, "bwd_warps": 8, "bwd_per_sm": 4}


def _kernel_takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.shape[-2] <= 128
            and 16 <= d <= 128 and d & (d - 1) == 0)


def short_attention_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernels take these (batch, heads, tokens, dim) tensors: CUDA with Triton, bf16/fp16, at
    most 128 keys, a head dimension of 16-128 that is a power of two. (The custom ops run the same formulas
    in torch where they do not: the CPU.)"""
    return _kernel_takes(q, k)


def _out_like(q: torch.Tensor) -> torch.Tensor:
    # (batch, heads, tokens, dim) as a view of (batch, tokens, heads, dim) memory: what the attention
    # processors reshape to (batch, tokens, channels) next, for free.
    b, h, m, d = q.shape
    return q.new_empty(b, m, h, d).transpose(1, 2)


def _last_dim_contiguous(*tensors):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


@torch.library.custom_op("sdxl_lora_bench::short_attention", mutates_args=())
def short_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _kernel_takes(q, k):
        out, lse = _short_attention_reference(q, k, v, scale)
        return _out_like(q).copy_(out), lse
    q, k, v = _last_dim_contiguous(q, k, v)
    b, heads, m, d = q.shape
    n = k.shape[-2]
    out = _out_like(q)
    lse = q.new_empty(b * heads, m, dtype=torch.float32)
    cfg = SHORT_ATTENTION_CONFIG
    block_m = cfg["fwd_block_m"]
    _short_attention_fwd_kernel[(triton.cdiv(m, block_m), b * heads)](
        q, k, v, out, lse, scale * _LOG2E, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, m, n, BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(n)), D=d, num_warps=cfg["fwd_warps"])
    return out, lse


@short_attention_forward.register_fake
def _(q, k, v, scale):
    b, heads, m, _ = q.shape
    return _out_like(q), q.new_empty(b * heads, m, dtype=torch.float32)


@torch.library.custom_op("sdxl_lora_bench::short_attention_backward", mutates_args=())
def short_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, heads, m, d = q.shape
    n = k.shape[-2]
    dq = _out_like(q)
    if not _kernel_takes(q, k):
        gq, gk, gv = _short_attention_backward_reference(grad, q, k, v, out, lse, scale)
        return dq.copy_(gq), gk.contiguous(), gv.contiguous()
    grad, q, k, v, out = _last_dim_contiguous(grad, q, k, v, out)
    cfg = SHORT_ATTENTION_CONFIG
    block_m = cfg["bwd_block_m"]
    blocks = triton.cdiv(m, block_m)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    split = max(1, min(blocks, triton.cdiv(cfg["bwd_per_sm"] * sms, b * heads)))
    acc = torch.zeros if split > 1 else torch.empty
    dk = acc(b * heads, n, d, dtype=torch.float32, device=q.device)
    dv = acc(b * heads, n, d, dtype=torch.float32, device=q.device)
    _short_attention_bwd_kernel[(split, b * heads)](
        grad, q, k, v, out, lse, dq, dk, dv, scale * _LOG2E, scale, *grad.stride()[:3], *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *dq.stride()[:3], heads, m, n, SPLIT=split,
        BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(n)), D=d, num_warps=cfg["bwd_warps"])
    return dq, dk.to(k.dtype).reshape(b, heads, n, d), dv.to(v.dtype).reshape(b, heads, n, d)


@short_attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale):
    b, heads, n, d = k.shape
    return _out_like(q), k.new_empty(b, heads, n, d), v.new_empty(b, heads, n, d)


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, scale):
        return short_attention_forward(q, k, v, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = short_attention_backward(grad, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for (batch, heads, tokens, dim) tensors with few keys (at most 128: SDXL's
    cross-attention to its 77 text tokens), by the kernels above where short_attention_supported, else by
    the same formulas in torch (the CPU). The output is a (batch, heads, tokens, dim) view of (batch, tokens,
    heads, dim) memory."""
    return _ShortAttention.apply(q, k, v, q.shape[-1] ** -0.5)[0]
