"""Generate tab: a base model and up to three adapters with strengths; the base alone and the base with the
adapters rendered side by side at the same seed, as `sdxl-lora generate`, a run's previews and the Compare tab
render (sdxl_lora.sdxl.preview.render with its Sampler, the adapters merged: sdxl/formats/merge.py applied)."""
from __future__ import annotations

import threading
from pathlib import Path

import gradio as gr

from sdxl_lora.sdxl.config import DEMO_NAME

from .folders import Folders, PathRefused, model_choices
from .text import error_md

N_ADAPTERS = 3


def adapter_choices(f: Folders) -> list[str]:
    """Adapter files the page offers: each run's adapter once (its kohya file, the one people take elsewhere; the
    diffusers twin beside it is the same adapter), its exports (runs/...), and models/loras/ (models/...)."""
    out = []
    for run in sorted(p for p in f.runs.iterdir() if p.is_dir() and not p.name.startswith(".")):
        own = [p for p in sorted(run.glob("*.safetensors")) if p.name != f"{run.name}.diffusers.safetensors"
               or not (run / f"{run.name}.safetensors").is_file()]
        for p in own + sorted((run / "exports").glob("*.safetensors")):
            out.append(f"runs/{p.relative_to(f.runs)}")
    loras = f.models / "loras"
    if loras.is_dir():
        out += [f"models/{p.relative_to(f.models)}" for p in sorted(loras.rglob("*.safetensors"))]
    return out


def adapter_path(f: Folders, choice: str) -> Path:
    kind, _, rel = choice.partition("/")
    if kind not in ("runs", "models") or not rel:
        raise PathRefused(f"{choice}: pick an adapter from the list (runs/... or models/loras/...)")
    return f.inside(rel, kind)


def rendered_file(f: Folders, path: Path) -> Path:
    """The file a render reads for adapter `path`: for a run's own adapter its diffusers twin where there is one,
    which holds the trained weights as they are, as the run's previews and Compare read them (the kohya file gives
    every layer one alpha, folding the rest into the weights: the same adapter to float rounding)."""
    from sdxl_lora.sdxl.compare import final_adapter

    run = path.parent
    if run.parent == f.runs and path.name == f"{run.name}.safetensors":
        return final_adapter(run) or path
    return path


class Pipelines:
    """One loaded pipeline at a time (a second model replaces the first), shared by the renders; the
    lock keeps two renders from mixing adapters."""

    def __init__(self, f: Folders):
        self.f = f
        self.key: str | None = None
        self.pipe = None
        self.lock = threading.Lock()

    def get(self, model: str):
        import torch

        from sdxl_lora.sdxl.config import ModelConfig
        from sdxl_lora.sdxl.model import load_pipeline

        path = self.f.model(model)
        if self.key != path:
            self.pipe = None
            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = torch.float32 if device == "cpu" else torch.bfloat16
            pipe = load_pipeline(ModelConfig(path=path, cache_dir=str(self.f.models)), torch_dtype=dtype)
            pipe.set_progress_bar_config(disable=True)
            self.pipe, self.key = pipe.to(device), path
        return self.pipe


def generate(f: Folders, pipes: Pipelines, model, prompt, negative, seed, steps, guidance, size, *adapter_args,
             progress=gr.Progress()):
    from sdxl_lora.sdxl.formats.merge import applied
    from sdxl_lora.sdxl.model import native_resolution
    from sdxl_lora.sdxl.preview import Sampler, render

    chosen = [(a, float(s)) for a, s in zip(adapter_args[::2], adapter_args[1::2]) if a]
    if not prompt or not prompt.strip():
        return None, None, "**Error:** write a prompt"
    with pipes.lock:
        progress(0.05, desc="loading the model")
        pipe = pipes.get(model)
        side = int(size) if size else native_resolution(pipe)
        kw = dict(seed=int(seed), steps=int(steps), guidance=float(guidance), width=side, height=side,
                  negative=negative or None, sampler=Sampler())
        progress(0.3, desc="base")
        base = render(pipe, [prompt], **kw)[0]
        if not chosen:
            return base, None, f"base only (seed {int(seed)}, {side}x{side}); pick an adapter to compare"
        # Merged into the weights for this render, as the run's previews and Compare apply it (sdxl/formats/merge.py).
        with applied(pipe, [(rendered_file(f, adapter_path(f, c)), s) for c, s in chosen]):
            progress(0.65, desc="with adapters")
            tuned = render(pipe, [prompt], **kw)[0]
    used = ", ".join(f"{Path(c).name} x {s:g}" for c, s in chosen)
    return base, tuned, f"seed {int(seed)}, {side}x{side}, {int(steps)} steps; adapters: {used}"


def build(f: Folders, pipes: Pipelines, pickers):
    with gr.Row():
        with gr.Column(scale=2):
            model = gr.Dropdown(model_choices(f.models), value=DEMO_NAME, allow_custom_value=True, label="base model",
                                elem_id="gen-model")
            rows = []
            for i in range(N_ADAPTERS):
                with gr.Row():
                    a = gr.Dropdown([], value=None, allow_custom_value=True, label=f"adapter {i + 1}",
                                    elem_id=f"gen-adapter-{i}", scale=3)
                    s = gr.Slider(-2.0, 2.0, value=1.0, step=0.05, label="strength", elem_id=f"gen-scale-{i}",
                                  scale=2)
                rows += [a, s]
            refresh = gr.Button("Refresh adapter list", size="sm", elem_id="gen-refresh")
            prompt = gr.Textbox("a red circle on a white background", label="prompt", lines=2, elem_id="gen-prompt")
            negative = gr.Textbox("", label="negative prompt", elem_id="gen-negative")
            with gr.Row():
                seed = gr.Number(0, precision=0, label="seed", elem_id="gen-seed")
                steps = gr.Number(20, precision=0, label="steps", minimum=1, elem_id="gen-steps")
                guidance = gr.Number(5.0, label="guidance", elem_id="gen-guidance")
                size = gr.Number(0, precision=0, label="size (0: native)", minimum=0, elem_id="gen-size")
            go = gr.Button("Generate", variant="primary", elem_id="gen-go")
        with gr.Column(scale=3):
            with gr.Row():
                base_img = gr.Image(label="base", type="pil", elem_id="gen-base", format="png",
                                    buttons=["download", "fullscreen"])
                tuned_img = gr.Image(label="with adapters", type="pil", elem_id="gen-tuned", format="png",
                                     buttons=["download", "fullscreen"])
            msg = gr.Markdown(elem_id="gen-msg")

    def do_generate(model, prompt, negative, seed, steps, guidance, size, *adapters, progress=gr.Progress()):
        try:
            return generate(f, pipes, model, prompt, negative, seed, steps, guidance, size, *adapters,
                            progress=progress)
        except (PathRefused, FileNotFoundError, ValueError) as e:
            return None, None, error_md(e)

    def do_refresh():
        choices = adapter_choices(f)
        return [gr.update(choices=choices) for _ in range(N_ADAPTERS)]

    go.click(do_generate, [model, prompt, negative, seed, steps, guidance, size, *rows], [base_img, tuned_img, msg])
    refresh.click(do_refresh, None, rows[::2])
    pickers.add(model, lambda: model_choices(f.models))
    for a in rows[::2]:
        pickers.add(a, lambda: adapter_choices(f))
