"""The main job end to end: `sdxl-lora train` on the demo base (tiny-sdxl-demo) and sample_data/."""
import json
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_lora.cli import main
from sdxl_lora.core.runs import read_events

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default job, exactly as the Quickstart runs it, but into a temporary runs folder."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", "--out", str(out), "--name", "default"]) == 0
    return out / "default"


def test_default_run_writes_config_events_adapter_and_previews(default_run):
    assert (default_run / "config.toml").is_file()
    events = read_events(default_run / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "done" and "adapter" in kinds
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["step"] == steps[-1]["total_steps"]
    for e in steps:
        assert {"loss", "lr", "images_per_s", "eta_s"} <= e.keys()
    assert (default_run / "default.safetensors").is_file()
    samples = sorted(p.name for p in (default_run / "samples").iterdir())
    assert "step-000000-grid.png" in samples  # before training
    assert any(n.startswith("step-") and n.endswith("-grid.png") and n != "step-000000-grid.png" for n in samples)


def _written(band) -> bool:
    """Dark writing on a white band (greyscale)."""
    low, high = band.getextrema()
    return low < 100 and high == 255


def test_the_default_jobs_preview_grid_names_the_prompts_above_their_images(default_run):
    from PIL import Image

    samples = default_run / "samples"
    tiles = sorted(samples.glob("step-000000-[0-9][0-9].png"))
    w, h = Image.open(tiles[0]).size
    grid = Image.open(samples / "step-000000-grid.png").convert("L")
    rows = len({line.split(" --")[0] for line in (REPO / "sample_data" / "prompts.txt").read_text().splitlines()
                if line.strip()})
    assert grid.width == 2 * w and grid.height > rows * h  # a label band above each row of images
    band = grid.crop((0, 0, grid.width, (grid.height - rows * h) // rows))
    assert _written(band)


def test_a_grid_writes_each_rows_prompt_once_and_each_images_own_where_they_differ():
    from PIL import Image

    from sdxl_lora.sdxl.preview import grid

    tile = Image.new("RGB", (96, 96), (128, 128, 128))
    plain = grid([tile] * 4, cols=2)
    assert plain.size == (192, 192)
    labelled = grid([tile] * 4, cols=2, labels=["a red star"] * 2 + ["a green triangle"] * 2)
    band = (labelled.height - 192) // 2
    assert labelled.width == 192 and band > 0
    first, second = (labelled.crop((0, y, 192, y + band)).convert("L") for y in (0, band + 96))
    assert _written(first) and _written(second)
    assert first.tobytes() != second.tobytes()  # each row its own prompt
    # One prompt a row: written once across the row, not again over the second image.
    assert first.crop((96, 0, 192, band)).getextrema() == (255, 255)
    mixed = grid([tile] * 2, cols=2, labels=["a cat", "a dog"])
    left, right = (mixed.crop((x, 0, x + 96, mixed.height - 96)).convert("L") for x in (0, 96))
    assert _written(left) and _written(right)  # each image under its own prompt


def test_training_loss_falls_clearly(default_run):
    steps = [e for e in read_events(default_run / "events.jsonl") if e["event"] == "step"]
    losses = [e["loss"] for e in steps]
    first = sum(losses[:3]) / 3
    last = sum(losses[-3:]) / 3
    assert last < first, f"loss went {first:.4f} -> {last:.4f}"
    evals = [e["loss"] for e in read_events(default_run / "events.jsonl") if e["event"] == "eval"]
    assert len(evals) == 2
    # Fixed timesteps and noise: a deterministic measure. On the demo base, which has never seen a star,
    # the default run takes it from about 0.19 to 0.03.
    assert evals[1] < 0.8 * evals[0], f"eval loss went {evals[0]:.4f} -> {evals[1]:.4f}"


def test_default_run_teaches_the_star_and_keeps_the_other_prompts(default_run):
    # The shapes detector on the previews (2 seeds each): P(star) on the trigger prompts, and the plain
    # prompts' own shape. The base draws no star (P ~0.00); after the default job the star is drawn
    # (docs/demo_base.md has the figures of this machine) and the plain prompts keep their shapes.
    # Issue 34's goals for the first run: every trigger prompt at 0.6 or more, the plain prompts at 0.9 of the
    # base's own-shape score or more and their images moved less than 0.05 (mean pixel change).
    concept = [e for e in read_events(default_run / "events.jsonl") if e["event"] == "concept"]
    before, after = concept[0], concept[-1]
    assert before["step"] == 0 and after["step"] > 0
    assert before["score"] < 0.05
    assert after["score"] > 0.5 and min(after["prompts"].values()) >= 0.6, after["prompts"]
    assert after["others_score"] >= 0.9 * before["others_score"], after["others"]
    assert after["others_change"] < 0.05, after["others"]


def test_without_the_prior_shapes_the_other_prompts_lose_their_shapes(default_run, tmp_path):
    # The default job mixes 48 prior shapes (circles, triangles...) in with its 16 stars: prior preservation.
    # Trained on the stars alone the plain prompts drift, already in 80 of the job's 1,000 steps, where the
    # default job above keeps at least 0.9 of them.
    import shutil

    stars = tmp_path / "stars"
    stars.mkdir()
    for f in (REPO / "sample_data" / "images").iterdir():
        if not f.name.startswith("prior"):
            shutil.copy(f, stars / f.name)
    # The default job's cache: its step-0 previews are this run's too (the same base, prompts and seeds), reused.
    assert main(["train", "--data", str(stars), "--out", str(tmp_path / "runs"), "--name", "stars",
                 "--steps", "80", "--set", f"data.cache_dir='{default_run.parent / '.cache'}'"]) == 0
    concept = [e for e in read_events(tmp_path / "runs" / "stars" / "events.jsonl") if e["event"] == "concept"]
    with_prior = [e for e in read_events(default_run / "events.jsonl") if e["event"] == "concept"]
    assert len(list(stars.glob("*.png"))) == 16
    before, after = concept[0], concept[-1]
    assert after["others_score"] < 0.75 * before["others_score"], after["others"]
    assert with_prior[-1]["others_score"] >= 0.9 * with_prior[0]["others_score"]


def test_adapter_loads_in_diffusers_in_another_process_and_changes_the_image(default_run, tmp_path):
    from sdxl_lora.sdxl.demo.pretrain import SHIPPED  # the demo base the default job trains on

    script = textwrap.dedent(f"""
        import json, torch
        from diffusers import StableDiffusionXLPipeline
        pipe = StableDiffusionXLPipeline.from_pretrained({str(SHIPPED)!r}, local_files_only=True,
                                                         torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        def img():
            g = torch.Generator().manual_seed(7)
            return pipe("sks, a red star on a white background", num_inference_steps=4, generator=g,
                        output_type="pt").images
        base = img()
        pipe.load_lora_weights({str(default_run / "default.safetensors")!r})
        lora = img()
        n_lora = sum(1 for n, _ in pipe.unet.named_parameters() if "lora_A" in n)
        pipe.unload_lora_weights()
        pipe.load_lora_weights({str(default_run / "default.diffusers.safetensors")!r})
        formats = (lora - img()).abs().max().item()
        print(json.dumps({{"diff": (base - lora).abs().mean().item(), "n_lora": n_lora, "formats": formats}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # The main file is the kohya one (sgm names, per-layer alpha): diffusers loads every layer of it.
    sd = load_file(default_run / "default.safetensors")
    assert all(k.startswith("lora_unet_") for k in sd)
    assert res["n_lora"] == sum(1 for k in sd if k.endswith(".lora_down.weight")) > 0
    assert res["diff"] > 1e-3
    # The kohya file and the diffusers file beside it give the same image (to float rounding: the kohya
    # file holds alpha folded into the weights).
    assert res["formats"] < 1e-4


def _short_run(out, name, cache_args, seed=1):
    args = ["train", "--out", str(out), "--name", name, "--steps", "4", "--seed", str(seed), "--batch-size", "2",
            "--set", "preview.prompts=''", "--set", "train.log_every=2", *cache_args]
    assert main(args) == 0
    return load_file(out / name / f"{name}.safetensors")


def test_same_seed_gives_the_same_adapter(tmp_path, monkeypatch, cache_args):
    a = _short_run(tmp_path, "a", cache_args)
    b = _short_run(tmp_path, "b", cache_args)
    c = _short_run(tmp_path, "c", cache_args, seed=2)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # Each batch trained in micro-batches of one image (what a run does when CUDA graphs only fit at a
    # smaller batch): the same draws per image and the batch's gradient, so the same adapter up to rounding.
    from sdxl_lora.sdxl.task import SDXLTask

    monkeypatch.setattr(SDXLTask, "micro_batches", 2)
    sizes, alive, marks, loss = [], [], [], SDXLTask.loss

    class Mark:
        pass

    class Marked(torch.autograd.Function):  # a node of the loss's graph that lives as long as the graph
        @staticmethod
        def forward(ctx, x):
            ctx.mark = Mark()
            marks.append(weakref.ref(ctx.mark))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    def marked_loss(self, model, batch):
        # A CUDA graph captured at this forward fails while an earlier part's autograd graph is alive.
        alive.append(sum(m() is not None for m in marks))
        sizes.append(self.batch_size(batch))
        return Marked.apply(loss(self, model, batch))

    monkeypatch.setattr(SDXLTask, "loss", marked_loss)
    d = _short_run(tmp_path, "d", cache_args)
    assert sizes == [1] * 8  # 4 steps of 2 images
    assert alive == [0] * 8
    assert all(torch.allclose(a[k], d[k], rtol=1e-3, atol=3e-4) for k in a)
    assert any(not torch.allclose(a[k], c[k], rtol=1e-3, atol=3e-4) for k in a)


def test_existing_run_is_not_overwritten_unless_asked(tmp_path, capsys, cache_args):
    _short_run(tmp_path, "r", cache_args)
    before = (tmp_path / "r" / "r.safetensors").read_bytes()
    rc = main(["train", "--out", str(tmp_path), "--name", "r", "--steps", "2", "--set", "preview.prompts=''"])
    assert rc == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "r" / "r.safetensors").read_bytes() == before
    assert main(["train", "--out", str(tmp_path), "--name", "r", "--steps", "2", "--overwrite",
                 "--set", "preview.prompts=''", *cache_args]) == 0


def test_bad_flag_value_names_the_field(tmp_path, capsys):
    rc = main(["train", "--out", str(tmp_path), "--device", "tpu"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.device" in err and "'tpu'" in err
    assert not any(tmp_path.iterdir())


def test_tag_shuffling_trains_with_live_text_encoding(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    from PIL import Image
    for i, colour in enumerate(["red", "blue", "green", "white"]):
        Image.new("RGB", (128, 128), colour).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"sks, {colour}, plain, square image", encoding="utf-8")
    args = ["train", "--data", str(data), "--out", str(tmp_path / "runs"), "--name", "s", "--steps", "4",
            "--set", "preview.prompts=''", "--set", "data.shuffle_tags=true", "--set", "data.keep_tokens=1"]
    assert main(args) == 0
    assert (tmp_path / "runs" / "s" / "s.safetensors").is_file()


def test_random_crop_trains_with_live_latents(tmp_path):
    args = ["train", "--out", str(tmp_path), "--name", "rc", "--steps", "3", "--resolution", "96",
            "--set", "preview.prompts=''", "--set", "data.crop='random'", "--set", "data.flip=true",
            "--set", "data.bucket_step=32"]
    assert main(args) == 0
    assert (tmp_path / "rc" / "rc.safetensors").is_file()


def test_previews_every_n_steps_and_validation_loss_on_held_out_images(tmp_path, cache_args):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks, a red star on a white background\n")
    args = ["train", "--out", str(tmp_path), "--name", "v", *cache_args, "--steps", "6", "--set", "preview.every=3",
            "--set", "preview.steps=2", "--set", "data.validation_split=0.25", "--set", "train.save_every=3",
            "--set", f"preview.prompts='{prompts}'"]
    assert main(args) == 0
    run = tmp_path / "v"
    names = {p.name for p in (run / "samples").iterdir()}
    for step in (0, 3, 6):
        assert f"step-{step:06d}-grid.png" in names
    events = read_events(run / "events.jsonl")
    # Each set says where its time went: rendering, around it (the VAE's moves, the adapter's merge), writing.
    timed = [e for e in events if e["event"] == "previews_rendered"]
    assert [e["step"] for e in timed] == [0, 3, 6] and all(e["images"] == 1 for e in timed)
    for e in timed:
        assert e["render_s"] > 0 and e["around_s"] >= 0 and e["write_s"] >= 0
        assert e["render_s"] + e["around_s"] + e["write_s"] == pytest.approx(e["seconds"], abs=0.03)
    val = [e for e in events if e["event"] == "validation"]
    assert [e["step"] for e in val] == [0, 3, 6]
    assert all(e["loss"] > 0 for e in val)
    # 16 of the 64 sample images are held out: training batches never see them.
    ds = next(e for e in events if e["event"] == "dataset")
    assert ds["images"] == 64 and ds["train_images"] == 48 and len(ds["held_out"]) == 16
    assert ds["samples"] == 48
    assert next(e for e in events if e["event"] == "cache")["latents_total"] == 64
    # Same validation images and noise: a second identical run gives the same figures (previews left out:
    # they draw on no training randomness).
    assert main([*args[:4], "v2", *args[5:-2], "--set", "preview.prompts=''"]) == 0
    val2 = [e for e in read_events(tmp_path / "v2" / "events.jsonl") if e["event"] == "validation"]
    assert [e["loss"] for e in val2] == [e["loss"] for e in val]
