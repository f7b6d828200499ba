"""Are the offloaded layer inputs (`llm.offload_activations`) exactly the inputs, on a GPU's streams? Llama-3-8B's
layer shapes with fewer layers (random weights, bf16; benchmarks/llm_step.py's builder) and the trainer's LoRA on
every linear, its decoder layers checkpointed twice over from one state: with their inputs kept on the device,
and with them in pinned host memory, copied there and back on a side stream (llm/offload.py). Both recompute each
layer in backward from the same values, so on the same batches the loss and every adapter gradient must be
bitwise equal (B's gradients read the recomputed layer's inputs); a copy read before it has landed, or memory
reused while a copy still writes it, shows as a difference. `--delay-ms N` holds the side stream back N ms
before each copy, to the host and back (torch.cuda._sleep), so a missing wait cannot hide behind copies that are
merely fast.
The attention is transformers' eager one (matmuls and a softmax): SDPA's fused backward kernels may add in any
order, which would hide the answer; and the kept model runs each batch twice, so the row also says whether the
step itself is bitwise repeatable here.

    python3 benchmarks/offload_check.py [--layers 8] [--batch 4] [--seq 2048] [--steps 3]
                                        [--compile] [--delay-ms 5] [--time 10 --attention sdpa]

`--time N` then times N steps of the offloaded model as llm/offload.py runs it (each input on its way back
while the layer after it recomputes) and with the copy back on the compute stream instead, in turns: what the
overlap gains on this card.

Prints one JSON row: per step, whether the kept model repeated itself and whether the offloaded one matched it
(loss and every gradient), and the largest gradient difference. On a CPU (llm_step.py's tiny shape there) the
offload has no streams: a smoke test of the script.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from llm_step import LLAMA3_8B, TINY, batches, build_model  # benchmarks/ (this script's folder is on the path)
from timing import timed

from sdxl_lora.core import inject, speed
from sdxl_lora.llm.config import AdapterConfig
from sdxl_lora.llm import offload
from sdxl_lora.llm import slots as llm_slots


def delayed(delay_ms: float) -> None:
    """llm/offload.py's copies to the host and back with the side stream first held back `delay_ms` after the
    compute stream's queued work (a GPU spin, no host wait): a layer input's memory reused before its copy to
    the host read it, or read before its copy back wrote it, then shows."""
    original_init, original_back = offload._HostCopy.__init__, offload._HostCopy.bring_back
    cycles = int(delay_ms * 2e6)  # GPU clock cycles at about 2 GHz (H100/H200 boost clocks)

    def hold(device):
        stream = offload._streams.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    def init(self, x):
        if x.device.type == "cuda":
            hold(x.device)
        original_init(self, x)

    def bring_back(self):
        if self.first is None and self.back is None and self.copying is None and self.event is not None:
            hold(self.device)
        original_back(self)

    offload._HostCopy.__init__ = init
    offload._HostCopy.bring_back = bring_back


def inline_copy_back(self) -> None:
    """The copy back as llm/offload.py made it before the overlap: on the compute stream, in line with the
    layers' kernels (get() still asks for the layer before, which is then copied at once)."""
    if self.first is not None or self.back is not None:
        return
    if self.event is not None:
        torch.cuda.current_stream(self.device).wait_event(self.event)
    self.back = (self.host.to(self.device, non_blocking=True), None)


def step(model, ids) -> tuple[torch.Tensor, dict]:
    """One forward + backward under bf16 autocast: the loss and the adapter's gradients, on the host."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()
                                          if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of Llama-3-8B's shape")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="batches compared, each through both models")
    ap.add_argument("--compile", action="store_true", help="compile each decoder layer, as train.compile does")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="hold the side stream back before each copy")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="then time N steps with and without the overlap")
    ap.add_argument("--attention", choices=["eager", "sdpa"], default="eager",
                    help="eager for the bitwise check; sdpa (as the trainer runs) for --time")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(LLAMA3_8B, num_hidden_layers=args.layers) if device.type == "cuda" else dict(TINY)
    if device.type == "cpu":
        args.batch, args.seq = 2, 64
    if args.delay_ms and device.type == "cuda":
        delayed(args.delay_ms)
    kept = build_model(shape, device, "bf16", attention=args.attention)
    inject.apply_plan(kept, llm_slots.make_plan(kept, AdapterConfig(preset="full", rank=16)))
    kept.train()
    offloaded = copy.deepcopy(kept)
    layer_class = type(kept.model.layers[0])
    for model, offload_inputs in ((kept, False), (offloaded, True)):
        offload.checkpoint_layers(model, layer_class, offload=offload_inputs)
        if args.compile:  # as the trainer does (llm/task.py): one compiled graph for the repeated layers
            speed.compile_regions(model, classes=(type(model.model.layers[0]).__name__,))
    steps = []
    started = time.perf_counter()
    for batch in batches(args.steps, args.batch, args.seq, shape["vocab_size"], device):
        ids = batch["input_ids"]
        out = {name: step(model, ids) for name, model in
               (("kept", kept), ("kept again", kept), ("offloaded", offloaded))}
        loss_a, grads_a = out["kept"]

        def same(other: str) -> bool:
            loss_b, grads_b = out[other]
            return (torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
                    and all(torch.equal(grads_a[n], g) for n, g in grads_b.items()))
        worst = max((float((grads_a[n] - g).abs().max()) for n, g in out["offloaded"][1].items()), default=0.0)
        steps.append({"loss": round(float(loss_a), 5), "grads": len(grads_a), "repeatable": same("kept again"),
                      "offloaded_equal": same("offloaded"), "max_grad_diff": worst})
    row = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "layers": shape[
           "num_hidden_layers"], "batch": args.batch, "seq": args.seq, "compile": args.compile,
           "attention": args.attention, "delay_ms": args.delay_ms, "seconds": round(time.perf_counter() - started, 1),
           "steps": steps, "repeatable": all(s["repeatable"] for s in steps),
           "offloaded_equal": all(s["offloaded_equal"] for s in steps)}
    if args.time:
        del kept
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        overlapped = offload._HostCopy.bring_back
        times = {"overlapped": [], "on the compute stream": []}
        for _ in range(2):  # in turns, so a drift of the card's clocks falls on both
            for name, bring_back in (("overlapped", overlapped), ("on the compute stream", inline_copy_back)):
                offload._HostCopy.bring_back = bring_back
                times[name].append(round(timed(lambda: step(offloaded, ids), args.time, sync), 1))
        offload._HostCopy.bring_back = overlapped
        row["ms_per_step"] = times
        if device.type == "cuda":
            row["timed_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
