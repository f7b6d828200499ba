"""Entry for `accelerate launch [--num_processes N] pipelines/train.py [CONFIG.toml] [--set key=value ...]`.

The same command line as `sdxl-lora train`; Accelerate supplies the process group. A config with
`task = "llm"` (or a resumed LLM run) runs `sdxl-lora llm train` instead.
"""
import sys

from sdxl_lora.cli import main, task_of

if __name__ == "__main__":
    argv = sys.argv[1:]
    command = ["llm", "train"] if task_of(argv) == "llm" else ["train"]
    sys.exit(main([*command, *argv]))
