"""The adapter's injection into SDXL's UNet, as a launch pays it: the default plan at 1024 (or --preset), applied
with peft to the UNet built on the meta device from SDXL base's real config (no weights: the layers' count and
shapes are what cost). Each repeat builds a fresh UNet; the plan and the injection are timed apart.

    python3 benchmarks/inject_time.py [--preset locon] [--kind lora] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

from sdxl_lora.sdxl.config import AdapterConfig, ModelConfig
from sdxl_lora.core.inject import apply_plan
from sdxl_lora.sdxl.model import unet_skeleton
from sdxl_lora.sdxl.slots import make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="adapter.preset (default: the config's default)")
    ap.add_argument("--kind", default="lora", help="adapter.kind")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = AdapterConfig(kind=a.kind, **({"preset": a.preset} if a.preset else {}))
    for i in range(a.repeats):
        unet, native = unet_skeleton(ModelConfig(path="arch:sdxl"))
        t0 = time.perf_counter()
        plan = make_plan(unet, cfg, resolution=1024, native=native)
        t1 = time.perf_counter()
        apply_plan(unet, plan)
        t2 = time.perf_counter()
        lcfg = plan.lora_config()
        print(f"repeat {i}: {len(plan.targets)} layers, {len(set(plan.rank.values()))} distinct ranks, "
              f"{len(lcfg.rank_pattern)} rank and {len(lcfg.alpha_pattern)} alpha patterns; "
              f"plan {t1 - t0:.3f} s, injection {t2 - t1:.3f} s", flush=True)


if __name__ == "__main__":
    main()
