"""The Gradio app: tabs Dataset, Train, Generate, Export; `serve()` runs it.

Safe by default: binds 127.0.0.1, no share link unless asked, optional password, reads and writes only
under the three folders it is given (gradio's own cache included: runs/.ui/gradio), flagging off, no
analytics, no fonts or scripts from a CDN, and the server never fetches a URL for a page.
"""
from __future__ import annotations

import logging
import os
import threading

from .folders import Folders

log = logging.getLogger(__name__)

CSS = """
#run-progress progress { accent-color: var(--color-accent); }
#run-progress-text { font-variant-numeric: tabular-nums; margin-top: .25em; }
"""


def _quiet_gradio(folders: Folders) -> None:
    # Before gradio is imported: no telemetry or version check, and its file cache inside runs/.ui.
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ["GRADIO_TEMP_DIR"] = str(folders.ui / "gradio")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _has_llm() -> bool:
    import importlib.util

    return importlib.util.find_spec("sdxl_lora.llm") is not None


def build_app(folders: Folders, jobs):
    """The page. `jobs` runs the queue (ui.jobs.Jobs)."""
    _quiet_gradio(folders)
    import gradio as gr

    from . import tab_dataset, tab_export, tab_generate, tab_train

    # Dataset images and run outputs are served from where they are (no copies into the cache).
    gr.set_static_paths([str(folders.datasets), str(folders.runs)])
    loaders = []
    with gr.Blocks(title="sdxl-lora", analytics_enabled=False) as demo:
        gr.Markdown(f"## sdxl-lora &nbsp; <small>datasets `{folders.datasets}` · models `{folders.models}` · "
                    f"runs `{folders.runs}`</small>")
        with gr.Tabs():
            with gr.Tab("Dataset", id="dataset", elem_id="tab-dataset"):
                tab_dataset.build(folders)
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                run_pick = tab_train.build(folders, jobs)
            if _has_llm():
                from . import tab_llm

                with gr.Tab("LLM", id="llm", elem_id="tab-llm"):
                    tab_llm.build(folders, jobs, run_pick)
            with gr.Tab("Generate", id="generate", elem_id="tab-generate"):
                loaders.append(tab_generate.build(folders))
            with gr.Tab("Export", id="export", elem_id="tab-export"):
                loaders.append(tab_export.build(folders))
        for fn, outputs in loaders:
            demo.load(fn, None, outputs)
    return demo


class _NoRemoteFiles:
    """ASGI middleware: refuse `/file=http...` requests. Gradio would fetch such a URL on the server's
    behalf (to proxy a remote file into a component); this app has none, and must not reach the network."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from urllib.parse import unquote

            path = unquote(scope.get("path", ""))
            if "/file=" in path and path.split("/file=", 1)[1].lower().startswith(("http:", "https:", "//")):
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"remote files are not served"})
                return
        await self.app(scope, receive, send)


def _warm_up() -> None:
    # torch, diffusers and peft take many seconds to import; the page is served without them and they
    # load here in the background, so the first Plan, Generate or Export click does not wait for them.
    try:
        from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel  # noqa: F401

        from sdxl_lora.sdxl import export
        from sdxl_lora.core import inject  # noqa: F401
        from sdxl_lora.sdxl import data, model, preview  # noqa: F401
    except ImportError:
        log.exception("warm-up import failed; the first click that needs it will show the error")


def serve(folders: Folders, host: str = "127.0.0.1", port: int | None = None, auth: str | None = None,
          share: bool = False, block: bool = True):
    """Start the server; returns (app, local_url) when block=False."""
    from starlette.middleware import Middleware

    from .jobs import Jobs

    credentials = None
    if auth:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            raise ValueError("--auth takes user:password")
        credentials = (user, password)
    # gradio's own HTTP client logs every request it makes to itself at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    jobs = Jobs(folders)
    jobs.start_background()
    demo = build_app(folders, jobs)
    demo.queue(default_concurrency_limit=1)
    app, local_url, share_url = demo.launch(
        server_name=host, server_port=port, auth=credentials, share=share, inbrowser=False,
        prevent_thread_lock=True, allowed_paths=[str(folders.datasets), str(folders.runs)],
        footer_links=["settings"], run_history=False, mcp_server=False, ssr_mode=False, pwa=False,
        enable_monitoring=False, quiet=True, css=CSS,
        app_kwargs={"middleware": [Middleware(_NoRemoteFiles)]})
    threading.Thread(target=_warm_up, name="sdxl-lora-warm-up", daemon=True).start()
    print(f"sdxl-lora UI: {local_url}" + (f"  (share link: {share_url})" if share_url else ""), flush=True)
    print(f"  datasets {folders.datasets}\n  models   {folders.models}\n  runs     {folders.runs}", flush=True)
    if not block:
        return app, local_url
    try:
        demo.block_thread()
    finally:
        jobs.shutdown()
    return app, local_url


def main(argv: list[str] | None = None) -> int:
    """`python -m sdxl_lora.ui`: the same as `sdxl-lora ui`."""
    from sdxl_lora.cli import main as cli_main

    return cli_main(["ui", *(argv or [])])

