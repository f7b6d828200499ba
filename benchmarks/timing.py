"""The benchmarks' shared timer: a few warm-up calls, then the mean wall time of `iters` calls, synchronised."""
from __future__ import annotations

import time


def timed(fn, iters, sync):
    """Milliseconds per call of fn() over `iters` calls, after 3 warm-up calls; sync() waits for the device."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1000
