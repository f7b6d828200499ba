"""The latent cache across runs: reused when nothing changed, recomputed for exactly the changed images."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from sdxl_lora.cli import main
from sdxl_lora.core.config import SAMPLE_DATA
from sdxl_lora.core.runs import read_events


def _computed(out, name):
    ev = [e for e in read_events(out / name / "events.jsonl") if e["event"] == "cache"]
    return ev[0]["latents_computed"], ev[0]["latents_total"]


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_cache_and_step0_previews_reused_when_unchanged_and_redone_for_what_changed(tmp_path):
    # Latents: reused when nothing changed, recomputed for exactly the edited image. The step-0 previews are
    # the base itself (the adapter starts as no change): a second run on the same base with the same previews
    # shows the first run's images without rendering; another preview seed renders.
    data = tmp_path / "data"
    data.mkdir()
    for f in sorted((SAMPLE_DATA / "images").iterdir())[:16]:  # 8 images and their captions: what eval measures
        shutil.copy(f, data / f.name)
    out = tmp_path / "runs"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks, a red star on a white background --w 64 --h 64 --s 2\na triangle --w 64 --h 64 --s 2\n")
    args = ["train", "--data", str(data), "--out", str(out), "--steps", "1", "--set", f"preview.prompts='{prompts}'",
            "--set", "preview.after=false", "--set", "train.save_every=0", "--set", "preview.concept=''"]
    # Runs a and b in processes whose hash seeds order sets differently (PYTHONHASHSEED 1 and 2 list diffusers'
    # _use_default_values in other orders): no cache key may depend on that.
    def run_in_process_with_hash_seed(name, seed, *extra):
        done = subprocess.run([sys.executable, "-m", "sdxl_lora.cli", *args, *extra, "--name", name],
                              env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]

    run_in_process_with_hash_seed("a", "1")
    n = len(list(data.glob("*.png")))
    assert _computed(out, "a") == (n, n)

    before = _digest(data)
    # When to preview is not what a preview draws: run b previews every 7 steps too and still reuses a's set.
    run_in_process_with_hash_seed("b", "2", "--set", "preview.every=7")
    assert _computed(out, "b") == (0, n)
    assert _digest(data) == before  # training never touches the sources

    # A relaunch whose caches are complete (latents, the captions' and the preview prompts' embeddings, the step-0
    # previews and eval loss) never runs the VAE's encoder or the text encoders: they stay on the host, as their
    # files store them (16 bits for the demo base's), and the previews after training render from the cache's
    # embeddings.
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    def forbidden(*a, **k):
        raise AssertionError("an encoder ran although every cache entry was there")

    with pytest.MonkeyPatch.context() as mp:
        for cls, name in ((AutoencoderKL, "encode"), (CLIPTextModel, "forward"),
                          (CLIPTextModelWithProjection, "forward")):
            mp.setattr(cls, name, forbidden)
        assert main([*args, "--name", "b2", "--set", "preview.after=true"]) == 0
    assert _computed(out, "b2") == (0, n)
    assert (out / "b2" / "samples" / "step-000001-grid.png").is_file()

    edited = sorted(data.glob("*.png"))[3]
    img = Image.open(edited).convert("RGB")
    img.putpixel((0, 0), (1, 2, 3))
    img.save(edited)
    assert main([*args, "--name", "c", "--set", "preview.seed=1"]) == 0
    assert _computed(out, "c") == (1, n)

    step0 = {r: _digest_of(out / r / "samples", "step-000000-0") for r in "abc"}
    reused = {r: [e for e in read_events(out / r / "events.jsonl") if e["event"] == "previews_reused"] for r in "abc"}
    assert not reused["a"] and [e["images"] for e in reused["b"]] == [2] and not reused["c"]
    assert step0["b"] == step0["a"] and len(step0["a"]) == 2  # the same images, byte for byte
    assert step0["c"] != step0["a"]

    # The step-0 eval loss, likewise: the second run reports the first run's figure without measuring it; an
    # edited image among those it is measured on (the first eight) measures it again.
    evals = {r: [e for e in read_events(out / r / "events.jsonl") if e["event"] in ("eval", "eval_reused")
                 and e["step"] == 0] for r in "abc"}
    assert [e["event"] for e in evals["a"]] == ["eval"] and [e["event"] for e in evals["c"]] == ["eval"]
    assert [e["event"] for e in evals["b"]] == ["eval_reused", "eval"]
    assert evals["b"][0]["loss"] == evals["b"][1]["loss"] == evals["a"][0]["loss"]

    # Another resolution is another bucket: everything is encoded again, nothing stale is served.
    assert main([*args, "--name", "d", "--resolution", "192", "--set", "preview.prompts=''"]) == 0
    assert _computed(out, "d")[0] == n


def _digest_of(folder, prefix):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob(f"{prefix}*.png"))}
