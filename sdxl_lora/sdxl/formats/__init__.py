"""Adapter and checkpoint files: the kohya, LyCORIS, diffusers and PEFT adapter formats (export, import,
inspect), single-file SDXL checkpoints, and the tools over them (resize, extract, merge)."""
