"""LoRA's products, computed with fewer kernels than peft's (train.lora_matmul), over peft's own layers.

peft computes a LoRA'd projection as base(x) + B(A(x)) * s: besides the frozen GEMM, a rank-r product
that writes a whole output-sized tensor, an add that reads it and the base output again, and in the
backward a rank-r product that reads the output's gradient once more. These are memory-bound matmuls. A
way with fewer of them (neither peft nor diffusers has one: peft's Linear always adds its LoRA output to
the base layer's):
  "merged"  y = x @ (W + s B A)^T: the delta added to the frozen weight (one small GEMM over the weight,
            rounded once to the compute dtype) and one GEMM each way; A's and B's gradients are exact
            products of the output's gradient, as peft's. The forward sees the delta at the weight's
            precision (bf16: 2^-9 of each weight), not at its own; peft's bf16 output, rounded at 2^-9 of
            its own size, loses as much of a small delta: merged's output and gradients are as close to
            fp32 as peft's (tests/sdxl/test_speed.py). In fp32 both are exact. The default.
The trainable parameters stay peft's own, so saving and export are unchanged. A task decides where to use
them (sdxl/speed.py: the UNet's fused attention projections).

DoRA takes the same products: peft's DoRA forward is (m / ||W + sBA||) * (x W^T + s x A^T B^T) + bias with
the norm detached (the paper's section 4.3), so its projection is LoRA's times a per-output scale
(dora_scale), and fused projections scale each one's columns by its own.

The scaling reaches these products as a tensor (TensorScaling), not peft's float: a compiled region guards on a
float's value, so blocks whose layers scale differently (rsLoRA, per-layer ranks, conv_alpha) would each compile.
"""
from __future__ import annotations

import copy
from collections.abc import MutableMapping

import torch
import torch.nn.functional as F

def base_linear(layer: torch.nn.Module) -> torch.nn.Module:
    return getattr(layer, "base_layer", layer)


def dequantizable(base: torch.nn.Module) -> bool:
    """A frozen quantized Linear of ours that rebuilds its weight (`dequantized(dtype, out=)`): bitsandbytes
    4-bit (nf4/fp4) or fp8 (core/quantize.py). LLM.int8 is not: its product splits outlier columns off,
    which one dequantized weight does not reproduce."""
    return hasattr(base, "dequantized") and hasattr(base, "in_features")


def _dequantized(bases: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The weights of `bases` dequantized to `dtype`, stacked along the output dimension into one new buffer."""
    out = torch.empty(sum(b.out_features for b in bases), bases[0].in_features, dtype=dtype,
                      device=bases[0].weight.device)
    for base, part in zip(bases, out.split([b.out_features for b in bases])):
        base.dequantized(dtype, out=part)
    return out


class TensorScaling(dict):
    """peft's `layer.scaling` (adapter -> float) that also holds each value in a 0-d fp32 buffer of the layer (not
    persistent: state_dict, saving and export see peft's floats only), which the fast paths read (lora_factors).
    torch.compile guards on a float's value, so each distinct scaling would compile a region again (past the
    recompile limit, eager); a tensor is a graph input, guarded on its shape, dtype and device only.

    Every write goes through __setitem__: peft's update_layer, set_scale, scale_layer and unscale_layer (diffusers'
    cross_attention_kwargs={"scale": ...} and set_adapters call them) fill the buffer in place, found by name on the
    layer at each write, so after model.to() (which replaces buffers) the current one is written, and a CUDA graph
    that captured it replays the new value. The float stays the one value; the buffer is only ever its copy. Like
    any tensor a backward needs, it must not change between a forward and its backward (autograd says so); and
    model.to(dtype) casts it with the layer's factors."""

    def __init__(self, layer: torch.nn.Module, values: dict):
        super().__init__()
        self.layer = layer
        for adapter, value in values.items():
            self[adapter] = value

    @staticmethod
    def buffer_name(adapter: str) -> str:
        return f"scaling_tensor_{adapter}"

    def __setitem__(self, adapter, value) -> None:
        super().__setitem__(adapter, value)
        layer = self.__dict__.get("layer")
        if layer is None or "_buffers" not in layer.__dict__:  # being unpickled or copied: the layer brings its own
            return
        name = self.buffer_name(adapter)
        if name in layer._buffers:
            with torch.no_grad():
                layer._buffers[name].fill_(float(value))
        else:  # on the base's device, where peft moves a new adapter's factors once its scaling is set
            device = layer.get_base_layer().weight.device
            layer.register_buffer(name, torch.tensor(float(value), dtype=torch.float32, device=device),
                                  persistent=False)

    def __delitem__(self, adapter) -> None:  # peft's delete_adapter
        super().__delitem__(adapter)
        self.layer._buffers.pop(self.buffer_name(adapter), None)

    # dict's own update, setdefault, pop... would bypass __setitem__/__delitem__ and leave a buffer stale.
    update, setdefault, pop, popitem, clear = (MutableMapping.update, MutableMapping.setdefault, MutableMapping.pop,
                                               MutableMapping.popitem, MutableMapping.clear)

    def __ior__(self, other):
        self.update(other)
        return self

    def copy(self) -> dict:
        """A plain dict: a TensorScaling that is not its layer's own would write the layer's buffer."""
        return dict(self)

    __copy__ = copy

    def __deepcopy__(self, memo) -> dict:
        """Inside a copy of its layer (copy.deepcopy(model)), bound to the copy; alone, a plain dict (as copy)."""
        new_layer = memo.get(id(self.layer))
        if new_layer is None:
            return dict(self)
        new = TensorScaling.__new__(TensorScaling)
        dict.update(new, copy.deepcopy(dict(self), memo))
        new.layer = new_layer
        return new


def use_tensor_scaling(layer: torch.nn.Module) -> None:
    """Gives a peft LoRA layer its scaling as tensors too (TensorScaling), once; a fast path's set-up calls it on
    each layer it takes over, before anything is compiled."""
    if hasattr(layer, "lora_A") and type(layer.scaling) is not TensorScaling:
        layer.scaling = TensorScaling(layer, layer.scaling)


def _scaling(layer: torch.nn.Module, adapter: str) -> torch.Tensor | float:
    """The adapter's scaling: the layer's buffer where it has one (use_tensor_scaling), else peft's float."""
    if type(layer.scaling) is TensorScaling:
        return getattr(layer, TensorScaling.buffer_name(adapter))
    return layer.scaling[adapter]


_NO_LORA = ()


def lora_factors(layer: torch.nn.Module, dora: bool = False) -> tuple | None:
    """The active plain-LoRA factors of a projection as (A, B, scaling), the scaling a 0-d tensor where the layer
    has one (use_tensor_scaling), else peft's float; _NO_LORA without LoRA, or None where
    fusing would not reproduce its forward: dropout, DoRA (unless `dora`) or another variant, several
    adapters, a merged or disabled adapter. With `dora`, (A, B, scaling, magnitude), magnitude None for a
    plain LoRA layer."""
    if not hasattr(layer, "lora_A"):
        return _NO_LORA if type(layer) is torch.nn.Linear else None
    if layer.merged or layer.disable_adapters:
        return None
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    if not names:
        return _NO_LORA
    a = names[0]
    magnitude = layer.lora_magnitude_vector[a].weight if a in getattr(layer, "lora_magnitude_vector", {}) else None
    if len(names) > 1 or (a in layer.lora_variant and not (dora and magnitude is not None)) \
            or not isinstance(layer.lora_dropout[a], torch.nn.Identity) or layer.lora_bias.get(a, False):
        return None
    if dora:
        return layer.lora_A[a].weight, layer.lora_B[a].weight, _scaling(layer, a), magnitude
    return layer.lora_A[a].weight, layer.lora_B[a].weight, _scaling(layer, a)


def dora_scale(w: torch.Tensor | tuple, a: torch.Tensor, b: torch.Tensor, magnitudes: list,
               widths: list[int], dtype: torch.dtype) -> torch.Tensor:
    """DoRA's per-output scale m / ||W + B A|| for stacked projections (`w` a weight or a tuple of quantized
    layers, `b` with each one's scaling in it, one magnitude per projection, None for a plain LoRA one: 1).
    The norm is detached, as in peft; the magnitudes get their gradient through the division."""
    with torch.no_grad():
        full = _dequantized(w, dtype) if isinstance(w, tuple) else w.to(dtype)
        full = torch.addmm(full, b.to(dtype), a.to(dtype))
        norm = torch.linalg.vector_norm(full, dim=1, dtype=torch.float32)
    parts = [n.new_ones(n.shape) if m is None else m.float().reshape(-1) / n
             for m, n in zip(magnitudes, norm.split(widths))]
    return torch.cat(parts)


# train.lora_matmul="merged" reads and writes a weight-sized tensor per call: it pays only where the
# activation has at least this many rows (tokens) per column of the weight.
LORA_WAY_MIN_ROWS_PER_COLUMN = 1.0


def lora_way(matmul: str, x: torch.Tensor, in_features: int) -> str:
    """train.lora_matmul's way for one product, or "peft" where it would cost more than it saves (SDXL: the
    cross-attention's k/v over 77 text tokens, the 32x32 stages at batch 1). Shapes are fixed per compiled
    graph, so is the choice."""
    rows = x.numel() // x.shape[-1]
    return matmul if rows >= LORA_WAY_MIN_ROWS_PER_COLUMN * in_features else "peft"


class _LoRAMerged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, a, b):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = F.linear(x2, torch.addmm(w, b, a), bias)
        ctx.save_for_backward(x2, h, w, a, b)  # what peft's keeps; W + s B A is made again in the backward
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dy2 @ b
        dx = (dy2 @ torch.addmm(w, b, a)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, None, None, dh.t() @ x2, dy2.t() @ h


class _LoRAMergedQuantized(torch.autograd.Function):
    """"merged" for quantized frozen bases (a tuple of them, stacked along the output): the weight
    dequantized into a new buffer, the delta added to it in place, one GEMM each way; the backward
    dequantizes again instead of saving the weight, as bitsandbytes' own 4-bit matmul does: a saved
    compute-dtype copy of every quantized weight would undo the quantization's memory saving."""

    @staticmethod
    def forward(ctx, x, bias, a, b, bases):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = F.linear(x2, _dequantized(bases, x.dtype).addmm_(b, a), bias)
        ctx.save_for_backward(x2, h, a, b)
        ctx.bases, ctx.x_shape = bases, x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, h, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dy2 @ b
        dx = (dy2 @ _dequantized(ctx.bases, dy.dtype).addmm_(b, a)).reshape(ctx.x_shape) \
            if ctx.needs_input_grad[0] else None
        return dx, None, dh.t() @ x2, dy2.t() @ h, None


class _LoRAConvMerged(torch.autograd.Function):
    """"merged" for a LoRA'd 2-D convolution (LoCon) in peft's layout: A a rank-r convolution with the base's
    kernel, stride and padding, B a 1x1 one back (scaling folded in). y = conv(x, W + B A): one convolution
    each way where peft runs three (the base's, A's and B's) and adds two outputs the size of the base's. The
    input's gradient is a transposed convolution with the same merged weight (an aten.convolution: compiled
    backward graphs keep their channels_last layout, as with sdxl/speed.py's _Conv2dGrad).

    A's own products (h = A x for B's gradient, and A's gradient) are GEMMs over the pixels, not cuDNN
    convolutions: a convolution with r output channels, and its weight gradient, run far below the memory
    bandwidth (benchmarks/lora_conv.py). x [pixels, C] @ A's taps [C, k*k*r] gives every tap's product at
    every pixel; h sums each output pixel's k*k taps from their shifted positions, and A's gradient is x^T
    @ dh spread back to the taps."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, stride, padding):
        y = F.conv2d(x, _conv_merged(w, a, b), bias, stride, padding)
        h = _taps_sum(_pixels(x) @ _taps(a), x.shape, a.shape, stride, padding, y.shape[2:])
        ctx.save_for_backward(x, h, w, a, b)
        ctx.conv = (stride, padding)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, w, a, b = ctx.saved_tensors
        stride, padding = ctx.conv
        dy2 = _pixels(dy)
        dh = dy2 @ b.reshape(b.shape[0], -1)  # dy through B's 1x1 map: [pixels, r]
        dx = conv_input_gradient(dy, _conv_merged(w, a, b), x.shape[2:], stride, padding) \
            if ctx.needs_input_grad[0] else None
        dz = _taps_spread(dh.reshape(dy.shape[0], *dy.shape[2:], -1), x.shape, a.shape, stride, padding)
        r, c, kh, kw = a.shape
        da = (_pixels(x).t() @ dz).reshape(c, kh, kw, r).permute(3, 0, 1, 2)
        db = (dy2.t() @ h.reshape(-1, r)).reshape(b.shape)
        return dx, None, None, da, db, None, None


def conv_input_gradient(grad: torch.Tensor, weight: torch.Tensor, x_size, stride, padding, dilation=(1, 1),
                        groups: int = 1) -> torch.Tensor:
    """A 2-D convolution's input gradient as the transposed convolution of the output's gradient with the same
    weight (cuDNN's dgrad kernel, as an aten.convolution); output_padding restores what a strided convolution's
    output size leaves out of the input's."""
    extra = [n - ((g - 1) * s - 2 * p + d * (k - 1) + 1) for n, g, s, p, d, k in zip(
        x_size, grad.shape[2:], stride, padding, dilation, weight.shape[2:])]
    return F.conv_transpose2d(grad, weight, None, stride, padding, extra, groups, dilation)


def _pixels(t: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] as [N*H*W, C] (a view where t is channels_last)."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def _taps(a: torch.Tensor) -> torch.Tensor:
    """A [r, C, kh, kw] as [C, kh*kw*r]: every tap's r columns side by side."""
    return a.permute(1, 2, 3, 0).reshape(a.shape[1], -1)


def _tap_slices(a_shape, stride, padding, out_hw):
    """For each tap (u, v): the output pixels' positions in the padded input, as slices of its rows and columns."""
    (ho, wo), (s0, s1) = out_hw, stride
    return [(u, v, slice(u, u + s0 * (ho - 1) + 1, s0), slice(v, v + s1 * (wo - 1) + 1, s1))
            for u in range(a_shape[2]) for v in range(a_shape[3])]


def _taps_sum(z: torch.Tensor, x_shape, a_shape, stride, padding, out_hw) -> torch.Tensor:
    """h [N, Ho, Wo, r] = conv(x, A) from z = x @ taps [N*H*W, kh*kw*r]: each output pixel's taps summed."""
    n, _, height, width = x_shape
    r, _, kh, kw = a_shape
    z = z.reshape(n, height, width, kh, kw, r)
    zp = F.pad(z, (0, 0, 0, 0, 0, 0, padding[1], padding[1], padding[0], padding[0]))
    return sum(zp[:, rows, cols, u, v] for u, v, rows, cols in _tap_slices(a_shape, stride, padding, out_hw))


def _taps_spread(dh: torch.Tensor, x_shape, a_shape, stride, padding) -> torch.Tensor:
    """The adjoint of _taps_sum: dh [N, Ho, Wo, r] spread to each tap's input pixel, as [N*H*W, kh*kw*r]."""
    n, _, height, width = x_shape
    r, _, kh, kw = a_shape
    p0, p1 = padding
    dzp = dh.new_zeros(n, height + 2 * p0, width + 2 * p1, kh, kw, r)
    for u, v, rows, cols in _tap_slices(a_shape, stride, padding, dh.shape[1:3]):
        dzp[:, rows, cols, u, v] = dh
    return dzp[:, p0:p0 + height, p1:p1 + width].reshape(-1, kh * kw * r)


def _conv_merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W + B A for a convolution's weight [out, in, kh, kw], A [r, in, kh, kw] and B [out, r, 1, 1], in W's layout."""
    return w + (b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1)).reshape(w.shape)


def lora_conv_pays(x: torch.Tensor, weight: torch.Tensor, stride) -> bool:
    """Whether "merged" pays for a convolution: the merged weight is read and written each way, so it pays where
    the output has at least LORA_WAY_MIN_ROWS_PER_COLUMN pixels (batch x height x width) per weight column
    (input channels x kernel size), as for a Linear's rows (lora_way)."""
    pixels = x.shape[0] * (x.shape[2] // stride[0]) * (x.shape[3] // stride[1])
    return pixels >= LORA_WAY_MIN_ROWS_PER_COLUMN * weight[0].numel()


def lora_conv2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                stride, padding) -> torch.Tensor:
    """F.conv2d(x, w, bias, stride, padding) + F.conv2d(F.conv2d(x, a, None, stride, padding), b) for a frozen w
    and bias (b a 1x1 weight with the LoRA scaling in it), the "merged" way (_LoRAConvMerged); in autocast's
    dtype as F.conv2d would run, the factors' gradients reaching them through the casts."""
    if w.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("lora_conv2d computes no gradient for the base weight or bias: they must be frozen")
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        if not torch.is_grad_enabled():  # previews, evaluation: the output alone, no h for a backward
            return F.conv2d(x.to(dtype), _conv_merged(w.to(dtype), a.to(dtype), b.to(dtype)), bias, stride, padding)
        return _LoRAConvMerged.apply(x.to(dtype), w.to(dtype), bias, a.to(dtype), b.to(dtype), tuple(stride),
                                     tuple(padding))


def lora_linear(x: torch.Tensor, w: torch.Tensor | tuple, bias: torch.Tensor | None, a: torch.Tensor,
                b: torch.Tensor, matmul: str) -> torch.Tensor:
    """F.linear(x, w, bias) + F.linear(F.linear(x, a), b) (b with the LoRA scaling in it) for a frozen w and
    bias, computed the `matmul` way ("merged", above, or "peft": peft's products, each its own GEMM); in
    autocast's dtype as F.linear would run, the factors' gradients reaching them through the casts. `w` may be a tuple of quantized layers (dequantizable) whose weights, stacked, are W: "merged" only."""
    quantized = isinstance(w, tuple)
    if quantized and matmul != "merged":
        raise ValueError(f"lora_linear over quantized weights is 'merged' only, not {matmul!r}")
    if (not quantized and w.requires_grad) or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear computes no gradient for the base weight or bias: they must be frozen")
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        if quantized:
            return _LoRAMergedQuantized.apply(x.to(dtype), bias, a.to(dtype), b.to(dtype), w)
        if matmul == "peft":
            x = x.to(dtype)
            return F.linear(x, w.to(dtype), bias) + F.linear(F.linear(x, a.to(dtype)), b.to(dtype))
        return _LoRAMerged.apply(x.to(dtype), w.to(dtype), bias, a.to(dtype), b.to(dtype))
