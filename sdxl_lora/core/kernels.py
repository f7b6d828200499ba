"""The 4-bit dequantization of QLoRA's Linears as one hand-written Triton kernel, where bitsandbytes
launches three (benchmarks/RESULTS.md#kernels-measured-alone). On the CPU (and without Triton) the same
custom op runs its torch reference: the same values.
"""
from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None


# ---- 4-bit dequantization (QLoRA: model.quantize = "nf4"/"fp4") ----
#
# bitsandbytes stores a 4-bit weight as two values a byte (the first in the high nibble), indices into a
# 16-value code (nf4 or fp4), with one fp32 scale per block of 64 values; with double quantization (our
# model.quant_double, on by default) the scales are themselves 8-bit codes into a 256-value code, with one
# fp32 scale per 256 of them plus an offset. bitsandbytes dequantizes those in three kernels (the scales'
# codes, the offset, then the weight) and a QLoRA step dequantizes every 4-bit Linear two or three times
# (forward, the checkpointed recompute, backward): ~1,000 calls a batch-4 SDXL step. Here it is one kernel.
# (A torch.compile of the reference below is slower than bitsandbytes' kernels:
# benchmarks/RESULTS.md#kernels-measured-alone.)

def _dequantize_4bit_reference(out: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
                               blocksize: int, code2: torch.Tensor | None, absmax2: torch.Tensor | None,
                               offset: torch.Tensor | None, blocksize2: int) -> None:
    """The dequantization as torch ops over the flat output index, into `out` (contiguous, any shape)."""
    flat = out.view(-1)
    i = torch.arange(flat.numel(), device=out.device)
    byte = packed.reshape(-1)[i // 2].to(torch.int32)
    nibble = torch.where(i % 2 == 0, byte >> 4, byte & 0xF)
    block = i // blocksize
    if code2 is None:
        scale = absmax[block]
    else:
        scale = code2[absmax[block].to(torch.int32)] * absmax2[block // blocksize2]
        scale = scale + offset  # rounded apart, as bitsandbytes does (no fused multiply-add)
    flat.copy_(code[nibble] * scale)


if triton is not None:
    @triton.jit
    def _dequantize_4bit_kernel(packed_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, out_ptr,
                                n_out, BYTES_PER_BLOCK: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                                NESTED: tl.constexpr, BLOCK: tl.constexpr):
        # One program: BLOCK bytes in, 2 x BLOCK values out (byte i gives values 2i and 2i + 1).
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = 2 * offs < n_out
        byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
        block = offs // BYTES_PER_BLOCK
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
            # Multiply, then add: launched without fp fusion, so no fused multiply-add rounds differently
            # from bitsandbytes' two kernels.
            scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0.0)
            scale = scale + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
        hi = tl.load(code_ptr + (byte >> 4)) * scale
        lo = tl.load(code_ptr + (byte & 0xF)) * scale
        out_offs = 2 * start + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + out_offs, tl.interleave(hi, lo).to(out_ptr.dtype.element_ty), mask=out_offs < n_out)


@torch.library.custom_op("sdxl_lora::dequantize_4bit", mutates_args=("out",))
def dequantize_4bit(out: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
                    blocksize: int, code2: torch.Tensor | None, absmax2: torch.Tensor | None,
                    offset: torch.Tensor | None, blocksize2: int) -> None:
    """bitsandbytes' 4-bit dequantization into `out` (contiguous): one Triton kernel on CUDA, the same
    values as bitsandbytes.functional.dequantize_4bit (tested against it on the CPU through the reference,
    checked on the GPU by benchmarks/dequant4bit.py)."""
    if not (out.is_cuda and triton is not None):
        return _dequantize_4bit_reference(out, packed, code, absmax, blocksize, code2, absmax2, offset, blocksize2)
    nested = code2 is not None
    n_out, block = out.numel(), 1024
    _dequantize_4bit_kernel[(triton.cdiv(n_out, 2 * block),)](
        packed, code, absmax, code2 if nested else code, absmax2 if nested else absmax,
        offset if nested else absmax, out, n_out, BYTES_PER_BLOCK=blocksize // 2, BLOCKSIZE2=max(blocksize2, 1),
        NESTED=nested, BLOCK=block, num_warps=4, enable_fp_fusion=False)


# ---- rows of a table in pinned host memory, read by the GPU (llm.offload_embeddings) ----
#
# A pinned host tensor has a device address under CUDA's unified addressing, so a kernel can read it over the
# bus. torch has no op that indexes host memory from the device (its indexing kernels need the table on the
# device), and looking the rows up on the host makes it wait for the token ids every step; this kernel reads
# only the rows the ids name, with the ids staying on the device.

if triton is not None:
    @triton.jit
    def _gather_rows_kernel(table_ptr, ids_ptr, out_ptr, width, BLOCK: tl.constexpr):
        # One program: BLOCK columns of one output row.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        src = tl.load(ids_ptr + row).to(tl.int64)
        tl.store(out_ptr + row * width + cols, tl.load(table_ptr + src * width + cols, mask=mask), mask=mask)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = table[ids[i]] for a 2-D contiguous `table` in pinned host memory and flat `ids` and `out` on a
    CUDA device: one Triton kernel reads the rows over the bus. (Elsewhere the caller looks rows up itself.)"""
    width = table.shape[1]
    block = min(triton.next_power_of_2(width), 1024)
    _gather_rows_kernel[(ids.numel(), triton.cdiv(width, block))](table, ids, out, width, BLOCK=block, num_warps=4)
    return out
