"""LLM tab: the same schema-generated form for the causal-LM task (`task = "llm"`, sdxl_lora/llm): model,
instruction/chat JSONL files under the datasets folder, the `llm` section. Start queues the run like the
Train tab's (the same queue, the same run processes); its progress shows in the Train tab's Runs."""
from __future__ import annotations

import gradio as gr

from . import config_file
from .folders import Folders
from .jobs import Jobs
from .tab_train import Form, FormTab, start_run


def build(f: Folders, jobs: Jobs, run_pick, follow, pickers) -> FormTab:
    gr.Markdown("Train a LoRA on a causal language model (docs/llm.md). The run appears in the Train tab's "
                "**Runs**, with its progress, charts and log.")
    form = Form(f, task="llm", prefix="llm-")
    form.render()
    form.add_pickers(pickers)
    start = gr.Button("Start", variant="primary", elem_id="llm-start")
    msg = gr.Markdown(elem_id="llm-start-msg")
    config_file.build(form, pickers)
    start.click(lambda *values: start_run(form, jobs, list(values)), form.inputs, [msg, run_pick, follow])
    return FormTab(form, "llm", msg)
