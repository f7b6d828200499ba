"""How much a Python-busy thread (as the background compilation's dynamo and inductor are) slows a training
thread's eager step, by the interpreter's thread switch interval: every torch call gives the interpreter up and
waits to get it back. A 300-layer MLP step on the CPU (small tensors: the step is all launches, as an eager
UNet step's host side is), alone and beside a thread that compiles a small model over and over with
aot_eager; the compiling thread's rate is printed too.

    python3 benchmarks/gil_contention.py [--intervals-ms 5 1 0.5 0.1 0.05]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5, 0.1, 0.05])
    ap.add_argument("--seconds", type=float, default=6.0, help="each measurement's length")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(300)])
    x = torch.randn(8, 64)

    def step():
        layers.zero_grad(set_to_none=True)
        layers(x).sum().backward()

    stop = threading.Event()
    compiled = [0]

    def compiler():
        import torch._dynamo

        while not stop.is_set():
            torch._dynamo.reset()
            m = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(20)])
            torch.compile(m, backend="aot_eager")(torch.randn(2, 32)).sum().backward()
            compiled[0] += 1

    def measure(train: bool) -> tuple[float | None, float]:
        stop.clear()
        compiled[0] = 0
        th = threading.Thread(target=compiler)
        th.start()
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < args.seconds:
            if train:
                step()
                n += 1
            else:
                time.sleep(0.05)
        elapsed = time.perf_counter() - t
        stop.set()
        th.join()
        return (elapsed / n * 1e3 if n else None), compiled[0] / elapsed

    step()
    t = time.perf_counter()
    for _ in range(20):
        step()
    print(f"the step alone: {(time.perf_counter() - t) / 20 * 1e3:.1f} ms")
    default = sys.getswitchinterval()
    try:
        for ms in args.intervals_ms:
            sys.setswitchinterval(ms / 1e3)
            _, alone = measure(False)
            step_ms, beside = measure(True)
            print(f"switch interval {ms:g} ms: the step {step_ms:.0f} ms beside the compiler; compilations/s "
                  f"{alone:.2f} alone, {beside:.2f} beside the steps", flush=True)
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
