"""Gradient checkpointing of the decoder layers (train.gradient_checkpointing), with each layer's input kept
in host memory until the backward pass recomputes that layer (llm.offload_activations).

The checkpoint wraps each layer's call from outside, so a compiled layer (train.compile) compiles whole inside
it. transformers' own checkpointing cannot be used with compiled layers: its newer versions checkpoint inside
the layer's forward, which then puts torch's checkpoint inside the compiled region, where dynamo gives up on
the whole layer (transformers' output-capturing state is changed inside it) and the layer runs uncompiled.

Checkpointing alone keeps every layer's input on the GPU (layers x tokens x hidden in the compute dtype:
2 GiB for Llama-3-8B at 4 x 2048 tokens). With offload the input is copied to pinned host memory on a side
stream as the layer runs, and brought back when backward recomputes the layer. torch's non-reentrant checkpoint
holds its inputs by reference, so it cannot offload them (`save_on_cpu` only sees saved tensors); the
layer's input therefore reaches the checkpointed function through a holder that gives the tensor itself to
the forward pass and the host copy to the recomputation. The gradient still flows through the forward
pass's own graph; the recomputation only rebuilds the saved tensors, which are value-equal.

Backward recomputes the layers last to first, so as a layer's recomputation starts, the input of the layer
before it starts back to the device on the side stream: the copy overlaps this layer's recomputation and
backward instead of holding up the next one's (the copy back on the compute stream would wait in line with
the layers' kernels)."""
from __future__ import annotations

import logging
import sys
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core.accel import indexed

log = logging.getLogger(__name__)

_streams: dict[torch.device, torch.cuda.Stream] = {}
_subclasses: dict[tuple[type, bool], type] = {}


class _HostCopy:
    """A layer's input: the tensor itself once (the forward pass), then its host copy on the device again
    (the recomputation in backward). On a CUDA device the copies run on a side stream, overlapping the
    layers; elsewhere the recomputation reads the host copy (the same code path, nothing overlapped)."""

    # Per device, the holder made last: the next one made links to it as the layer before it.
    _last: dict[torch.device, weakref.ref] = {}

    def __init__(self, x: torch.Tensor):
        self.first, self.device, self.grad = x, x.device, x.requires_grad
        self.event = None
        self.back: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.copying: torch.Tensor | None = None  # x, until the compute stream has waited for its copy
        # A weak link: holders live only as long as their layer's part of the autograd graph, and a link
        # across steps must not keep an earlier step's host copies alive.
        self.before = _HostCopy._last.get(x.device)
        _HostCopy._last[x.device] = weakref.ref(self)
        if x.device.type == "cuda":
            stream = _streams.setdefault(x.device, torch.cuda.Stream(x.device))
            stream.wait_stream(torch.cuda.current_stream(x.device))
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(x.detach(), non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            # x's memory must not be reused before the copy has read it. Not through x.record_stream: the
            # allocator would then hold the freed block back from every allocation until it sees the copy done
            # on the GPU, which the host, queueing layers ahead of the GPU, reaches only later, so each layer
            # would take fresh memory meanwhile. Instead x stays referenced until the next layer's holder has
            # the compute stream wait for this copy (by then long finished): freed after that wait, its block
            # is the compute stream's again at once.
            self.copying = x
            before = self.before() if self.before is not None else None
            if before is not None:
                before.release()
        else:
            self.host = x.detach().to("cpu", copy=True)

    def release(self) -> None:
        """Drops the device tensors whose copies (to the host, or back from it unread) may still be running,
        after having the compute stream wait for those copies: the allocator may then reuse their memory for
        the compute stream's next work."""
        waits = []
        if self.copying is not None:
            waits.append(self.event)
            self.copying = None
        if self.back is not None and self.back[1] is not None:
            waits.append(self.back[1])
            self.back = None
        for event in waits:
            torch.cuda.current_stream(self.device).wait_event(event)

    def __del__(self):
        # A holder dropped with a copy still unwaited (the last layer's input when no backward follows, an
        # input brought back for a recomputation that never came). Not while the interpreter shuts down (after a
        # crash mid-step): the device's memory goes with the process, and torch may be half torn down.
        if not sys.is_finalizing():
            self.release()

    def bring_back(self) -> None:
        """Starts the host copy's way back to the device, once, after the forward pass has used the input."""
        if self.first is not None or self.back is not None or self.copying is not None:
            return
        if self.event is None:
            self.back = (self.host.to(self.device), None)
            return
        stream = _streams[self.device]
        main = torch.cuda.current_stream(self.device)
        # Allocated from the compute stream's pool (a side-stream allocation would be a pool of its own,
        # which the compute stream's frees never refill); the side stream waits for the compute stream's
        # queued work, which may still use that memory, before writing it.
        x = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            x.copy_(self.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # No x.record_stream (see __init__): get() has the compute stream wait for the copy before x is used,
        # and release() before x is dropped unread.
        self.back = (x, event)

    def get(self) -> torch.Tensor:
        if self.first is not None:
            x, self.first = self.first, None
            return x
        if self.copying is not None:
            # The last layer's input, still on the device (no later layer's holder released it): used as it is,
            # once the copy that reads it is waited for (the recomputation's frees may reuse its memory).
            x = self.copying.detach()
            self.release()
        else:
            self.bring_back()
            x, event = self.back
            self.back = None
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        before = self.before() if self.before is not None else None
        if before is not None:
            before.bring_back()
        # As the input required gradients: the recomputation then saves what the forward pass saved.
        return x.requires_grad_(self.grad)


def _offloaded_call(self, *args, **kwargs):
    base = super(type(self), self).__call__
    if not (self.training and torch.is_grad_enabled()):
        return base(*args, **kwargs)
    if args:
        holder, rest = _HostCopy(args[0]), args[1:]

        def run(_):
            return base(holder.get(), *rest, **kwargs)
    else:
        holder = _HostCopy(kwargs.pop("hidden_states"))

        def run(_):
            return base(hidden_states=holder.get(), **kwargs)
    # An empty tensor on the layer's device, not the input: the checkpoint keeps its arguments, and finds
    # from them the device whose RNG state and autocast the recomputation restores.
    return checkpoint(run, torch.empty(0, device=holder.device), use_reentrant=False)


def _checkpointed_call(self, *args, **kwargs):
    base = super(type(self), self).__call__
    if not (self.training and torch.is_grad_enabled()):
        return base(*args, **kwargs)
    x = args[0] if args else kwargs["hidden_states"]
    # Non-reentrant: works with a frozen embedding (no input-grad hook) and with LoRA inside the layer. The
    # input stays on the device, held by the closure; the empty tensor names the device (see above).
    return checkpoint(lambda _: base(*args, **kwargs), torch.empty(0, device=x.device), use_reentrant=False)


def checkpoint_layers(model: nn.Module, layer_class: type, offload: bool = False) -> int:
    """Every `layer_class` module of `model` checkpointed, with its input in host memory where `offload`;
    returns how many. The modules keep their names and parameters (their class becomes a subclass that only
    adds the call), so adapters, state dicts and exports are unchanged. transformers' own checkpointing must
    be off."""
    key = (layer_class, offload)
    sub = _subclasses.get(key)
    if sub is None:
        name = ("HostOffloaded" if offload else "Checkpointed") + layer_class.__name__
        sub = _subclasses[key] = type(name, (layer_class,),
                                      {"__call__": _offloaded_call if offload else _checkpointed_call})
    n = 0
    for module in model.modules():
        if type(module) is layer_class:
            module.__class__ = sub
            n += 1
    return n


def reads_on_device(module: nn.Module, device: torch.device) -> bool:
    """Whether HostEmbedding has the GPU read `module`'s rows from the pinned table (core/kernels.py:
    gather_rows): a plain table, a CUDA device and Triton (torch's CUDA builds bring it; elsewhere the host
    looks the rows up)."""
    from ..core.kernels import triton

    return _plain_table(module) and device.type == "cuda" and triton is not None


def _plain_table(module: nn.Module) -> bool:
    """An nn.Embedding whose forward is the table's rows as stored (not Gemma's scaled one, no max_norm)."""
    return type(module) is nn.Embedding and module.max_norm is None


class HostEmbedding(nn.Module):
    """The frozen input embedding kept in host memory (llm.offload_embeddings): each call brings only its
    tokens' rows (tokens x hidden) to the model's device. The table is the largest frozen tensor of a
    large-vocabulary model outside its layers, and a step reads only the rows of its tokens.

    On a CUDA device a plain table is pinned, and a kernel on the device reads the rows the ids name straight
    from it (core/kernels.py: gather_rows): the ids stay on the device and the host never waits for them.
    Elsewhere (the CPU, ids on the host, a scaled embedding such as Gemma's) the rows are looked up on the
    host and copied over.

    The original module runs unchanged on the host (a scaled embedding such as Gemma's scales there); it is
    held outside the module tree, so that moving the model (`.to`, Accelerate's placement), its state dict,
    DDP and `model.device` leave it alone. Written here because neither transformers nor Accelerate place
    one module of a model on the host while it trains on the GPU (Accelerate's offload hooks move the weights
    back to the device for each call)."""

    def __init__(self, module: nn.Module, device: torch.device):
        super().__init__()
        object.__setattr__(self, "host", module.to("cpu"))
        self.target = indexed(device)  # the ids arrive as "cuda:N": compared with it in forward
        # A plain table is looked up straight into one of two reused (on CUDA pinned) host buffers: a fresh
        # tensor per call costs the host its allocation and first touch, and pinning it a second copy. Another
        # embedding (Gemma's scales its rows) runs its own forward.
        self._plain = _plain_table(module)
        self._staging: list[torch.Tensor | None] = [None, None]
        self._read: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy to the device
        self._turn = 0
        self._direct = reads_on_device(module, self.target)
        if self._direct:
            module.weight.data = module.weight.data.pin_memory()
        self._checked = False  # the device's read compared with the host's once, on the first call

    @property
    def weight(self) -> torch.Tensor:
        return self.host.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._direct and ids.device == self.target:
            return self._read_on_device(ids)
        ids = ids.to("cpu")  # ids on the GPU: the host waits for them here
        cuda = self.target.type == "cuda"
        if not self._plain:
            rows = self.host(ids)
            # From pinned memory the copy is queued behind the GPU's work instead of holding the host.
            return rows.pin_memory().to(self.target, non_blocking=True) if cuda else rows.to(self.target)
        weight, n = self.host.weight, ids.numel()
        i, self._turn = self._turn, self._turn ^ 1
        buf = self._staging[i]
        if buf is None or buf.shape[0] < n:
            buf = self._staging[i] = torch.empty((n, weight.shape[1]), dtype=weight.dtype, pin_memory=cuda)
            self._read[i] = None
        elif self._read[i] is not None:
            self._read[i].synchronize()  # the copy that last read this buffer has finished
        rows = torch.index_select(weight, 0, ids.reshape(-1), out=buf[:n]).view(*ids.shape, -1)
        if not cuda:
            return rows.clone()  # the buffer is reused by the next call
        out = rows.to(self.target, non_blocking=True)
        self._read[i] = torch.cuda.Event()
        self._read[i].record(torch.cuda.current_stream(self.target))
        return out

    def _read_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        from ..core.kernels import gather_rows

        weight, flat = self.host.weight, ids.reshape(-1)
        out = torch.empty((flat.numel(), weight.shape[1]), dtype=weight.dtype, device=self.target)
        if self._checked:
            gather_rows(weight, flat, out)
            return out.view(*ids.shape, -1)
        # The first call: the device's read checked against the host's copy of a row, once.
        self._checked = True
        try:
            gather_rows(weight, flat, out)
        except ValueError as e:  # Triton found no device address for the pinned table on this machine
            log.warning("llm.offload_embeddings: the GPU cannot read the pinned table here (%s); each step looks "
                        "its rows up on the CPU instead", e)
            self._direct = False
            return self.forward(ids)
        first = flat[:1].to("cpu")
        if not torch.equal(out[:1].to("cpu"), weight[first]):
            raise RuntimeError("llm.offload_embeddings: the GPU read other values from the pinned table than the "
                               "host holds; leave llm.offload_embeddings off on this machine")
        return out.view(*ids.shape, -1)


def head_shares_embedding(lm: nn.Module) -> bool:
    """Whether `lm`'s output head uses its input embedding's weights (tie_word_embeddings)."""
    head = lm.get_output_embeddings()
    return head is not None and getattr(head, "weight", None) is lm.get_input_embeddings().weight


def embeddings_to_host(lm: nn.Module, device: torch.device, trained: list[str]) -> int:
    """llm.offload_embeddings: `lm`'s input embedding replaced by a HostEmbedding; returns the bytes of the
    table that left the device. Refused (ValueError, saying why) where the output head shares the table's
    weights (tied: the head needs it on the device, nothing would be saved) or the adapter trains it
    (`trained`: the adapted modules' names)."""
    emb = lm.get_input_embeddings()
    if isinstance(emb, HostEmbedding):
        return 0
    if head_shares_embedding(lm):
        raise ValueError("llm.offload_embeddings: this model's output head shares its weights with the input "
                         "embedding (tie_word_embeddings), so the table must stay on the device for the head "
                         "and nothing would be saved; leave llm.offload_embeddings off")
    name = next(n for n, m in lm.named_modules() if m is emb)
    if any(t == name or t.startswith(name + ".") for t in trained):
        raise ValueError(f"llm.offload_embeddings: the adapter trains the input embedding ({name}); a trained "
                         "table must stay on the device. Leave llm.offload_embeddings off, or keep the "
                         "embedding out of the adapter's modules")
    size = sum(p.numel() * p.element_size() for p in emb.parameters())
    lm.set_input_embeddings(HostEmbedding(emb, device))
    return size
