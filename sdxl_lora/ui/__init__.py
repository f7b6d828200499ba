"""The Gradio UI of sdxl-lora (`sdxl-lora ui`, or `python -m sdxl_lora.ui`): Dataset, Train, Generate and Export tabs.

It only calls the library (sdxl_lora), never the CLI, and launches training as separate processes
(ui/worker.py, over sdxl_lora.training) whose progress it reads from each run's events.jsonl; see docs/ui.md.
"""
