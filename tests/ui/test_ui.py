"""The Gradio UI, driven as a person would: headless Chromium (Debian's /usr/bin/chromium) through Playwright.

One end-to-end session: log in, scan and caption a dataset, start a tiny run from the form, stop it and
resume it, crash the UI while it trains (the run goes on), restart the UI and find the run again with its
previews, generate with the new adapter beside the base, export it and download the file. Screenshots of
each tab go to test-artifacts/ui/. Other tests: the server binds 127.0.0.1, asks the password, and serves
nothing outside its folders; the queue starts runs one after another.
"""
from __future__ import annotations

import http.cookiejar
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT = 150_000  # ms: a generous ceiling for work on two busy cores, never a speed assertion
VIEWPORT = {"width": 1280, "height": 900}  # a laptop's screen: what must be seen has to fit it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UI:
    """`python -m sdxl_lora.ui` in its own process, as a user starts it."""

    def __init__(self, folders: dict[str, Path], log: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.log = log
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sdxl_lora.ui", "--port", str(self.port), "--datasets", str(folders["datasets"]),
             "--models", str(folders["models"]), "--runs", str(folders["runs"]), *extra],
            cwd=folders["root"], env=env, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + WAIT / 1000
        while f"sdxl-lora UI: {self.url}" not in log.read_text(errors="replace"):
            assert self.proc.poll() is None, f"the UI exited:\n{log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"the UI did not start:\n{log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.2)

    def kill(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


USER, PASSWORD = "alice", "secret"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_dir):
    """A datasets folder with a copy of four sample images (captions are edited), a models folder holding
    the tiny SDXL (linked, so it is not built again), an empty runs folder."""
    root = tmp_path_factory.mktemp("ui")
    ds = root / "datasets" / "shapes"
    ds.mkdir(parents=True)
    for img in sorted((REPO / "sample_data" / "images").glob("*.png"))[:4]:
        shutil.copy(img, ds / img.name)
        shutil.copy(img.with_suffix(".txt"), ds / img.with_suffix(".txt").name)
    models = root / "models"
    models.mkdir()
    (models / tiny_dir.name).symlink_to(tiny_dir, target_is_directory=True)
    runs = root / "runs"
    return {"root": root, "datasets": root / "datasets", "models": models, "runs": runs}


@pytest.fixture(scope="module")
def server(folders):
    """One UI for the module, started as a user would with a password; a test may replace it (holder["ui"])."""
    holder = {"log": folders["root"] / "ui.log"}
    holder["ui"] = UI(folders, holder["log"], "--auth", f"{USER}:{PASSWORD}")
    yield holder
    holder["ui"].kill()


def _login(page, url: str) -> None:
    page.goto(url)
    page.locator("input[type=text]").fill(USER)
    page.locator("input[type=password]").fill(PASSWORD)
    page.get_by_role("button", name="Login").click()
    expect(page.get_by_role("tab", name="Dataset")).to_be_visible(timeout=WAIT)


def _fill(page, elem_id: str, value) -> None:
    box = _box(page, elem_id)
    box.fill(str(value))
    box.blur()


def _box(page, elem_id: str):
    return page.locator(f"#{elem_id} input, #{elem_id} textarea").first


def _pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").first.click()
    page.get_by_role("option", name=option, exact=True).click()


def _cell(page, row: int, col: int):
    return page.locator(f"#ds-grid [data-testid=cell-{row}-{col}]")


def _edit_cell(page, row: int, col: int, text: str) -> None:
    """Type into a table cell as a person does: double-click it, type, Enter."""
    _cell(page, row, col).dblclick()
    box = page.locator(f"#ds-grid [data-testid=cell-{row}-{col}] textarea, "
                       f"#ds-grid [data-testid=cell-{row}-{col}] input").first
    box.fill(text)
    box.press("Enter")


def _tick(page, row: int) -> None:
    """Tick a row's checkbox as a person does: click it until it shows ticked. The table re-renders a moment
    after an edit lands, and a click in that moment is undone by the new render (seen on a loaded machine)."""
    box = page.locator(f"#ds-grid [data-testid=cell-{row}-0] input[type=checkbox]")
    for _ in range(10):
        if not box.is_checked():
            box.click()
        page.wait_for_timeout(300)
        if box.is_checked():
            return
    raise AssertionError(f"row {row}'s checkbox never stayed ticked")


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # The same ceiling as the page's waits: on two busy cores a full-page shot has taken over playwright's 30 s.
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True, timeout=WAIT)


def _drawn(page, selector: str) -> list[dict]:
    """The sizes (px) of the chart marks `selector` finds, as the browser lays them out."""
    return page.evaluate(f"() => [...document.querySelectorAll({selector!r})].map(p => {{"
                         "const b = p.getBBox(); return {width: b.width, height: b.height}; })")


def _state(page):
    return page.locator("#run-progress")


def test_train_generate_export_in_the_browser(folders, server, tmp_path):
    log, ui = server["log"], server["ui"]
    expect.set_options(timeout=WAIT)  # every wait has the same generous ceiling; none is a speed assertion
    hosts: set[str] = set()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT, accept_downloads=True)
            page.on("request", lambda r: hosts.add(urllib.parse.urlsplit(r.url).netloc or r.url.split(":")[0]))
            _login(page, ui.url)

            # ---- Dataset: the images with their captions; edit one; the report; a folder outside is refused
            shapes = folders["datasets"] / "shapes"
            images = sorted(shapes.glob("*.png"))
            _fill(page, "ds-trigger", "sks")
            page.locator("#ds-scan").click()
            expect(page.locator("#ds-status")).to_contain_text("4 usable images", timeout=WAIT)
            expect(page.locator("#ds-grid [role=gridcell] img")).to_have_count(4)
            expect(page.locator("#ds-report textarea")).to_have_value(
                re.compile(r"captions: 4 of 4 images have one[\s\S]*problems: none"))
            # The bucket histogram draws its bar; the default resolution is the demo base's (no false upscaling).
            expect(page.locator("#ds-hist svg .mark-rect path")).to_have_count(1)
            assert _drawn(page, "#ds-hist svg .mark-rect path")[0]["height"] > 20
            expect(page.locator("#ds-report textarea")).not_to_have_value(re.compile("upscaled"))
            expect(page.locator("#ds-doctor")).to_contain_text("Every caption holds the trigger word 'sks'")
            expect(page.locator("#ds-tags")).to_contain_text("sks")
            # Inline: the second row's caption cell edited in the table and saved beside that image only.
            expect(_cell(page, 1, 2)).to_have_text(f"shapes/{images[1].name}")
            before = {p: p.read_bytes() for p in shapes.iterdir()}
            _edit_cell(page, 1, 3, "a  red circle,  white background")
            page.locator("#ds-save").click()
            expect(page.locator("#ds-saved")).to_contain_text(f"saved 1 caption(s): {images[1].with_suffix('.txt').name}")
            assert images[1].with_suffix(".txt").read_text(encoding="utf-8") == "a red circle, white background\n"
            assert {p: p.read_bytes() for p in shapes.iterdir() if p != images[1].with_suffix(".txt")} == \
                {p: b for p, b in before.items() if p != images[1].with_suffix(".txt")}
            # The doctor, without a rescan, names the caption now without the trigger word; a bulk edit adds it.
            expect(page.locator("#ds-doctor")).to_contain_text("1 caption(s) lack the trigger word 'sks'")
            expect(page.locator("#ds-doctor")).to_contain_text(f"shapes/{images[1].name}")
            _pick(page, "ds-bulk-op", "add the trigger word where missing")
            _fill(page, "ds-bulk-text", "sks")
            page.locator("#ds-bulk-apply").click()  # not counted yet: nothing written
            expect(page.locator("#ds-bulk-msg")).to_contain_text("Preview this edit first")
            page.locator("#ds-bulk-preview").click()
            expect(page.locator("#ds-bulk-msg")).to_contain_text("1 of 4 caption(s) would change")
            assert images[1].with_suffix(".txt").read_text(encoding="utf-8") == "a red circle, white background\n"
            _shot(page, "1-dataset")
            page.locator("#ds-bulk-apply").click()
            expect(page.locator("#ds-bulk-msg")).to_contain_text("1 caption(s) written")
            assert images[1].with_suffix(".txt").read_text(encoding="utf-8") == "sks, a red circle, white background\n"
            expect(_cell(page, 1, 3)).to_have_text("sks, a red circle, white background")
            expect(page.locator("#ds-doctor")).to_contain_text("Every caption holds the trigger word 'sks'")
            # A suffix on the ticked row only.
            _tick(page, 3)
            page.locator("#ds-bulk-scope").get_by_text("the ticked rows").click()
            _pick(page, "ds-bulk-op", "add suffix")
            _fill(page, "ds-bulk-text", ", soft light")
            page.locator("#ds-bulk-preview").click()
            expect(page.locator("#ds-bulk-msg")).to_contain_text("1 of 1 caption(s) would change")
            page.locator("#ds-bulk-apply").click()
            expect(page.locator("#ds-bulk-msg")).to_contain_text("1 caption(s) written")
            assert images[3].with_suffix(".txt").read_text(encoding="utf-8").endswith("background, soft light\n")
            assert images[0].with_suffix(".txt").read_bytes() == before[images[0].with_suffix(".txt")]
            assert all(p.read_bytes() == before[p] for p in images)  # the images themselves are never written

            # ---- Uploads: images and captions into a new dataset folder; other files and existing names refused
            page.locator("#ds-upload-acc").get_by_text("Upload images and captions").click()
            _fill(page, "ds-folder", "uploaded")  # a new folder's name, typed into the picker
            staging = tmp_path / "to-upload"
            staging.mkdir()
            shutil.copy(images[0], staging / "circle.png")
            (staging / "circle.txt").write_text("sks, an uploaded circle", encoding="utf-8")
            (staging / "notes.sh").write_text("echo hi")
            (staging / "broken.png").write_bytes(b"\x89PNG not really")
            picked = [str(staging / n) for n in ("circle.png", "circle.txt", "notes.sh", "broken.png")]
            page.locator("#ds-up-files input[type=file]").set_input_files(picked)
            page.locator("#ds-up-go").click()
            expect(page.locator("#ds-up-msg")).to_contain_text("uploaded 2 file(s) into uploaded: circle.png, circle.txt")
            expect(page.locator("#ds-up-msg")).to_contain_text("notes.sh: not an image")
            expect(page.locator("#ds-up-msg")).to_contain_text("broken.png:")
            uploaded = folders["datasets"] / "uploaded"
            assert sorted(p.name for p in uploaded.iterdir()) == ["circle.png", "circle.txt"]
            assert (uploaded / "circle.png").read_bytes() == images[0].read_bytes()
            (staging / "circle.txt").write_text("another caption", encoding="utf-8")
            page.locator("#ds-up-files input[type=file]").set_input_files([str(staging / "circle.txt")])
            page.locator("#ds-up-go").click()
            expect(page.locator("#ds-up-msg")).to_contain_text(
                "uploaded/circle.txt already exists; tick 'overwrite files already there'")
            assert (uploaded / "circle.txt").read_text(encoding="utf-8") == "sks, an uploaded circle"
            _shot(page, "1b-dataset-upload")
            _fill(page, "ds-folder", "/etc")
            page.locator("#ds-scan").click()
            expect(page.locator("#ds-status")).to_contain_text("is outside the datasets folder")
            # The folder the upload made is offered by the Train form's picker, without a restart.
            page.get_by_role("tab", name="Train").click()
            page.locator("#f-data input").first.click()
            expect(page.get_by_role("option", name="uploaded", exact=True)).to_be_visible()
            page.keyboard.press("Escape")
            page.get_by_role("tab", name="Dataset").click()
            shutil.rmtree(uploaded)  # the run below trains on shapes alone

            # ---- Train: the form, the plan, Start
            page.get_by_role("tab", name="Train").click()
            # Plain words: fields by what the user decides, human labels (no schema paths), common ones on top.
            expect(page.locator("#f-group-how-long").first).to_contain_text("How long")
            expect(page.locator("#f-train-steps")).to_contain_text("Training steps")
            expect(page.locator("#f-group-speed-and-memory #f-train-vram-gb").first).to_contain_text("GPU memory budget")
            expect(page.locator("#tab-train")).not_to_contain_text("train.steps")
            # The picked folder has its per-dataset settings, folded under the picker: each a box with its whole
            # label; what is typed stays and reaches the run's config (below).
            page.locator("#f-acc-datasets").get_by_text("Per-dataset settings").click()
            expect(page.locator("#f-datasets")).to_contain_text("shapes: the run's settings")
            expect(page.locator("#f-ds-folder input").first).to_have_value("shapes")
            for box in ("repeats", "trigger-word", "is-regularization", "caption-extension"):  # room for the label
                assert page.locator(f"#f-ds-{box}").bounding_box()["width"] >= 140, box
            page.locator("#f-ds-repeats textarea, #f-ds-repeats input").first.click()
            page.keyboard.type("2")
            expect(page.locator("#f-datasets")).to_contain_text("shapes: repeats 2")
            # The summary line before Start: what will train and the memory the whole run needs.
            expect(page.locator("#train-summary")).to_contain_text("trainable parameters in", timeout=WAIT)
            _fill(page, "f-train-vram-gb", 8)
            expect(page.locator("#train-summary")).to_contain_text("budget 8 GiB", timeout=WAIT)
            _fill(page, "f-train-vram-gb", "")
            expect(page.locator("#train-summary")).not_to_contain_text("budget", timeout=WAIT)
            # A card preset fills the form: its budget, with each choice's memory and time from the planner.
            page.locator("#f-card input").first.click()
            page.get_by_role("option", name=re.compile(r"^8gb · ~[\d.]+ GiB · [\d.]+x time per image$")).click()
            expect(page.locator("#f-train-vram-gb textarea, #f-train-vram-gb input").first).to_have_value("8.0")
            expect(page.locator("#train-summary")).to_contain_text("card preset 8gb", timeout=WAIT)
            _pick(page, "f-card", "no card preset")
            expect(page.locator("#f-train-vram-gb textarea, #f-train-vram-gb input").first).to_have_value("")
            # The demo base recommends LoHa its own learning rate: picking the kind fills it, and back.
            _pick(page, "f-adapter-kind", "loha")
            expect(_box(page, "f-train-lr")).to_have_value("0.004")
            _pick(page, "f-adapter-kind", "lora")
            expect(_box(page, "f-train-lr")).to_have_value("0.002")
            _fill(page, "f-train-steps", 40)
            _fill(page, "f-data-resolution", 64)
            _fill(page, "f-train-batch-size", 1)
            _fill(page, "f-output-name", "ui-run")
            page.locator("#f-acc-previews").get_by_text("More: Previews").click()
            _fill(page, "f-preview-steps", 2)
            page.locator("#f-acc-saving-and-output").get_by_text("More: Saving and output").click()
            _fill(page, "f-train-log-every", 1)
            # The dashboards: a tick box each, none ticked; one ticked goes into the saved config and back (below).
            trackers = page.locator("#f-train-trackers")
            expect(trackers).to_contain_text("Dashboards")
            tensorboard, wandb = trackers.get_by_label("TensorBoard"), trackers.get_by_label("Weights & Biases (offline)")
            expect(tensorboard).not_to_be_checked()
            expect(wandb).not_to_be_checked()
            tensorboard.check()
            # Each folded field has its label and a one-line help in user terms, no benchmark figures.
            page.locator("#f-acc-speed-and-memory").get_by_text("More: Speed and memory").click()
            expect(page.locator("#f-train-fuse-qkv")).to_contain_text("Fuse attention projections")
            expect(page.locator("#f-acc-speed-and-memory")).not_to_contain_text("H200")
            # A message about a glob shows its stars (not Markdown emphasis).
            page.locator("#f-acc-what-to-learn").get_by_text("More: What to learn").click()
            overrides = page.locator("#f-adapter-overrides textarea").input_value()
            _fill(page, "f-adapter-overrides", '{"*attn2*" = -1}')
            page.locator("#train-plan").click()
            expect(page.locator("#train-plan-summary")).to_contain_text(
                "'Per-layer ranks' entry '*attn2*' must be at least 0, not -1")
            _fill(page, "f-adapter-overrides", overrides)
            page.locator("#train-plan").click()
            expect(page.locator("#train-plan-summary")).to_contain_text("trainable parameters", timeout=WAIT)
            # The memory estimate is shown whole: nothing runs past its box.
            assert page.evaluate("() => [...document.querySelectorAll('#train-plan-summary pre')].every("
                                 "e => e.scrollWidth <= e.clientWidth + 1)")
            expect(page.locator("#train-plan-table")).to_contain_text("attn2")
            # ---- The form as a config file: saved, changed, loaded back; the same run as a command line
            page.locator("#f-acc-config").get_by_text("Config file").click()
            page.locator("#f-cfg-save").click()
            expect(page.locator("#f-cfg-msg")).to_contain_text("sdxl-lora train")
            saved = folders["runs"] / ".ui" / "saved" / "ui-run.toml"
            from sdxl_lora.core.config import load_config

            assert load_config(saved).train.trackers == ["tensorboard"]
            _fill(page, "f-train-steps", 7)
            tensorboard.uncheck()
            _pick(page, "f-cfg-saved", "ui-run.toml")
            page.locator("#f-cfg-load").click()
            expect(page.locator("#f-cfg-msg")).to_contain_text("loaded ui-run.toml into the form")
            expect(_box(page, "f-train-steps")).to_have_value("40")
            expect(_box(page, "f-ds-repeats")).to_have_value("2")
            expect(page.locator("#f-card input").first).to_have_value("no card preset")
            expect(tensorboard).to_be_checked()
            expect(wandb).not_to_be_checked()
            tensorboard.uncheck()  # the run below logs nowhere else
            page.locator("#f-cfg-command").click()
            expect(page.locator("#f-cfg-code")).to_contain_text("--set train.steps=40")
            page.locator("#train-start").click()
            expect(page.locator("#train-start-msg")).to_contain_text("ui-run started", timeout=WAIT)
            run = folders["runs"] / "ui-run"

            # ---- Stop (SIGINT: the state is saved), then Resume
            expect(_state(page)).to_have_attribute("data-state", "training", timeout=WAIT)
            page.locator("#run-stop").click()
            expect(page.locator("#run-action-msg")).to_contain_text("stop requested")
            expect(_state(page)).to_have_attribute("data-state", "stopped", timeout=WAIT)
            assert (run / "train.exit").read_text().strip() == "130"
            page.locator("#run-resume").click()
            expect(page.locator("#run-action-msg")).to_contain_text("ui-run: resuming")

            # ---- The UI dies; the run goes on; a new UI finds it again from its folder
            ui.kill(signal.SIGKILL)
            ui = server["ui"] = UI(folders, log, "--auth", f"{USER}:{PASSWORD}")
            _login(page, ui.url)
            page.get_by_role("tab", name="Train").click()
            expect(page.locator("#runs-table")).to_contain_text("ui-run", timeout=WAIT)
            expect(_state(page)).to_have_attribute("data-state", "finished", timeout=WAIT)
            expect(page.locator("#run-progress-text")).to_contain_text("step 40/40")
            expect(page.locator("#run-previews img")).to_have_count(2, timeout=WAIT)  # before and after
            # The loss chart draws lines over a numeric step axis (a few ticks, not one label per step); the
            # chart renders after the page's first refresh, so wait for its line first.
            page.locator("#run-loss svg .mark-line path").first.wait_for(state="attached", timeout=WAIT)
            lines = _drawn(page, "#run-loss svg .mark-line path")
            assert lines and max(b["width"] for b in lines) > 100
            ticks = page.evaluate("() => [...document.querySelectorAll('#run-loss svg .role-axis-label text')]"
                                  ".map(t => t.textContent)")
            assert "40" in ticks and len(ticks) < 30
            assert (run / "train.exit").read_text().strip() == "0"
            assert [d.repeats for d in load_config(run / "config.toml").data.datasets] == [2]  # the box's value
            kinds = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
            assert "interrupted" in kinds and "resume" in kinds and kinds[-1] == "done"
            _shot(page, "2-train")

            # ---- Generate: the base and the base with the new adapter, same seed, side by side
            page.reload()
            page.get_by_role("tab", name="Generate").click()
            _pick(page, "gen-adapter-0", "runs/ui-run/ui-run.safetensors")
            _fill(page, "gen-steps", 4)
            _fill(page, "gen-size", 64)
            page.locator("#gen-go").click()
            expect(page.locator("#gen-msg")).to_contain_text("adapters: ui-run.safetensors x 1", timeout=WAIT)
            base = page.request.get(page.locator("#gen-base img").get_attribute("src")).body()
            tuned = page.request.get(page.locator("#gen-tuned img").get_attribute("src")).body()
            assert base[:4] == tuned[:4] == b"\x89PNG" and base != tuned
            _shot(page, "3-generate")

            # ---- Export: kohya with metadata, downloaded
            page.get_by_role("tab", name="Export").click()
            _pick(page, "exp-source", "runs/ui-run")
            _fill(page, "exp-title", "shapes-v1")
            _fill(page, "exp-author", "tester")
            page.locator("#exp-go").click()
            expect(page.locator("#exp-msg")).to_contain_text("kohya adapter written", timeout=WAIT)
            with page.expect_download() as dl:
                page.locator("#exp-file a").first.click()
            got = tmp_path / dl.value.suggested_filename
            dl.value.save_as(got)
            assert got.name == "shapes-v1.safetensors"
            with safe_open(str(got), "pt") as fh:
                meta = fh.metadata()
                assert any(k.startswith("lora_unet_") for k in fh.keys())
            assert meta["modelspec.title"] == "shapes-v1" and meta["modelspec.author"] == "tester"
            assert (run / "exports" / "shapes-v1.safetensors").is_file()
            _shot(page, "4-export")

            # ---- LLM: the same schema-made form for the causal-LM task
            page.get_by_role("tab", name="LLM").click()
            expect(page.locator("#llm-model-path input")).to_have_value("tiny-llm")
            expect(page.locator("#llm-model-path")).to_contain_text("Base model")
            expect(page.locator("#llm-acc-dataset")).to_be_visible()
            _shot(page, "5-llm")
        finally:
            browser.close()
    # Everything the page loaded came from the UI itself: no CDN, fonts or analytics.
    assert {h for h in hosts if h not in ("data", "blob")} <= {f"127.0.0.1:{p}" for p in _ports(log)}


def _ports(log: Path) -> set[int]:
    return {int(line.rsplit(":", 1)[1].strip("/ \n")) for line in log.read_text().splitlines()
            if line.startswith("sdxl-lora UI: ")}


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) of sockets listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


# Each kohya_ss everyday action (docs/ui.md's table, in its order): the tab, the section to unfold (None: none), and
# the controls with the label a person reads on them.
EVERYDAY = [
    ("pick the image folders", "Train", None, [("f-data", "Image folders")]),
    ("set repeats per folder", "Train", "Per-dataset settings",
     [("f-ds-folder", "folder"), ("f-ds-repeats", "repeats")]),
    ("caption images by hand", "Dataset", None, [("ds-grid", "images and captions"), ("ds-save", "Save captions")]),
    ("caption or tag images with a model", "Dataset", "Caption with a local model",
     [("ds-cap-model", "captioning model"), ("ds-tag-general", "tagger: least probability of a general tag"),
      ("ds-tag-character", "tagger: least probability of a character tag")]),
    ("pick the base model", "Train", None, [("f-model-path", "Base model")]),
    ("pick a preset", "Train", None, [("f-card", "Card preset"), ("f-goal", "Goal preset")]),
    ("load a config", "Train", "Config file", [("f-cfg-load", "Load into the form")]),
    ("save a config", "Train", "Config file", [("f-cfg-save", "Save the form as a config")]),
    ("print the training command", "Train", "Config file", [("f-cfg-command", "Show the command")]),
    ("start training", "Train", None, [("train-start", "Start")]),
    ("stop training", "Train", None, [("run-stop", "Stop")]),
    ("sample images while training", "Train", None, [("run-sample-now", "Sample now")]),
    ("sample images from a LoRA", "Generate", None, [("gen-go", "Generate")]),
    ("watch the loss", "Train", None, [("runs-table", "loss"), ("run-loss", "")]),
    ("resume training", "Train", None, [("run-resume", "Resume")]),
    ("save the state now", "Train", None, [("run-save-now", "Save now")]),
    ("extract a LoRA", "Export", "Extract a LoRA from a fine-tuned model", [("ext-go", "Extract")]),
    ("resize a LoRA", "Export", "resize (a smaller file)", [("exp-resize-rank", "rank (0: as trained)")]),
    ("merge LoRAs into a model", "Export", "Merge adapters into a checkpoint", [("mrg-go", "Merge")]),
]


def test_each_kohya_ss_everyday_action_is_two_clicks_from_the_start_page(folders, server):
    # From the page as it opens, for each action: a click on its tab and at most one more (the section it is in);
    # then its controls are on screen with their labels. docs/ui.md lists the same actions.
    table = (REPO / "docs" / "ui.md").read_text(encoding="utf-8").split("## kohya_ss's everyday actions here")[1]
    rows = [line.split("|")[1].strip() for line in table.split("\n## ")[0].splitlines() if line.startswith("| ")]
    assert rows[1:] == [action for action, *_ in EVERYDAY]  # the table's actions, under its header
    expect.set_options(timeout=WAIT)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            _login(page, server["ui"].url)
            paths: dict[tuple, list] = {}
            for action, tab, section, controls in EVERYDAY:
                paths.setdefault((tab, section), []).append((action, controls))
            for (tab, section), actions in paths.items():
                page.goto(server["ui"].url)  # the start page: the Dataset tab, every section as it first shows
                expect(page.get_by_role("tab", name="Dataset", selected=True)).to_be_visible()
                page.get_by_role("tab", name=tab, exact=True).click()
                if section is not None:
                    page.locator(f"#tab-{tab.lower()}").get_by_text(section).first.click()
                for action, controls in actions:
                    for elem_id, label in controls:
                        control = page.locator(f"#{elem_id}")
                        expect(control, f"{action}: #{elem_id}").to_be_visible()
                        expect(control, f"{action}: #{elem_id}").to_contain_text(label)
                if (tab, section) == ("Dataset", "Caption with a local model"):
                    _shot(page, "0-dataset-caption-and-tag")
                if (tab, section) == ("Train", "Config file"):
                    _shot(page, "0-train-config-file")
        finally:
            browser.close()


def test_binds_loopback_asks_the_password_and_serves_only_its_folders(folders, server):
    ui = server["ui"]
    assert _listening(ui.port) == ["0100007F"]  # 127.0.0.1 only (the default), no IPv6 or wildcard socket
    assert "gradio.live" not in server["log"].read_text()  # no share link unless --share
    image = sorted((folders["datasets"] / "shapes").glob("*.png"))[0]

    def get(opener, path):
        try:
            with opener.open(ui.url + "gradio_api/file=" + urllib.parse.quote(str(path))) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    anonymous = urllib.request.build_opener()
    assert get(anonymous, image) in (401, 403)  # the password first
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    opener.open(ui.url + "login", data=urllib.parse.urlencode({"username": USER, "password": PASSWORD}).encode())
    assert get(opener, image) == 200                        # inside --datasets
    assert get(opener, REPO / "pyproject.toml") == 403      # not the folder it was started from
    assert get(opener, "/etc/passwd") == 403
    assert get(opener, folders["datasets"] / ".." / "ui.log") == 403


def test_remote_file_urls_are_refused_without_a_request():
    """Gradio would fetch `/file=http...` for the page; the app answers 403 before anything is fetched."""
    import asyncio

    from sdxl_lora.ui.app import _NoRemoteFiles

    called, sent = [], []

    async def inner(scope, receive, send):
        called.append(scope["path"])

    async def send(msg):
        sent.append(msg)

    mw = _NoRemoteFiles(inner)
    asyncio.run(mw({"type": "http", "path": "/gradio_api/file=https://example.org/x.png"}, None, send))
    asyncio.run(mw({"type": "http", "path": "/gradio_api/file=/data/x.png"}, None, send))
    assert sent[0]["status"] == 403 and called == ["/gradio_api/file=/data/x.png"]


def test_queue_starts_runs_one_after_another(tmp_path):
    """Two queued runs: the second starts only when the first process has ended."""
    from sdxl_lora.core.config import load_config
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    fake = tmp_path / "python"
    # Stands in for the interpreter: lives a moment as a "ui.worker" process, trains nothing.
    fake.write_text("#!/bin/sh\nsleep 1\n")
    fake.chmod(0o755)
    jobs = Jobs(f, python=str(fake))
    for name in ("first", "second"):
        jobs.enqueue_train(load_config(None, None, {"output.name": name, "output.runs_dir": str(f.runs)}))
    assert [q["name"] for q in jobs.queued()] == ["first", "second"]
    assert jobs.tick() == "first"
    assert jobs.tick() is None and jobs.busy() == "first"
    assert [q["name"] for q in jobs.queued()] == ["second"]
    deadline = time.monotonic() + 30
    while jobs.busy():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert jobs.tick() == "second"
    assert jobs.queued() == []


def _two_datasets(tmp_path):
    from sdxl_lora.ui.folders import Folders

    for name, n in (("a", 2), ("b", 3)):
        d = tmp_path / "datasets" / name
        d.mkdir(parents=True)
        for img in sorted((REPO / "sample_data" / "images").glob("*.png"))[:n]:
            shutil.copy(img, d / img.name)
    return Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")


def test_a_table_from_another_scan_never_writes_a_caption_beside_another_image(tmp_path):
    from sdxl_lora.ui import dataset_edit as edit
    from sdxl_lora.ui import tab_dataset

    f = _two_datasets(tmp_path)
    no_progress = lambda *a, **k: None  # noqa: E731
    items_a, rows_a = tab_dataset._scan(f, "a", ".txt", 64, no_progress)[:2]
    rows_a[1][3] = "a new caption"  # edited in the table the page still shows
    items_b = tab_dataset._scan(f, "b", ".txt", 64, no_progress)[0]
    # The page sent a's table with b's images: refused, nothing written in either folder.
    _, msg = tab_dataset._guarded(edit.save_table, f, items_b, rows_a, ".txt")
    assert "Scan again" in msg
    _, msg = tab_dataset._guarded(edit.bulk_apply, f, items_b, rows_a, edit.BulkEdit("add prefix", "x"),
                                  edit.SCOPES[0], ".txt")
    assert "Scan again" in msg
    assert not list((tmp_path / "datasets").rglob("*.txt"))
    # The row edited is the image captioned; an unsaved edit stops a bulk edit until it is saved.
    rows_b = edit.table(f, items_b)
    rows_b[1][3] = "a  new\ncaption"
    _, msg = tab_dataset._guarded(edit.bulk_preview, f, items_b, rows_b, edit.BulkEdit("add prefix", "x"),
                                  edit.SCOPES[0])
    assert "1 unsaved caption edit(s): Save captions first" in msg
    items_b, msg = edit.save_table(f, items_b, rows_b, ".txt")
    assert msg == "saved 1 caption(s): " + Path(items_b[1][0]).with_suffix(".txt").name
    assert Path(items_b[1][0]).with_suffix(".txt").read_text() == "a new caption\n"
    assert [p.name for p in (tmp_path / "datasets").rglob("*.txt")] == [Path(items_b[1][0]).with_suffix(".txt").name]


def test_the_doctor_and_report_follow_a_save_and_a_bulk_edit_without_a_rescan(tmp_path):
    """What the Dataset tab's Save captions and Apply return: the captions written, the table as the user has it
    (ticks kept), and the status, report and doctor as the folder is now."""
    import gradio as gr

    from sdxl_lora.ui import dataset_edit as edit
    from sdxl_lora.ui import tab_dataset

    f = _two_datasets(tmp_path)
    for img in sorted((tmp_path / "datasets" / "b").glob("*.png"))[:2]:
        img.with_suffix(".txt").write_text("a shape", encoding="utf-8")
    no_progress = lambda *a, **k: None  # noqa: E731
    items, rows, _, report, _, doctor, _ = tab_dataset._scan(f, "b", ".txt", 64, no_progress, "sks")
    assert "captions: 2 of 3" in report and "2 caption(s) lack the trigger word 'sks'" in doctor
    rows[0][3], rows[2][3] = "sks, a shape", "a star"
    items, rows, msg, _, report, _, doctor, _ = tab_dataset.save_captions(f, items, rows, ".txt", "b", 64, "sks",
                                                                          no_progress)
    assert msg.startswith("saved 2 caption(s)") and [r[3] for r in rows] == ["sks, a shape", "a shape", "a star"]
    assert "captions: 3 of 3" in report and "2 caption(s) lack the trigger word 'sks'" in doctor
    lacking = doctor.split("lack the trigger word")[1].split("\n")[0]
    assert "01\\_green\\_star" in lacking and "00\\_red\\_star" not in lacking
    rows[2][0] = True  # ticked, then the trigger word added to every caption lacking it
    what = edit.BulkEdit("add the trigger word where missing", "sks")
    previewed = (what, edit.SCOPES[0], (2,))
    items, rows, previewed, msg, status, report, _, doctor, _ = tab_dataset.apply_bulk(
        f, items, rows, previewed, what, edit.SCOPES[0], ".txt", "b", 64, "sks", no_progress)
    assert msg.startswith("2 caption(s) written") and previewed is None and [r[0] for r in rows] == [False, False, True]
    assert "captions: 3 of 3" in report and "Every caption holds the trigger word 'sks'" in doctor
    assert "3 usable images" in status
    # Not previewed: nothing written, the panes as they were.
    out = tab_dataset.apply_bulk(f, items, rows, None, what, edit.SCOPES[0], ".txt", "b", 64, "sks", no_progress)
    assert "Preview this edit first" in out[3] and all(v == gr.skip() for v in out[4:])


def test_bulk_edits_change_only_the_captions_they_name(tmp_path):
    from sdxl_lora.ui import dataset_edit as edit

    f = _two_datasets(tmp_path)
    imgs = sorted((tmp_path / "datasets" / "b").glob("*.png"))
    items = [[str(imgs[0]), "sks, a red star"], [str(imgs[1]), "a green star"], [str(imgs[2]), ""]]
    rows = edit.table(f, items, ticked={1})
    every, ticked = edit.SCOPES
    changes = lambda e, scope=every: [(Path(items[i][0]).name, after)  # noqa: E731
                                      for i, _, after in edit.bulk_changes(f, items, rows, e, scope)]
    assert changes(edit.BulkEdit("add the trigger word where missing", "sks")) == [
        (imgs[1].name, "sks, a green star"), (imgs[2].name, "sks")]
    assert changes(edit.BulkEdit("add prefix", "photo of")) == [
        (imgs[0].name, "photo of sks, a red star"), (imgs[1].name, "photo of a green star"), (imgs[2].name, "photo of")]
    assert changes(edit.BulkEdit("add suffix", ", 4k"), ticked) == [(imgs[1].name, "a green star, 4k")]
    assert changes(edit.BulkEdit("find and replace", find="star", replace="circle")) == [
        (imgs[0].name, "sks, a red circle"), (imgs[1].name, "a green circle")]
    # Bad input names the field; nothing is written by a count.
    for bad, field in ((edit.BulkEdit("find and replace"), "find: empty"), (edit.BulkEdit("add prefix"), "prefix: empty"),
                       (edit.BulkEdit("add the trigger word where missing"), "trigger word: empty")):
        with pytest.raises(ValueError, match=field):
            edit.bulk_preview(f, items, rows, bad, every)
    assert "3 of 3 caption(s) would change" in edit.bulk_preview(f, items, rows, edit.BulkEdit("add suffix", "x"),
                                                                  every) and not list(tmp_path.rglob("*.txt"))
    with pytest.raises(ValueError, match="apply to: no row is ticked"):
        edit.bulk_changes(f, items, edit.table(f, items), edit.BulkEdit("add suffix", "x"), ticked)
    items, msg = edit.bulk_apply(f, items, rows, edit.BulkEdit("add the trigger word where missing", "sks"), every, ".txt")
    assert msg == "2 caption(s) written (add the trigger word where missing)"
    assert {p.name: p.read_text() for p in tmp_path.rglob("*.txt")} == {
        imgs[1].with_suffix(".txt").name: "sks, a green star\n", imgs[2].with_suffix(".txt").name: "sks\n"}


def test_uploads_take_images_and_captions_only_and_never_overwrite_unasked(tmp_path):
    from sdxl_lora.ui import dataset_edit as edit

    f = _two_datasets(tmp_path)
    src = sorted((tmp_path / "datasets" / "a").glob("*.png"))[0]
    cap = tmp_path / "c.txt"
    cap.write_bytes(b"caf\xe9")  # not UTF-8
    msg = edit.upload(f, "a", [("../up.png", src), ("new.png", src), ("c.txt", cap), (".hidden.png", src),
                               (src.name, src)], ".txt", False)
    assert msg.startswith("uploaded 1 file(s) into a: new.png")
    assert "../up.png: a file name only" in msg and ".hidden.png: a file name only" in msg
    assert "c.txt: caption is not UTF-8" in msg and f"a/{src.name} already exists; tick 'overwrite files already there'" in msg
    assert sorted(p.name for p in tmp_path.rglob("up.png")) == [] and not (tmp_path / "datasets/a/c.txt").exists()
    with pytest.raises(ValueError, match="files: none chosen"):
        edit.upload(f, "a", [], ".txt", False)


def test_captioning_from_the_tab_writes_the_missing_captions_with_a_model_under_the_models_folder(tmp_path):
    from test_datasets import tiny_blip

    from sdxl_lora.ui import dataset_edit as edit

    f = _two_datasets(tmp_path)
    tiny_blip(f.models / "captioners" / "blip")
    assert edit.captioner_choices(f.models) == ["captioners/blip"]
    imgs = sorted((tmp_path / "datasets" / "b").glob("*.png"))
    imgs[0].with_suffix(".txt").write_text("mine", encoding="utf-8")
    seen = []
    msg = edit.caption(f, "b", "captioners/blip", ".txt", False, "sks,", lambda done, total: seen.append((done, total)))
    assert msg.startswith("captions written: 2; kept (already there): 1") and "ticking 'replace existing captions'" in msg
    assert seen and seen[-1] == (2, 2)
    assert imgs[0].with_suffix(".txt").read_text(encoding="utf-8") == "mine"
    assert all(p.with_suffix(".txt").read_text(encoding="utf-8").startswith("sks, ") for p in imgs[1:])
    with pytest.raises(ValueError, match="captioning model: none picked"):
        edit.caption(f, "b", "", ".txt", False, "", None)


CLI_RUN = ["--set", "train.device=cpu", "--set", "data.resolution=64", "--set", "preview.prompts=",
           "--set", "preview.before=false", "--set", "train.log_every=1", "--batch-size", "1"]


def _cli_train(runs: Path, name: str, steps: int, *extra: str, **env) -> subprocess.Popen:
    """`sdxl-lora train` in a terminal of its own: not started by any UI."""
    return subprocess.Popen([sys.executable, "-m", "sdxl_lora.cli", "train", "--out", str(runs), "--name", name,
                             "--steps", str(steps), *CLI_RUN, *extra], cwd=runs.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env,
                                 "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})


def _wait_for(cond, proc, what: str):
    deadline = time.monotonic() + WAIT / 1000
    while not cond():
        assert proc.poll() is None or cond(), f"{what}: the process ended:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_runs_started_from_the_cli_show_their_state_and_can_be_stopped_and_queued_to_resume(tmp_path):
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    fake = tmp_path / "python"  # the queue's interpreter: a resume it starts trains nothing
    fake.write_text("#!/bin/sh\nsleep 30\n")
    fake.chmod(0o755)
    jobs = Jobs(f, python=str(fake))
    state = lambda name: {s.name: s for s in jobs.runs()}[name]  # noqa: E731

    # log_every far above the steps it will do: the state still shows the step the run is at and the time
    # left (progress.json), not the last logged step.
    proc = _cli_train(f.runs, "cli-run", 400, "--set", "train.log_every=1000")
    _wait_for(lambda: (f.runs / "cli-run" / "config.toml").is_file(), proc, "the run folder")
    _wait_for(lambda: state("cli-run").state == "training" and state("cli-run").step >= 4, proc,
              "training, steps between log points")
    st = state("cli-run")
    logged = [e["step"] for e in map(json.loads, (f.runs / "cli-run" / "events.jsonl").read_text().splitlines())
              if e["event"] == "step"]
    assert logged == [1] and st.step > 1 and st.total == 400 and st.eta_s is not None and st.eta_s > 0
    # and the loss and images/s of the step it is at, not the first step's (on the CPU read at once).
    assert st.logged_step == st.step and math.isfinite(st.loss) and st.images_per_s and st.images_per_s > 0
    assert jobs.stop("cli-run").endswith("the state is saved")  # Stop works on a run the UI did not start
    assert proc.wait(WAIT / 1000) == 130
    st = state("cli-run")
    assert st.state == "stopped" and st.resumable and "resume" in st.message
    jobs.busy = lambda: "another-run"  # the queue is busy: the resume waits its turn
    jobs.enqueue_resume("cli-run")
    assert state("cli-run").state == "queued"

    killed = _cli_train(f.runs, "killed", 400, SDXL_LORA_TEST_KILL="step:2")
    killed.wait(WAIT / 1000)
    assert state("killed").state == "died"


def test_a_run_that_fails_shows_failed_with_the_error(tmp_path):
    from sdxl_lora import training
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.task import SDXLTask
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs

    class Broken(SDXLTask):
        def setup(self, accelerator, run):
            raise RuntimeError("CUDA out of memory while loading the model")

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    cfg = load_config(None, None, {"output.runs_dir": str(f.runs), "output.name": "broken", "train.device": "cpu"})
    with pytest.raises(RuntimeError):
        training.fit(training.new_job(cfg), Broken(cfg))
    st = {s.name: s for s in Jobs(f).runs()}["broken"]
    assert st.state == "failed" and "CUDA out of memory" in st.message


def test_the_run_view_shows_the_gpu_memory_a_gpu_run_logs(tmp_path):
    # A GPU run's step events carry the memory torch's allocator holds (core/loop.py); the run's line shows it.
    # A CPU run logs none, and its line says nothing about GPU memory.
    from sdxl_lora.core.runs import Run
    from sdxl_lora.ui.jobs import run_status
    from sdxl_lora.ui.tab_train import _progress_html

    run = Run(tmp_path / "gpu")
    run.dir.mkdir()
    run.event("start", step=0, total_steps=10)
    run.event("step", step=5, total_steps=10, loss=0.1, lr=1e-4, images_per_s=19.9, eta_s=3.0,
              gpu_mem_gib=30.61, gpu_peak_gib=31.2)
    line = _progress_html(run_status(run.dir))
    assert "GPU memory 30.6 GiB (peak 31.2)" in line and "19.90 img/s" in line
    cpu = Run(tmp_path / "cpu")
    cpu.dir.mkdir()
    cpu.event("step", step=5, total_steps=10, loss=0.1, lr=1e-4, images_per_s=1.5, eta_s=3.0)
    assert "GPU memory" not in _progress_html(run_status(cpu.dir))


def test_the_llm_form_starts_from_what_llm_train_uses_and_the_default_folders_hold_its_data():
    import argparse

    from sdxl_lora import cli
    from sdxl_lora.commands.llm import llm_config_from_args
    from sdxl_lora.ui.app import add_arguments
    from sdxl_lora.ui.folders import image_folders, jsonl_files
    from sdxl_lora.ui.form import schema_fields

    cfg = llm_config_from_args(cli.build_parser().parse_args(["llm", "train"])).model_dump()
    differs = {}
    for spec in schema_fields(task="llm"):
        section, _, name = spec.key.rpartition(".")
        value = cfg[section][name] if section else cfg[name]
        if spec.default != value:
            differs[spec.key] = (spec.default, value)
    assert differs == {}  # no SDXL demo settings (its steps, its ResNet override) in the LLM form
    datasets = Path(add_arguments(argparse.ArgumentParser()).parse_args([]).datasets)
    assert jsonl_files(datasets) and "images" in image_folders(datasets)  # both tabs have data to pick


def _form_keys(task: str) -> tuple[list[str], dict]:
    """The fields the task's form shows (the schema's and those the page picks itself) and their widgets."""
    import gradio as gr

    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.tab_train import Form

    f = Folders.create(REPO / "sample_data", REPO / ".cache" / "models", REPO / "runs")
    with gr.Blocks():
        form = Form(f, task=task)
        form.render()
    keys = [s.key for s in form.specs] + ["model.path", form.data_key]
    return keys + (["model.tokenizer", "preview.prompts"] if task == "sdxl" else []), form.widgets


@pytest.mark.parametrize("task", ["sdxl", "llm"])
def test_every_form_field_has_a_plain_label_a_group_and_one_line_of_help(task):
    import re

    from sdxl_lora.ui.labels import GROUPS, LABELS, label_for

    keys, widgets = _form_keys(task)
    assert "train.vram_gb" in keys or task == "llm"
    assert {"train.vram_gb", "preview.vae_tiling"} <= set(LABELS)
    missing = [k for k in keys if k not in LABELS]
    assert missing == []  # a new schema field needs its words in sdxl_lora/ui/labels.py
    for key in keys:
        words = label_for(key, task)
        assert words.group in GROUPS, key
        assert "." not in words.text and "_" not in words.text and words.text.strip(), key
        assert words.help and "\n" not in words.help and len(words.help) < 140, key
        # User terms: no figures, no file references, no schema paths.
        assert not re.search(r"\d|\.md\b|\.py\b|docs/|<|\b[a-z]+\.[a-z_]+\b", words.help), (key, words.help)
        if key in widgets:
            assert widgets[key].label == words.text and widgets[key].info == words.help
    common = {label_for(k, task).group for k in keys if label_for(k, task).common}
    assert {"Model", "Dataset", "How long", "Saving and output"} <= common
    if task == "sdxl":
        assert label_for("train.vram_gb").group == "Speed and memory" and label_for("train.vram_gb").common


def test_the_summary_line_says_what_will_train_and_what_a_memory_budget_chose():
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.plan import component_bytes, fit_budget, plan_config, run_memory_for
    from sdxl_lora.ui.summary import run_summary

    cfg = load_config(None, None, {"model.path": "arch:sdxl", "data.resolution": 1024})
    planned = plan_config(cfg)
    line = run_summary(cfg)
    assert line.startswith(f"{round(planned.plan.trainable_params / 1e6)} M trainable parameters in "
                           f"{len(planned.plan.targets)} layers; whole run peak on a GPU ~")
    peak = run_memory_for(cfg, planned, component_bytes(cfg)).peak / 2**30
    assert f"~{peak:.1f} GiB (training" in line and "budget" not in line
    # A budget smaller than that peak: the levers it chose are named in words, and the peak shown fits it.
    budget = int(peak / 2)
    tight = load_config(None, None, {"model.path": "arch:sdxl", "data.resolution": 1024, "train.vram_gb": budget})
    fit = fit_budget(tight, budget)
    line = run_summary(tight)
    assert f"budget {budget} GiB: chose " in line
    assert ("tiled previews" in line) == fit.cfg.preview.vae_tiling
    assert (f"{fit.cfg.model.quantize} base model" in line) == (fit.cfg.model.quantize != "none")
    assert f"~{fit.memory.peak / 2**30:.1f} GiB" in line and fit.memory.peak / 2**30 < budget


def test_a_card_preset_fills_the_form_with_what_fits_and_a_goal_preset_with_its_settings():
    # The functions behind the Train form's preset dropdowns, on the form's config for SDXL base's architecture.
    from sdxl_lora.ui.form import build_config, schema_fields, to_widget_value
    from sdxl_lora.ui.summary import card_choices, card_fill, goal_fill, run_summary

    _, widgets = _form_keys("sdxl")
    specs = [s for s in schema_fields() if s.key in widgets]
    values = {s.key: to_widget_value(s, s.default) for s in specs}
    fixed = {"model.path": "arch:sdxl", "data.resolution": 1024}
    cfg = build_config(specs, [values[s.key] for s in specs], fixed)
    labels = dict((name, label) for label, name in card_choices(cfg))
    assert labels[""] == "no card preset" and re.fullmatch(r"8gb · ~[\d.]+ GiB · [\d.]+x time per image", labels["8gb"])
    # The form sets every field, yet the card's planner chooses the levers, and the filled form fits the card.
    filled = {**values, **card_fill(cfg, "8gb"), "card": "8gb"}
    assert filled["train.vram_gb"] == 8 and filled["model.quantize"] == "nf4"
    line = run_summary(build_config(specs, [filled[s.key] for s in specs], fixed))
    assert "budget 8 GiB: fits as set" in line and "card preset 8gb" in line
    peak = float(re.search(r"~([\d.]+) GiB", line).group(1))
    assert peak <= 8 and f"~{peak:.1f} GiB" in labels["8gb"]
    # No card: the levers back to the schema's, no budget.
    back = card_fill(build_config(specs, [filled[s.key] for s in specs], fixed), "")
    assert back["train.vram_gb"] is None and back["model.quantize"] == "none" and back["train.checkpoint_budget_gb"] is None
    style = goal_fill(cfg, "style")
    assert style["adapter.preset"] == "locon" and style["adapter.rank"] == 32 and style["data.flip"] is True


@pytest.fixture(scope="module")
def saved_run(folders, as_process):
    """A short run trained from the CLI on the UI's dataset into its runs folder: saved states at steps 2 and 4,
    the final adapter at step 6, and its eval loss at the end. The CLI's main() in this process (conftest.py:
    as_process), as _cli_train's terminal would run it, without a process's seconds of imports: the UI only
    reads the run's folder."""
    from sdxl_lora.cli import main

    with as_process():
        assert main(["train", "--out", str(folders["runs"]), "--name", "cmp-run", "--steps", "6", *CLI_RUN,
                     "--data", str(folders["datasets"] / "shapes"), "--set", "train.save_every=2",
                     "--set", "train.keep_checkpoints=5"]) == 0
    return folders["runs"] / "cmp-run"


def test_compare_checkpoints_by_eye_export_the_chosen_one_and_duplicate_the_run(folders, server, saved_run):
    ui = server["ui"]
    expect.set_options(timeout=WAIT)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT, accept_downloads=True)
            _login(page, ui.url)
            page.get_by_role("tab", name="Compare").click()
            _pick(page, "cmp-run", "cmp-run")
            # The checkpoints with the losses logged at them: the final one has its eval loss.
            expect(page.locator("#cmp-table")).to_contain_text("step 6 (final)")
            expect(page.locator("#cmp-table")).to_contain_text("step 2")
            eval_after = next(e["loss"] for e in map(json.loads, (saved_run / "events.jsonl").read_text().splitlines())
                              if e["event"] == "eval" and e["step"] == 6)
            expect(page.locator("#cmp-table")).to_contain_text(f"{eval_after:.4f}")
            _fill(page, "cmp-prompts", "a red circle on a white background --s 1 --w 64 --h 64 --d 3")
            page.locator("#cmp-go").click()
            # Three checkpoints (two states, the final adapter) at three strengths: nine renders, one grid.
            expect(page.locator("#cmp-msg")).to_contain_text("0 image(s) from the cache, 9 rendered")
            expect(page.locator("#cmp-grid img").first).to_be_visible()
            src = page.locator("#cmp-grid img").first.get_attribute("src")
            assert page.request.get(src).body()[:4] == b"\x89PNG"
            cells = sorted((saved_run / "compare").glob("*.png"))
            assert len([c for c in cells if not c.name.startswith("grid-")]) == 9
            _shot(page, "6-compare")
            # A second look at the same grid comes from the run's cache: nothing is rendered again.
            page.locator("#cmp-go").click()
            expect(page.locator("#cmp-msg")).to_contain_text("9 image(s) from the cache, 0 rendered")
            # Bad input names its field.
            _fill(page, "cmp-strengths", "0.5, strong")
            page.locator("#cmp-go").click()
            expect(page.locator("#cmp-msg")).to_contain_text("strengths: 'strong' is not a number")

            # Export step 2 at half strength, as kohya: the file's update is half the checkpoint's.
            _pick(page, "cmp-pick", "step 2")
            _fill(page, "cmp-strength", 0.5)
            page.locator("#cmp-export").click()
            expect(page.locator("#cmp-export-msg")).to_contain_text("kohya adapter written", timeout=WAIT)
            out = saved_run / "exports" / "cmp-run-step2-x50.safetensors"
            assert out.is_file()
            with safe_open(str(out), "pt") as fh:
                meta = fh.metadata()
            assert meta["sdxl_lora.steps"] == "2" and meta["sdxl_lora.strength"] == "0.5"
            _half_of_the_state(out, saved_run)
            # Which tools load the file, as the Export tab and `sdxl-lora inspect` say it.
            from sdxl_lora.sdxl.formats.loaders import file_notes

            expect(page.locator("#cmp-export-msg")).to_contain_text(file_notes(out)[0])
            expect(page.locator("#cmp-export-msg")).to_contain_text("LoRA: exact in ComfyUI")
            _shot(page, "6b-compare-exported")
            # Never over an existing file unless asked.
            before = out.stat().st_mtime_ns
            page.locator("#cmp-export").click()
            # ... naming the page's boxes, not the CLI's flag.
            expect(page.locator("#cmp-export-msg")).to_contain_text(
                "already exists; type another file name, or tick 'overwrite an existing export'")
            assert out.stat().st_mtime_ns == before
            _shot(page, "7-compare-export")

            # One rendering path: Generate draws, with the run's final adapter, the image Compare drew for that
            # checkpoint at the same prompt, seed, steps, guidance and size (no negative prompt in either).
            before = set((saved_run / "compare").glob("*.png"))
            _fill(page, "cmp-prompts", "a red circle on a white background --s 1 --w 64 --h 64 --d 5 --l 5")
            _fill(page, "cmp-strengths", "1")
            page.locator("#cmp-go").click()
            expect(page.locator("#cmp-msg")).to_contain_text("0 image(s) from the cache, 3 rendered")
            drawn = [_png_pixels(p.read_bytes()) for p in set((saved_run / "compare").glob("*.png")) - before
                     if not p.name.startswith("grid-")]
            page.get_by_role("tab", name="Generate").click()
            _pick(page, "gen-adapter-0", "runs/cmp-run/cmp-run.safetensors")
            _fill(page, "gen-prompt", "a red circle on a white background")
            for box, value in (("gen-seed", 5), ("gen-steps", 1), ("gen-guidance", 5), ("gen-size", 64)):
                _fill(page, box, value)
            page.locator("#gen-go").click()
            expect(page.locator("#gen-msg")).to_contain_text("adapters: cmp-run.safetensors x 1")
            generated = _png_pixels(page.request.get(page.locator("#gen-tuned img").get_attribute("src")).body())
            base = _png_pixels(page.request.get(page.locator("#gen-base img").get_attribute("src")).body())
            assert len(drawn) == 3 and sum((generated == d).all() for d in drawn) == 1 and (generated != base).any()

            # Duplicate as new run: the New run form holds the run's settings under a new name.
            page.get_by_role("tab", name="Train").click()
            summary = page.locator("#train-summary")
            # First a person's edits, each shown in the summary line: a smaller adapter, then no image folder
            # (the per-dataset table follows the picker).
            _fill(page, "f-adapter-rank", 2)
            expect(summary).to_contain_text(_trains(None, {"adapter.rank": 2}))
            page.locator("#f-acc-datasets").get_by_text("Per-dataset settings").click()
            expect(page.locator("#f-datasets")).to_contain_text("shapes")
            page.locator("#f-data .token-remove").first.click()
            expect(summary).to_contain_text("pick at least one")
            expect(page.locator("#f-datasets")).not_to_contain_text("shapes")
            _pick(page, "run-pick", "cmp-run")
            page.locator("#run-duplicate").click()
            expect(page.locator("#run-action-msg")).to_contain_text("a copy of cmp-run as cmp-run-2")
            expect(_box(page, "f-output-name")).to_have_value("cmp-run-2")
            expect(_box(page, "f-train-steps")).to_have_value("6")
            expect(_box(page, "f-data-resolution")).to_have_value("64")
            expect(_box(page, "f-train-batch-size")).to_have_value("1")
            # The copy's folder and its row are back, and the summary line describes the copy: the run's adapter.
            expect(page.locator("#f-data")).to_contain_text("shapes")
            expect(page.locator("#f-datasets")).to_contain_text("shapes")
            expect(summary).to_contain_text(_trains(saved_run))
            expect(summary).not_to_contain_text("Error")
            _shot(page, "8-duplicate")
            # A person's edit of the copy shows in the line as before the fill.
            _fill(page, "f-adapter-rank", 8)
            expect(summary).to_contain_text(_trains(saved_run, {"adapter.rank": 8}))
            # Start: the Runs panel shows the new run at once, not the one picked before.
            _fill(page, "f-output-name", "cmp-copy")
            page.locator("#train-start").click()
            expect(page.locator("#train-start-msg")).to_contain_text("cmp-copy")
            expect(page.locator("#run-progress-text")).to_contain_text("cmp-copy")
            expect(page.locator("#run-pick input")).to_have_value("cmp-copy")
            expect(_state(page)).to_have_attribute("data-state", "finished")
        finally:
            browser.close()


def _png_pixels(data: bytes):
    """An image file's RGB pixels, as an array."""
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _trains(run: Path | None, changes: dict | None = None) -> str:
    """What the summary line says a copy of `run` (None: a form left at its defaults) with `changes` (dotted keys)
    trains: "N trainable parameters in L layers"."""
    from sdxl_lora.core.config import load_config
    from sdxl_lora.ui.summary import run_summary

    line = run_summary(load_config(run and run / "config.toml", None, changes))
    return line[:line.index(" layers") + len(" layers")]


def _half_of_the_state(exported: Path, run: Path) -> None:
    """The exported layers' updates are half those of the run's step-2 state (its trained weights, with the
    alphas of the run's own diffusers file)."""
    from safetensors.torch import load_file

    from sdxl_lora.sdxl.formats.export import layer_table, load_adapter

    table = layer_table("tiny-sdxl-demo")
    got = load_adapter(exported, table).layers
    alphas = load_adapter(run / "cmp-run.diffusers.safetensors", table).layers
    state = load_file(str(run / "checkpoints" / "step-00000002" / "adapter.safetensors"))
    assert len(got) == len(alphas)
    for module in ("down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", "mid_block.resnets.0.conv1"):
        down = state[f"{module}.lora_A.default.weight"].flatten(1)
        up = state[f"{module}.lora_B.default.weight"].flatten(1)
        trained = alphas[f"unet.{module}"]
        want = 0.5 * (up @ down) * trained.alpha / trained.rank
        assert (got[f"unet.{module}"].delta().flatten(1) - want).abs().max() <= 1e-3 * want.abs().max()


def test_a_duplicated_run_starts_from_the_same_config_under_a_new_name(folders, saved_run):
    """What the form holds after Duplicate builds the run's own config again; only the name (and the paths the
    page sets itself) differ, and the run's folder is left as it was."""
    import gradio as gr

    from sdxl_lora.core.config import load_config
    from sdxl_lora.ui.duplicate import form_values
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs
    from sdxl_lora.ui.form import default_prompts
    from sdxl_lora.ui.tab_train import Form

    f = Folders.create(folders["datasets"], folders["models"], folders["runs"])
    with gr.Blocks():
        form = Form(f)
        form.render()
    files = sorted(p.name for p in saved_run.iterdir())
    values, copy = form_values(form, Jobs(f), "cmp-run", default_prompts())
    assert copy == "cmp-run-2" and not (folders["runs"] / copy).exists()
    got, want = form.config(values, copy, None).model_dump(), load_config(saved_run / "config.toml").model_dump()
    assert got["output"]["name"] == "cmp-run-2" and got["data"]["dirs"] == want["data"]["dirs"]
    for section, fields in (("output", ("name", "runs_dir")), ("model", ("cache_dir",)), ("preview", ("prompts",))):
        for name in fields:
            got[section].pop(name), want[section].pop(name)
    assert got == want
    assert sorted(p.name for p in saved_run.iterdir()) == files


def test_an_llm_run_duplicated_fills_the_llm_form_and_the_copy_trains(tmp_path):
    """Duplicate as new run on a causal-LM run (from the Train tab's runs): the LLM tab's form holds its config
    under a new name and that tab is shown; Start trains the copy, with the run's config, beside the run."""
    import gradio as gr

    from sdxl_lora.core.config import ModelConfig, load_config
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs, run_status
    from sdxl_lora.ui.tab_train import Form, FormTab, duplicated, start_run

    f = Folders.create(REPO / "sample_data", ModelConfig().cache_dir, tmp_path / "runs")
    from sdxl_lora.cli import main

    assert main(["llm", "train", "--out", str(f.runs), "--name", "llm-run", "--steps", "2", "--device", "cpu"]) == 0
    files = sorted(p.name for p in (f.runs / "llm-run").iterdir())
    with gr.Blocks():
        tabs = [FormTab(Form(f), "train", gr.Markdown()), FormTab(Form(f, task="llm", prefix="llm-"), "llm", gr.Markdown())]
        for t in tabs:
            t.form.render()
    jobs = Jobs(f)
    out = duplicated(jobs, tabs, "llm-run")
    msg, shown, sdxl_msg, llm_msg = out[:4]
    assert "the LLM tab's form holds a copy of **llm-run** as **llm-run-2**" in msg and llm_msg == msg
    assert shown.selected == "llm" and isinstance(sdxl_msg, type(gr.skip()))
    sdxl_values, values = out[4:4 + len(tabs[0].form.inputs)], out[4 + len(tabs[0].form.inputs):]
    assert all(isinstance(v, type(gr.skip())) for v in sdxl_values) and len(values) == len(tabs[1].form.inputs)
    assert start_run(tabs[1].form, jobs, values)[0] == "run **llm-run-2** started"
    copy = f.runs / "llm-run-2"
    deadline = time.monotonic() + WAIT / 1000
    while run_status(copy).state != "finished":
        assert run_status(copy).state not in ("failed", "stopped"), jobs.log_tail("llm-run-2")
        assert time.monotonic() < deadline, jobs.log_tail("llm-run-2")
        time.sleep(0.5)
    got, want = load_config(copy / "config.toml").model_dump(), load_config(f.runs / "llm-run" / "config.toml").model_dump()
    assert got["task"] == "llm" and got["output"].pop("name") == "llm-run-2" and want["output"].pop("name") == "llm-run"
    for section, name in (("model", "cache_dir"),):  # what the page sets itself (an LLM config has no preview.prompts)
        got[section].pop(name), want[section].pop(name)
    assert got == want
    assert any(e["event"] == "step" for e in map(json.loads, (copy / "events.jsonl").read_text().splitlines()))
    assert sorted(p.name for p in (f.runs / "llm-run").iterdir()) == files
    # A page without the LLM tab says so, naming what to do.
    msg = duplicated(jobs, tabs[:1], "llm-run")[0]
    assert "is an LLM run" in msg and "no LLM tab" in msg and "config.toml" in msg


def test_a_form_left_at_its_defaults_lets_the_run_choose_its_speed_and_memory_levers(tmp_path):
    # The form holds every field; the ones a run decides when unset (CUDA graphs, compilation, checkpointing,
    # quantization...) must reach the run unset, in the queued file too, or a UI run would never get the speed
    # train.speed="auto" picks on a GPU, nor a memory budget's choices. A value the user changed stays theirs.
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.plan import fit_budget
    from sdxl_lora.sdxl.speed import auto_levers
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.form import DECIDED_WHEN_UNSET, build_config, schema_fields, to_widget_value
    from sdxl_lora.ui.jobs import Jobs

    _, widgets = _form_keys("sdxl")
    specs = [s for s in schema_fields() if s.key in widgets]
    assert set(DECIDED_WHEN_UNSET) <= {s.key for s in specs}  # each is on the form
    values = {s.key: to_widget_value(s, s.default) for s in specs}
    fixed = {"model.path": "arch:sdxl", "data.resolution": 1024, "output.name": "f", "output.runs_dir": str(tmp_path)}
    cfg = build_config(specs, [values[s.key] for s in specs], {**fixed, "train.vram_gb": 8})
    (tmp_path / "datasets").mkdir()
    jobs = Jobs(Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path))
    jobs.busy = lambda: "another-run"  # queued, not started
    jobs.enqueue_train(cfg)
    queued = load_config(tmp_path / ".ui" / "configs" / "f.toml")
    for c in (cfg, queued):
        chosen, why = auto_levers(c, "cuda", 1)
        assert chosen.train.cuda_graphs and "as set" not in why["cuda_graphs"]
        assert "as set" not in why["channels_last"]
        assert fit_budget(c, 8).cfg.model.quantize == "nf4"  # the budget chose the base's storage
        assert c.train.lr == values["train.lr"] and c.train.steps == values["train.steps"]  # the rest as shown
    # Ticked on the form: the user's choice, kept by the queue and by auto.
    mine = build_config(specs, [True if s.key == "train.cuda_graphs" else values[s.key] for s in specs], fixed)
    assert "cuda_graphs" in mine.train.model_fields_set
    assert auto_levers(mine, "cuda", 1)[1]["cuda_graphs"] == "True, as set"


def test_a_run_started_from_the_cli_shows_each_step_in_the_browser_between_log_points(folders, server):
    # The run logs every 10000 steps, so its events hold step 1 only; the page still shows the step it is at, its
    # loss and speed, and the time left, moving, and its Stop button stops a run it did not start.
    expect.set_options(timeout=WAIT)
    runs = folders["runs"]
    runs.mkdir(exist_ok=True)
    # Far longer than it is watched; step-0 previews of many sampling steps: seconds of rendering to watch.
    proc = _cli_train(runs, "cli-steps", 5000, "--set", "train.log_every=10000", "--set", "preview.before=true",
                      "--set", f"preview.prompts='{REPO / 'sample_data' / 'prompts.txt'}'", "--set", "preview.steps=300")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport=VIEWPORT)
                _login(page, server["ui"].url)
                page.get_by_role("tab", name="Train").click()
                expect(page.locator("#runs-table")).to_contain_text("cli-steps")
                _pick(page, "run-pick", "cli-steps")
                text = page.locator("#run-progress-text")
                # Before the first step: what it does, and how far (the images of the set done so far).
                expect(text).to_contain_text(re.compile(r"rendering previews [0-7] of 8 \(step 0\)"))
                _shot(page, "9a-run-rendering-previews")
                expect(text).to_contain_text(re.compile(r"step ([3-9]|\d\d+)/5000 · .*eta \d+ s"))
                first = int(re.search(r"step (\d+)/5000", text.inner_text())[1])
                expect(text).not_to_contain_text(f"step {first}/5000")  # it moves on, still between log points
                # The loss and speed move with the steps too: a recent step's, not the one log point's (step 1).
                expect(text).to_contain_text(re.compile(r"loss \d+\.\d{4} · [\d.]+ img/s"))
                expect(text).not_to_contain_text("(at step 1)")
                expect(page.locator("#runs-table")).to_contain_text(re.compile(r"\d\.\d{4}"))
                expect(page.locator("#runs-table")).not_to_contain_text("(at step 1)")
                logged = [e["step"] for e in map(json.loads, (runs / "cli-steps" / "events.jsonl").read_text()
                                                 .splitlines()) if e["event"] == "step"]
                assert logged == [1]
                _shot(page, "9-cli-run-between-log-points")
                # Sample now: previews of the step it is at, beside the step-0 ones, while it goes on training.
                page.locator("#run-sample-now").click()
                expect(page.locator("#run-action-msg")).to_contain_text("asked for previews")
                expect(page.locator("#run-previews img")).to_have_count(2)
                shot = [e for e in map(json.loads, (runs / "cli-steps" / "events.jsonl").read_text().splitlines())
                        if e["event"] == "samples"]
                assert [e["step"] for e in shot][0] == 0 and shot[1]["step"] > first
                expect(_state(page)).to_have_attribute("data-state", "training")
                page.locator("#run-stop").click()
                expect(_state(page)).to_have_attribute("data-state", "stopped")
            finally:
                browser.close()
        assert proc.wait(WAIT / 1000) == 130
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_is_one_line_naming_it_and_nothing_starts(tmp_path, capsys):
    # Another program (another `sdxl-lora ui`) listens on the port: the UI says so before it makes its folders
    # or starts the run queue on the runs folder, instead of gradio's traceback after them.
    from sdxl_lora.cli import main

    (tmp_path / "datasets").mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc = main(["ui", "--port", str(port), "--datasets", str(tmp_path / "datasets"),
                   "--models", str(tmp_path / "models"), "--runs", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"error: port {port} is in use on 127.0.0.1" in err and "--port" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["datasets"]  # no runs folder, no queue in it
