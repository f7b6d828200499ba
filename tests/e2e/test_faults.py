"""What a user sees when something goes wrong (docs/training.md, "When something goes wrong"): one paragraph
on stderr naming the file or field and what to do, exit code 2 for bad input and 1 for the machine, no
traceback, and nothing half-written left behind. CPU, the tiny models.

Faults tested where their subject lives, not repeated here:
  - a full disk during a state save and at the final export; SIGKILL mid-save and mid-step; a truncated
    newest state; Ctrl-C; two starts of one run name; a start killed before its config.toml was whole;
    resume with another plan or dataset: tests/core/test_durability.py
  - the config fuzz over the whole schema (inf, nan, negatives, zero, ranges; a file that is not UTF-8):
    tests/core/test_config.py
  - images of each damaged kind, decoded at the scan as at caching: tests/sdxl/test_data.py
  - LLM data lines that are not UTF-8, unknown roles, empty answers: tests/llm/test_llm.py
  - the UI's caption editor writing only beside its image: tests/e2e/test_frontends.py
"""
import json
import os
import pickle
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdxl_lora.cli import main


# ---- bad model folders: each refused before training, naming the file; pickles never loaded


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _variant(src: Path, dest: Path) -> Path:
    """A copy of the model folder `src` whose files are hard links (fast); _rewrite replaces one of them."""
    shutil.copytree(src, dest, copy_function=os.link)
    return dest


def _rewrite(path: Path, data: bytes | None = None, tensors: dict | None = None) -> None:
    path.unlink()  # a new file: writing through the hard link would damage the source model
    if tensors is not None:
        save_file(tensors, str(path), metadata={"format": "pt"})
    elif data is not None:
        path.write_bytes(data)


def _pickle_only(d: Path, component: str, stem: str, weights: str) -> Path:
    marker = d.parent / f"{d.name}-pickle-ran"
    _rewrite(d / component / weights)
    (d / component / f"{stem}.bin").write_bytes(pickle.dumps(_Boom(marker)))
    return marker


def _drop_keys(path: Path, n: int = 2) -> None:
    sd = load_file(str(path))
    _rewrite(path, tensors={k: v for k, v in sd.items() if k not in sorted(sd)[:n]})


def _widen(path: Path, suffix: str) -> None:
    sd = load_file(str(path))
    k = sorted(k for k in sd if k.endswith(suffix))[0]
    sd[k] = torch.zeros(sd[k].shape[0] * 2, *sd[k].shape[1:])
    _rewrite(path, tensors=sd)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    _rewrite(path, data=data[: len(data) // 2])


UNET = "unet/diffusion_pytorch_model.safetensors"
# (what is wrong, how to make it, the file the message names, whether `plan` sees it: plan reads configs
# and weight-file headers only, so a VAE's or text encoder's wrong tensors show at training).
SDXL_FAULTS = {
    "only pickle weights": (lambda d: _pickle_only(d, "unet", "diffusion_pytorch_model",
                                                   "diffusion_pytorch_model.safetensors"), "unet", True),
    "garbage model_index.json": (lambda d: _rewrite(d / "model_index.json", b"{garbage"), "model_index.json", True),
    "a UNet config that is not JSON": (lambda d: _rewrite(d / "unet/config.json", b"\xff\xfe"), "unet/config.json",
                                       True),
    "truncated UNet weights": (lambda d: _truncate(d / UNET), UNET, True),
    "UNet weights with tensors missing": (lambda d: _drop_keys(d / UNET), UNET, True),
    "UNet weights of another shape": (lambda d: _widen(d / UNET, "conv_in.weight"), UNET, True),
    "VAE weights with tensors missing": (lambda d: _drop_keys(d / "vae/diffusion_pytorch_model.safetensors"),
                                         "vae", False),
    "text encoder weights of another shape": (lambda d: _widen(d / "text_encoder/model.safetensors", "weight"),
                                              "text_encoder", False),
}


def _one_paragraph(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fault", list(SDXL_FAULTS))
def test_a_bad_sdxl_model_folder_is_refused_naming_the_file(fault, tiny_dir, tmp_path, capsys):
    make, named, plan_sees_it = SDXL_FAULTS[fault]
    d = _variant(tiny_dir, tmp_path / "model")
    marker = make(d)
    if plan_sees_it:
        assert main(["plan", "--model", str(d)]) == 2
        assert str(d / named) in _one_paragraph(capsys.readouterr().err)
    assert main(["train", "--model", str(d), "--out", str(tmp_path / "runs"), "--steps", "1",
                 "--set", "preview.prompts=''", "--set", f"data.cache_dir='{tmp_path / 'cache'}'"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert str(d / named) in msg
    assert ("safetensors" in msg) if "pickle" in fault else ("copy it again" in msg), msg
    if marker is not None:
        assert not marker.exists()  # the pickle was never loaded
    assert not list((tmp_path / "runs").glob("*/checkpoints"))


LLM_FAULTS = {
    "only pickle weights": lambda d: _pickle_only(d, ".", "pytorch_model", "model.safetensors"),
    "a config.json that is not JSON": lambda d: _rewrite(d / "config.json", b"{"),
    "truncated weights": lambda d: _truncate(d / "model.safetensors"),
    "weights with tensors missing": lambda d: _drop_keys(d / "model.safetensors"),
    "weights of another shape": lambda d: _widen(d / "model.safetensors", "q_proj.weight"),
}


@pytest.fixture(scope="module")
def tiny_llm_dir():
    from sdxl_lora.core.config import ModelConfig
    from sdxl_lora.llm.tiny import materialize_tiny_llm

    return materialize_tiny_llm(ModelConfig().cache_dir)


@pytest.mark.parametrize("fault", list(LLM_FAULTS))
def test_a_bad_llm_model_folder_is_refused_naming_it(fault, tiny_llm_dir, tmp_path, capsys):
    d = _variant(tiny_llm_dir, tmp_path / "model")
    marker = LLM_FAULTS[fault](d)
    assert main(["llm", "train", "--model", str(d), "--out", str(tmp_path / "runs"), "--steps", "1"]) == 2
    msg = _one_paragraph(capsys.readouterr().err)
    assert str(d) in msg and ("safetensors" in msg if "pickle" in fault else "copy it again" in msg), msg
    if marker is not None:
        assert not marker.exists()


# ---- training states: one that does not read back is skipped like a torn one


def test_a_state_whose_trainer_file_is_a_foreign_pickle_with_a_matching_checksum_is_skipped(tmp_path, caplog):
    from sdxl_lora.core import checkpoint

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        checkpoint.save_state(root, step, {"w": torch.ones(3)}, {"state": {}, "param_groups": []},
                              {"step": step, "epoch": 0, "position": step, "schedule": {}, "rng": {}}, keep=3)
    newest, marker = root / "step-00000002", tmp_path / "pickle-ran"
    (newest / "trainer.pt").write_bytes(pickle.dumps(_Boom(marker)))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = checkpoint.file_sha256(newest / "trainer.pt")  # the checksum matches
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING"):
        assert checkpoint.newest_valid(root).name == "step-00000001"
    assert not marker.exists()
    assert any("skipping checkpoint step-00000002" in r.getMessage() and "trainer.pt" in r.getMessage()
               for r in caplog.records)


# ---- a read-only folder: exit 1 naming it, nothing written there


@pytest.fixture
def read_only(monkeypatch):
    """make(folder): from now on the OS refuses every write under `folder` (EROFS), as on a read-only
    mount. Simulated at Python's calls into the OS: tests run as root in CI, where chmod stops nothing."""
    import builtins
    import errno
    import io

    def make(folder: Path) -> None:
        folder = folder.resolve()
        real = {"open": io.open, "os_open": os.open, "mkdir": os.mkdir, "replace": os.replace,
                "rename": os.rename, "link": os.link}

        def check(path) -> None:
            if isinstance(path, (str, os.PathLike)) and Path(os.path.abspath(path)).is_relative_to(folder):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        def open_(file, mode="r", *a, **k):
            if any(c in mode for c in "wax+"):
                check(file)
            return real["open"](file, mode, *a, **k)

        def os_open(path, flags, *a, **k):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                check(path)
            return real["os_open"](path, flags, *a, **k)

        def two(name):
            def call(src, dst, *a, **k):
                check(dst)
                return real[name](src, dst, *a, **k)
            return call

        def mkdir(path, *a, **k):
            check(path)
            return real["mkdir"](path, *a, **k)

        for target, name, fn in ((builtins, "open", open_), (io, "open", open_), (os, "open", os_open),
                                 (os, "mkdir", mkdir), (os, "replace", two("replace")),
                                 (os, "rename", two("rename")), (os, "link", two("link"))):
            monkeypatch.setattr(target, name, fn)
    return make


def _two_images(tmp_path: Path) -> Path:
    """Two of the sample images and their captions: enough to train a step, quick to cache."""
    from sdxl_lora.core.config import SAMPLE_DATA

    out = tmp_path / "images"
    out.mkdir()
    for name in ("00_red_star", "01_green_star"):
        for ext in (".png", ".txt"):
            shutil.copy(SAMPLE_DATA / "images" / f"{name}{ext}", out)
    return out


def _tree(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_read_only_runs_folder_or_run_folder_is_exit_1_naming_it_and_nothing_is_written(tmp_path, read_only,
                                                                                           capsys):
    common = ["--steps", "2", "--data", str(_two_images(tmp_path)), "--set", "preview.prompts=''",
              "--set", "train.save_every=1", "--set", f"data.cache_dir='{tmp_path / 'cache'}'"]
    assert main(["train", "--out", str(tmp_path / "runs"), "--name", "r", *common]) == 0
    ro = tmp_path / "read-only"
    ro.mkdir()
    before = {"ro": _tree(ro), "run": _tree(tmp_path / "runs")}
    capsys.readouterr()
    read_only(ro)
    read_only(tmp_path / "runs")
    assert main(["train", "--out", str(ro), "--name", "new", *common]) == 1
    msg = _one_paragraph(capsys.readouterr().err)
    assert str(ro / "new") in msg and "Read-only file system" in msg, msg
    assert main(["train", "--resume", str(tmp_path / "runs" / "r"), "--steps", "3"]) == 1
    msg = _one_paragraph(capsys.readouterr().err)
    assert str(tmp_path / "runs" / "r") in msg and "Read-only file system" in msg, msg
    assert {"ro": _tree(ro), "run": _tree(tmp_path / "runs")} == before


# ---- SIGTERM at each phase: before the first step a clean stop; after it a saved state and a resume command


def _train_signalled(cli, at: str, *args: str):
    """`sdxl-lora train ARGS` sent SIGTERM at `at` (core/checkpoint.py: test_fault). In this process: the
    signal goes to it as to a training process of its own, and the trainer's handlers take it at every
    point tested here (training.py: _stop_at_once until the loop starts, then the loop's)."""
    return cli("train", *args, kill=f"{at}@SIGTERM")


def _stray_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.startswith(".") and ".tmp" in p.name]


def test_sigterm_before_the_first_step_stops_at_once_with_nothing_half_written(tmp_path, cli):
    # While caching (after the first latent is written) and during the step-0 previews.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red star\n")
    common = ["--out", str(tmp_path / "runs"), "--steps", "2", "--data", str(_two_images(tmp_path)),
              "--set", f"data.cache_dir='{tmp_path / 'cache'}'", "--set", f"preview.prompts='{prompts}'",
              "--set", "preview.steps=2"]
    for at, name in (("cache:1", "caching"), ("preview:0", "previews")):
        p = _train_signalled(cli, at, "--name", name, *common)
        assert p.returncode == 130, p.stderr[-2000:]
        msg = _one_paragraph(p.stderr)
        assert "stopped by SIGTERM before the first training step" in msg and "--overwrite" in msg, msg
        run = tmp_path / "runs" / name
        assert not (run / "checkpoints").exists() and not list(run.glob("*.safetensors"))
        assert not list((run / "samples").iterdir())
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) >= 1  # what was cached is kept, whole
    assert not _stray_files(tmp_path)


def _signal_during(monkeypatch, owner, name: str, when) -> list[float]:
    """Patch owner.name so that a call for which when(*args) holds sends this process SIGTERM from another
    thread while the real call runs, as `kill` from a shell would; the times it was sent, in a list."""
    real, sent, once = getattr(owner, name), [], threading.Lock()  # calls may come from several threads

    def call(*args, **kwargs):
        with once:
            fire = not sent and when(*args)
            if fire:
                sent.append(time.monotonic())
        if not fire:
            return real(*args, **kwargs)
        sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
        sender.start()
        try:
            return real(*args, **kwargs)
        finally:
            sender.join()  # sent before this call returns: the handler runs in it or right after
    monkeypatch.setattr(owner, name, call)
    return sent


def test_a_huge_caption_is_named_in_the_run_report_and_sigterm_while_caching_it_stops_within_seconds(
        tmp_path, cli, monkeypatch):
    # A 50 MB caption beside normal images used to be tokenized whole while "caching text" (minutes, gigabytes),
    # and SIGTERM waited for it. Now its first 64 KiB are read, the run's dataset report names it, and SIGTERM
    # in that phase stops the run within seconds with the documented message.
    from sdxl_lora.sdxl.data import CAPTION_BYTES
    from sdxl_lora.sdxl.task import SDXLTask

    images = _two_images(tmp_path)
    huge = images / "00_red_star.txt"
    with open(huge, "wb") as f:
        f.write(b"a red star, " * (50 * 2**20 // 12))
    encoded = []  # the size of each caption given to the text encoders

    def long(self, caption: str) -> bool:
        encoded.append(len(caption.encode()))
        return len(caption) > 1000
    sent = _signal_during(monkeypatch, SDXLTask, "encode_text", long)
    p = cli("train", "--out", str(tmp_path / "runs"), "--name", "r", "--steps", "2", "--data", str(images),
            "--set", f"data.cache_dir='{tmp_path / 'cache'}'", "--set", "preview.prompts=''")
    assert sent and time.monotonic() - sent[0] < 5, "SIGTERM waited for the caption's encoding"
    assert p.returncode == 130, p.stderr[-2000:]
    msg = _one_paragraph(p.stderr)
    assert "stopped by SIGTERM before the first training step" in msg, msg
    assert max(encoded) <= CAPTION_BYTES + 100  # a prefix, plus what the caption settings add
    log = (tmp_path / "runs" / "r" / "train.log").read_text()
    assert f"over 64 KiB and train with their first 64 KiB only (the text encoders read 77 tokens): {huge}" in log


def test_sigterm_while_the_images_are_checked_stops_within_seconds_without_checking_the_rest(tmp_path, cli,
                                                                                             monkeypatch):
    # A folder of many large images takes a while to check (each is decoded); a stop among them ends the run
    # at once, the images not checked yet left alone.
    import numpy as np
    from PIL import Image

    from sdxl_lora.sdxl import data

    images = tmp_path / "images"
    images.mkdir()
    noise = np.random.default_rng(0).integers(0, 255, (1024, 1024, 3), dtype=np.uint8)
    Image.fromarray(noise).save(images / "0000.png", compress_level=0)
    for i in range(1, 1000):
        os.link(images / "0000.png", images / f"{i:04d}.png")
    checked = []
    monkeypatch.setattr(data, "probe_image", lambda path, limit, real=data.probe_image: (
        checked.append(path), real(path, limit))[1])
    sent = _signal_during(monkeypatch, data, "probe_image", lambda path, limit: len(checked) >= 20)
    p = cli("train", "--out", str(tmp_path / "runs"), "--name", "r", "--steps", "2", "--data", str(images),
            "--set", f"data.cache_dir='{tmp_path / 'cache'}'", "--set", "preview.prompts=''")
    assert sent and time.monotonic() - sent[0] < 5
    assert p.returncode == 130, p.stderr[-2000:]
    assert "stopped by SIGTERM before the first training step" in _one_paragraph(p.stderr)
    assert len(checked) < 500, len(checked)


def test_sigterm_at_the_export_and_in_the_final_previews_each_saves_a_state_that_resumes(tmp_path, cli):
    # (A signal in training, and the resume from it: test_durability's Ctrl-C test; SIGTERM has the same handler.)
    from sdxl_lora.core import checkpoint
    from sdxl_lora.core.runs import read_events

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red star\n")
    run = tmp_path / "runs" / "r"
    # At the export: the export is atomic and short, so it is finished; the previews after it are not made.
    p = _train_signalled(cli, "export:3", "--out", str(tmp_path / "runs"), "--name", "r", "--steps", "3",
                         "--data", str(_two_images(tmp_path)), "--set", f"data.cache_dir='{tmp_path / 'cache'}'",
                         "--set", f"preview.prompts='{prompts}'", "--set", "preview.steps=2",
                         "--set", "train.save_every=0")
    assert p.returncode == 130, p.stderr[-2000:]
    assert "resume with: sdxl-lora train --resume" in p.stdout and "the final previews are not" in p.stdout
    assert (run / "r.safetensors").is_file() and not list((run / "samples").glob("step-000003*"))
    assert checkpoint.newest_valid(run / "checkpoints").name == "step-00000003"
    # In the final previews: one signal stops the run at once (it used to wait for a second).
    p = _train_signalled(cli, "preview:3", "--resume", str(run))
    assert p.returncode == 130, p.stderr[-2000:]
    assert "resume with: sdxl-lora train --resume" in p.stdout
    assert not list((run / "samples").glob("step-000003*"))
    # The resume then only finishes: the previews rendered, the run done.
    p = cli("train", "--resume", str(run))
    assert p.returncode == 0, p.stderr[-2000:]
    assert list((run / "samples").glob("step-000003*grid.png"))
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "interrupted"] == [3, 3]
    assert [e["step"] for e in events if e["event"] == "done"] == [3]
    assert not _stray_files(tmp_path)


def test_a_run_that_would_take_more_than_a_week_says_so_once_naming_train_steps(tmp_path, cli):
    runs = tmp_path / "runs"
    p = _train_signalled(cli, "step:3", "--out", str(runs), "--name", "long", "--data", str(_two_images(tmp_path)),
                         "--set", "train.steps=1e9", "--set", f"data.cache_dir='{tmp_path / 'cache'}'",
                         "--set", "preview.prompts=''", "--set", "train.save_every=0")
    assert p.returncode == 130, p.stderr[-2000:]
    warned = [line for line in p.stderr.splitlines() if "train.steps=1000000000" in line]
    assert len(warned) == 1 and "years" in warned[0] and "fewer steps (--steps N" in warned[0], p.stderr[-2000:]
    # Resumed with the steps meant: no word.
    p = cli("train", "--resume", str(runs / "long"), "--steps", "5")
    assert p.returncode == 0 and "train.steps=" not in p.stderr, p.stderr[-2000:]


# ---- the UI: every path the page sends goes through one guard (ui/folders.py: Folders.inside)


def _escapes(tmp_path: Path, root: Path, kind_dir: str) -> list[str]:
    """The ways a page could name `outside` from inside `root`: .., an absolute path, encoded separators,
    backslashes, a symlink inside the folder that leads out."""
    (root / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    return ["../outside", "../../outside/x.png", str(tmp_path / "outside"), "%2e%2e%2foutside", "..%2Foutside",
            "%252e%252e%252foutside", "..\\outside", "..\\..\\outside\\x.png", "~/outside", "link", "link/x.png",
            f"{kind_dir}/../../outside" if kind_dir != "." else "./../outside"]


def test_every_path_the_ui_page_sends_is_confined_to_the_ui_folders(tmp_path):
    from PIL import Image

    from sdxl_lora.ui import dataset_edit, tab_compare, tab_dataset, tab_export, tab_generate
    from sdxl_lora.ui.folders import Folders, PathRefused
    from sdxl_lora.ui.jobs import Jobs
    from sdxl_lora.ui.tab_train import Form

    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (64, 64)).save(outside / "x.png")
    (outside / "model_index.json").write_text("{}")
    (outside / "a.safetensors").write_bytes(b"")
    for d in ("datasets/set", "models", "runs/r"):
        (tmp_path / d).mkdir(parents=True)
    Image.new("RGB", (64, 64)).save(tmp_path / "datasets/set/ok.png")
    layer = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"  # one layer of SDXL's, as kohya names it
    save_file({f"{layer}.lora_down.weight": torch.zeros(4, 640), f"{layer}.lora_up.weight": torch.zeros(640, 4),
               f"{layer}.alpha": torch.tensor(4.0)}, str(tmp_path / "runs/r/r.safetensors"))
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    jobs = Jobs(f)
    probes = {kind: _escapes(tmp_path, getattr(f, kind), d) for kind, d in
              (("datasets", "set"), ("models", "."), ("runs", "r"))}
    before = _tree(outside)
    refused = 0

    def refuses(call, *args, why=("outside", "encoded")) -> None:
        # Refused by the guard: PathRefused, or the handler's error message carrying its words.
        nonlocal refused
        try:
            out = call(*args)
        except PathRefused:
            refused += 1
            return
        said = " ".join(str(o) for o in (out if isinstance(out, tuple) else (out,)))
        assert "Error" in said and any(w in said for w in why), (call, args, said)
        refused += 1

    sdxl, llm = Form(f), Form(f, task="llm")
    ok_image = [[str(tmp_path / "datasets/set/ok.png"), ""]]
    guarded = tab_dataset._guarded  # what the Dataset tab's buttons call: the error as the page shows it
    prefix = dataset_edit.BulkEdit("add prefix", "sks")

    def edited(items, caption="caption"):  # the table the page sends back, a caption typed in each row
        return [[True, "", dataset_edit.file_name(f, path), caption] for path, _ in items]

    for p in probes["datasets"]:
        refuses(tab_dataset._scan, f, p, ".txt", 64, lambda *a, **k: None)             # dataset folder picker
        refuses(guarded, dataset_edit.save_table, f, [[p, ""]], edited([[p, ""]]), ".txt")  # the table's captions
        for scope in dataset_edit.SCOPES:                                              # bulk edit over the images
            refuses(guarded, dataset_edit.bulk_apply, f, [[p, ""]], edited([[p, ""]], ""), prefix, scope, ".txt")
        refuses(guarded, dataset_edit.upload, f, p, [("ok.png", ok_image[0][0])], ".txt", True)  # upload folder
        refuses(guarded, dataset_edit.caption, f, p, "m", ".txt", True, "", None)      # captioning: the folder
        refuses(sdxl.config, ["tiny-sdxl-demo", [p], "", ""], "n", None)                # the Train form's data
        refuses(sdxl.config, ["tiny-sdxl-demo", ["set"], "", "", [[p, "3", "", False, "", ""]]], "n", None)  # its table
        refuses(llm.config, ["tiny-llm", [p], "", ""], "n", None)                       # the LLM form's data
    for ext in ("/../../outside", ".txt/../../../outside/x", "\\..\\..\\x", ".%2e%2f", ".txt\\..\\.."):
        refuses(guarded, dataset_edit.save_table, f, ok_image, edited(ok_image), ext,  # caption save: extension
                why=("outside", "encoded", "caption extension"))
        refuses(guarded, dataset_edit.bulk_apply, f, ok_image, edited(ok_image, ""), prefix, dataset_edit.SCOPES[0],
                ext, why=("outside", "encoded", "caption extension"))
        refuses(guarded, dataset_edit.upload, f, "set", [("ok.png", ok_image[0][0])], ext, True,
                why=("outside", "encoded", "caption extension"))
    # Upload names with path parts: refused by name, nothing written anywhere but the folder.
    names = ["../../outside/y.png", "..\\..\\outside\\y.png", str(outside / "y.png"), "link/y.png", ".y.png"]
    said = dataset_edit.upload(f, "set", [(n, ok_image[0][0]) for n in names], ".txt", True)
    assert said.startswith("uploaded 0 file(s)") and said.count("a file name only") == len(names)
    for p in probes["models"]:
        refuses(sdxl.config, [p, ["set"], "", ""], "n", None)                            # model picker
        refuses(sdxl.config, ["tiny-sdxl-demo", ["set"], p, ""], "n", None)             # tokenizer folder
        refuses(llm.config, [p, ["set"], "", ""], "n", None)
        refuses(tab_generate.Pipelines(f).get, p)                                      # Generate's model
        refuses(guarded, dataset_edit.caption, f, "set", p, ".txt", True, "", None)    # captioner model picker
        refuses(tab_generate.adapter_path, f, f"models/{p}")                           # adapter pickers
        refuses(tab_export.export, f, f"models/{p}", "kohya", "", "", "", "", "", True, "sgm", False, False)
    for p in probes["runs"]:
        refuses(tab_generate.adapter_path, f, f"runs/{p}")
        refuses(tab_export.export, f, f"runs/{p}", "kohya", "", "", "", "", "", True, "sgm", False, False)
        refuses(jobs.stop, p)                                                          # run folder pickers
        refuses(jobs.enqueue_resume, p)
        refuses(jobs.log_tail, p)
        refuses(jobs.unique_name, p)                                                   # the run name field
        refuses(tab_compare.pick_run, f, p)                                            # Compare's run picker
        refuses(tab_compare.export, f, p, "step 2", 1.0, "kohya", "", False)
    for title in ("../../outside/t", "/tmp/t", "..\\..\\t", "%2e%2e%2ft"):             # export's file name
        refuses(tab_export.export, f, "runs/r", "kohya", title, "", "", "", "", True, "sgm", False, False,
                why=("names the file", "encoded"))
    assert refused > 150
    assert _tree(outside) == before and sorted(p.name for p in outside.iterdir()) == \
        ["a.safetensors", "model_index.json", "x.png"]
    # A symlinked image inside a scanned folder that leads out: not shown, not editable, and said so.
    (tmp_path / "datasets/set/linked.png").symlink_to(outside / "x.png")
    items, gallery, status, *_ = tab_dataset._scan(f, "set", ".txt", 64, lambda *a, **k: None)
    assert [Path(i[0]).name for i in items] == ["ok.png"] and len(gallery) == 1
    assert "1 image(s) are symlinks to files outside the datasets folder" in status
    linked = [[str(tmp_path / "datasets/set/linked.png"), ""]]
    refuses(guarded, dataset_edit.save_table, f, linked, edited(linked), ".txt")
    # What is inside still works: the guard refuses escapes, not paths.
    assert f.inside("set/ok.png", "datasets") == tmp_path / "datasets/set/ok.png"
    assert f.inside("set\\ok.png", "datasets") == tmp_path / "datasets/set/ok.png"
    assert f.run("r") == tmp_path / "runs/r"
    written, msg = tab_export.export(f, "runs/r", "kohya", "mine", "", "", "", "", True, "sgm", False, False)
    assert written == str(tmp_path / "runs/r/exports/mine.safetensors"), msg
