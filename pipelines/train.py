"""Entry for `accelerate launch [--num_processes N] pipelines/train.py [CONFIG.toml] [--set key=value ...]`.

The same command line as `sdxl-lora train`; Accelerate supplies the process group.
"""
import sys

from sdxl_lora.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
