"""The Gradio UI of sdxl-lora (`sdxl-lora ui`, or `python -m sdxl_lora.ui`): Dataset, Train, Generate and Export tabs.

It only calls the library (sdxl_lora) and launches training as separate processes (`sdxl-lora train`)
whose progress it reads from each run's events.jsonl; see docs/ui.md.
"""
