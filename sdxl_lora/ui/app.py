"""The Gradio app: tabs Dataset, Train, Generate, Compare, Export; `serve()` runs it.

Safe by default: binds 127.0.0.1, no share link unless asked, optional password, reads and writes only
under the three folders it is given (gradio's own cache included: runs/.ui/gradio), flagging off, no
analytics, no fonts or scripts from a CDN, and the server never fetches a URL for a page.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import logging
import os
import socket
import sys
import threading

from sdxl_lora import training

from .folders import Folders

log = logging.getLogger(__name__)

CSS = """
#run-progress progress { accent-color: var(--color-accent); }
#run-progress-text { font-variant-numeric: tabular-nums; margin-top: .25em; }
#train-plan-summary pre, #train-plan-summary code { white-space: pre-wrap; overflow-wrap: anywhere; }
#f-datasets th, #f-datasets th * { word-break: normal; overflow-wrap: normal; font-size: var(--text-sm); }
"""


def _quiet_gradio(folders: Folders) -> None:
    # Before gradio is imported: no telemetry or version check, and its file cache inside runs/.ui.
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ["GRADIO_TEMP_DIR"] = str(folders.ui / "gradio")
    training.stay_offline()


def _has_llm() -> bool:
    import importlib.util

    return importlib.util.find_spec("sdxl_lora.llm") is not None


def build_app(folders: Folders, jobs):
    """The page. `jobs` runs the queue (ui.jobs.Jobs)."""
    _quiet_gradio(folders)
    import gradio as gr

    from . import tab_compare, tab_dataset, tab_export, tab_generate, tab_train
    from .pickers import Pickers

    # Dataset images and run outputs are served from where they are (no copies into the cache).
    gr.set_static_paths([str(folders.datasets), str(folders.runs)])
    pickers = Pickers()
    shown: list[tuple[gr.Tab, int, int]] = []  # each tab with the range of its pickers

    @contextlib.contextmanager
    def tab(*args, **kwargs):
        with gr.Tab(*args, **kwargs) as t:
            first = pickers.mark()
            yield
        shown.append((t, first, pickers.mark()))

    with gr.Blocks(title="sdxl-lora", analytics_enabled=False) as demo:
        gr.Markdown(f"## sdxl-lora &nbsp; <small>datasets `{folders.datasets}` · models `{folders.models}` · "
                    f"runs `{folders.runs}`</small>")
        with gr.Tabs() as tabs:
            with tab("Dataset", id="dataset", elem_id="tab-dataset"):
                tab_dataset.build(folders, pickers)
            with tab("Train", id="train", elem_id="tab-train"):
                runs = tab_train.build(folders, jobs, demo, pickers)
            form_tabs = [runs.form_tab]
            if _has_llm():
                from . import tab_llm

                with tab("LLM", id="llm", elem_id="tab-llm"):
                    form_tabs.append(tab_llm.build(folders, jobs, runs.pick, runs.follow, pickers))
            tab_train.wire_duplicate(runs, jobs, tabs, form_tabs)
            # One loaded model for the tabs that render (a second model replaces the first).
            pipes = tab_generate.Pipelines(folders)
            with tab("Generate", id="generate", elem_id="tab-generate"):
                tab_generate.build(folders, pipes, pickers)
            with tab("Compare", id="compare", elem_id="tab-compare"):
                tab_compare.build(folders, pipes, pickers)
            with tab("Export", id="export", elem_id="tab-export"):
                tab_export.build(folders, pickers)
        # Each picker's choices as the folders hold them now: when the page loads and when its tab is shown.
        fn, outputs = pickers.refresh()
        demo.load(fn, None, outputs, show_progress="hidden")
        for t, first, last in shown:
            if last > first:
                fn, outputs = pickers.refresh(first, last)
                t.select(fn, None, outputs, show_progress="hidden")
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

        from sdxl_lora.sdxl.formats import export  # noqa: F401
        from sdxl_lora.core import inject  # noqa: F401
        from sdxl_lora.sdxl import data, model, preview  # noqa: F401
    except ImportError:
        log.exception("warm-up import failed; the first click that needs it will show the error")


def serve(folders: Folders, host: str = "127.0.0.1", port: int | None = None, auth: str | None = None,
          share: bool = False, block: bool = True, standby: bool = True):
    """Start the server; returns (app, local_url) when block=False. standby: keep a run process ready, its
    libraries imported (ui/jobs.py)."""
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
    jobs = Jobs(folders, standby=standby)
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


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number from 1 to 65535")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The UI's options, for `python -m sdxl_lora.ui` and `sdxl-lora ui` alike. The folder defaults are the
    schema's own: the sample data, the model cache, the runs folder."""
    from sdxl_lora.core.config import config_class

    cfg = config_class("sdxl")()
    # The folder holding both tasks' default data (the sample images and the sample instruction files).
    datasets = os.path.commonpath([os.path.abspath(p) for p in (*cfg.data.dirs, *config_class("llm")().llm.data)])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=7860, help="port (default 7860)")
    parser.add_argument("--auth", metavar="USER:PASSWORD", help="ask for this user and password")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    parser.add_argument("--datasets", default=datasets, help="folder of datasets the UI may read and caption")
    parser.add_argument("--models", default=cfg.model.cache_dir, help="folder of base models (and loras/)")
    parser.add_argument("--runs", default=cfg.output.runs_dir, help="folder the runs go to")
    parser.add_argument("--no-standby", dest="standby", action="store_false",
                        help="start each run's process when the run starts, instead of keeping one ready with its "
                             "libraries imported (saves the host memory the waiting process holds)")
    return parser


def _bind_error(host: str, port: int) -> OSError | None:
    """What binding host:port as the server binds it raises; None when the port is free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            # As the server sets it: a port that a UI stopped a moment ago leaves in TIME_WAIT is free to it.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        return e
    return None


def _cannot_listen(host: str, port: int) -> tuple[int, str] | None:
    """Why the server could not listen on host:port, for the user, with the exit code (2: --host names no
    address of this machine; 1: the port is taken or refused); None when it can."""
    e = _bind_error(host, port)
    if e is None:
        return None
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return 2, (f"--host {host}: {e.strerror}; give an address of this machine (127.0.0.1, or 0.0.0.0 for "
                   "every one)")
    if e.errno == errno.EADDRINUSE:
        free = next((p for p in range(port + 1, min(port + 100, 65536)) if _bind_error(host, p) is None), None)
        return 1, (f"port {port} is in use on {host} (another `sdxl-lora ui`?); pick another with --port"
                   + (f", e.g. --port {free}" if free else ""))
    return 1, f"cannot listen on {host}:{port}: {e.strerror}; pick another --port"


def launch(args: argparse.Namespace) -> int:
    """Serve the UI with the options add_arguments parsed, until it is stopped; the exit code."""
    if importlib.util.find_spec("gradio") is None:
        print("error: the UI needs gradio, which is not installed; install it with: pip install -e '.[ui]'",
              file=sys.stderr)
        return 2
    # Before anything starts (the folders, the run queue on the runs folder, gradio), whose failure on a
    # taken port is a traceback after the queue has begun.
    if (problem := _cannot_listen(args.host, args.port)) is not None:
        code, message = problem
        print(f"error: {message}", file=sys.stderr)
        return code
    folders = Folders.create(args.datasets, args.models, args.runs)
    try:
        serve(folders, host=args.host, port=args.port, auth=args.auth, share=args.share, standby=args.standby)
    except ValueError as e:  # a malformed --auth
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sdxl_lora.ui`: the same options and behaviour as `sdxl-lora ui`."""
    training.stay_offline()
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m sdxl_lora.ui", description="The sdxl-lora UI in your browser (http://127.0.0.1:7860 by default)."))
    args = parser.parse_args(argv)
    training.setup_logging()
    return training.guarded(launch, args)
