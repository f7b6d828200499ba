"""One rendering path: a run's previews, the UI's Generate and Compare tabs and `sdxl-lora generate` draw the same
pixels for the same adapter, prompt, seed, steps, guidance and size (sdxl/preview.py: render with its Sampler, the
adapter merged into the weights). Compare takes a prompt without --n as no negative prompt, as the others do."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdxl_lora.core.config import load_config

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data" / "images"
PROMPT = "a red circle on a white background"

pytestmark = pytest.mark.usefixtures("one_thread")


def _pixels(image) -> np.ndarray:
    image = Image.open(image) if isinstance(image, (str, Path)) else image
    return np.asarray(image.convert("RGB"))


def test_previews_generate_compare_and_the_cli_draw_the_same_pixels(tmp_path, as_process):
    from sdxl_lora.cli import main
    from sdxl_lora.training import fit, new_job
    from sdxl_lora.ui import tab_compare, tab_generate
    from sdxl_lora.ui.folders import Folders

    runs = tmp_path / "runs"
    prompts = runs / ".ui" / "prompts" / "r.txt"  # where the UI keeps a run's prompts: the page may read it
    prompts.parent.mkdir(parents=True)
    prompts.write_text(f"{PROMPT} --d 3\n", encoding="utf-8")
    cfg = load_config(extra={
        "data.dirs": [str(SAMPLES)], "data.resolution": 64, "data.cache_dir": str(tmp_path / "cache"),
        "output.runs_dir": str(runs), "output.name": "r", "preview.prompts": str(prompts), "preview.steps": 4,
        "preview.before": False, "train.device": "cpu", "train.steps": 6, "train.batch_size": 1, "train.lr": 1e-2})
    with as_process():
        fit(new_job(cfg))
    run = runs / "r"
    preview = _pixels(run / "samples" / "step-000006-00.png")
    settings = dict(seed=3, steps=cfg.preview.steps, guidance=cfg.preview.guidance, size=64)

    f = Folders.create(SAMPLES.parent, cfg.model.cache_dir, runs)
    assert "runs/r/r.diffusers.safetensors" not in tab_generate.adapter_choices(f)  # the run's adapter once
    pipes = tab_generate.Pipelines(f)
    quiet = lambda *a, **k: None  # noqa: E731

    def generate(negative: str):
        base, tuned, msg = tab_generate.generate(f, pipes, "tiny-sdxl-demo", PROMPT, negative, settings["seed"],
                                                 settings["steps"], settings["guidance"], settings["size"],
                                                 "runs/r/r.safetensors", 1.0, progress=quiet)
        assert "adapters: r.safetensors x 1" in msg, msg
        return _pixels(base), _pixels(tuned)

    def compare(options: str) -> np.ndarray:
        before = set((run / "compare").glob("*.png"))
        *_, msg = tab_compare.render_grids(f, pipes, "r", f"{PROMPT} --d 3 --s 4 --w 64 --h 64{options}", "1")
        assert "1 rendered" in msg, msg
        cell, = [p for p in set((run / "compare").glob("*.png")) - before if not p.name.startswith("grid-")]
        return _pixels(cell)

    # Compare starts from the run's first preview prompt with its options: the image its previews drew.
    assert tab_compare.pick_run(f, "r")[2]["value"] == f"{PROMPT} --d 3"
    base, generated = generate("")
    assert (base != generated).any()  # the adapter changes the image: the comparison below means something
    assert np.array_equal(generated, preview)
    assert np.array_equal(compare(""), preview)  # no --n: no negative prompt, not an encoded empty one
    out = tmp_path / "out"
    with as_process():
        assert main(["generate", "--model", "tiny-sdxl-demo", "--prompt", PROMPT, "--seed", "3", "--steps", "4",
                     "--guidance", str(settings["guidance"]), "--size", "64", "--out", str(out),
                     "--lora", str(run / "r.diffusers.safetensors")]) == 0
    assert np.array_equal(_pixels(out / "seed3.png"), preview)
    # A negative prompt: Compare's --n and Generate's box give the same image, another than without it.
    _, negated = generate("blurry")
    assert np.array_equal(compare(" --n blurry"), negated) and not np.array_equal(negated, preview)
