"""Datasets as people build them: several [[data.datasets]] tables with their own settings (repeats,
resolution, captions, dropout), regularization images with their own loss weight, balanced as kohya does,
caption tools, and the dataset doctor. Source folders stay byte-identical through every command."""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.sdxl import data as sdxl_data
from sdxl_lora.sdxl.batches import sample_key
from sdxl_lora.sdxl.buckets import BucketBatchSampler
from sdxl_lora.sdxl.captions import live_caption, make_caption
from sdxl_lora.sdxl.dataset import DataError, Item
from sdxl_lora.sdxl.task import SDXLTask

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data" / "images"


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def copy_samples(folder: Path, pattern: str, n: int) -> Path:
    """n sample images matching pattern, with their captions."""
    folder.mkdir(parents=True, exist_ok=True)
    for img in sorted(SAMPLES.glob(pattern))[:n]:
        shutil.copy(img, folder / img.name)
        shutil.copy(img.with_suffix(".txt"), folder / (img.stem + ".txt"))
    return folder


def data_cfg(*tables, **data):
    return load_config(extra={"data.datasets": list(tables), **{f"data.{k}": v for k, v in data.items()}}).data


# ------------------------------------------------------------------------ per-dataset settings

def test_each_dataset_table_gives_its_images_its_own_repeats_resolution_and_captions(tmp_path):
    stars = copy_samples(tmp_path / "stars", "*_star.png", 3)
    shapes = copy_samples(tmp_path / "shapes", "prior*.png", 2)
    cfg = data_cfg({"path": str(stars), "repeats": 4, "trigger_word": "ohwx", "caption_prefix": "photo of"},
                   {"path": str(shapes), "resolution": 64, "caption_dropout": 1.0, "caption_extension": ".txt"},
                   trigger_word="zzz", caption_dropout=0.0)
    ds = sdxl_data.scan(cfg, 128)
    star_items = [it for it in ds.items if it.dataset == stars]
    shape_items = [it for it in ds.items if it.dataset == shapes]
    assert [it.repeats for it in star_items] == [4, 4, 4] and [it.repeats for it in shape_items] == [1, 1]
    assert len(ds) == 14
    # Buckets at each dataset's own resolution (the sample images are square).
    assert {it.bucket for it in star_items} == {(128, 128)} and {it.bucket for it in shape_items} == {(64, 64)}
    rng = random.Random(0)
    star = make_caption(star_items[0], cfg, rng)
    assert star.startswith("ohwx, photo of ") and "zzz" not in star
    # The second table sets no trigger word: data.trigger_word is its default; its dropout is its own.
    assert all(make_caption(it, cfg, rng) == "" for it in shape_items for _ in range(5))
    assert "zzz" in make_caption(shape_items[0], cfg, rng, fixed=True)
    # A batch never mixes resolutions: every batch is one bucket, one shape.
    sampler = BucketBatchSampler(ds, 4, seed=0)
    for batch in sampler:
        assert len({ds.items[ds.expanded()[p]].bucket for p in batch}) == 1
    report = ds.report()
    assert "data.datasets[0] stars" in report and "resolution 64" in report and "trigger 'ohwx'" in report
    assert "buckets at resolution 128" in report and "buckets at resolution 64" in report


def test_the_single_folder_config_scans_as_before(tmp_path):
    folder = copy_samples(tmp_path / "10_stars", "*_star.png", 2)
    ds = sdxl_data.scan(load_config(extra={"data.dirs": [str(folder)], "data.trigger_word": "sks"}).data, 128)
    assert [it.repeats for it in ds.items] == [10, 10] and not any(it.is_reg for it in ds.items)
    assert f"  {folder}: 2 images, repeats 10" in ds.report()


def test_dataset_table_errors_name_the_table_and_field(tmp_path):
    stars = copy_samples(tmp_path / "stars", "*_star.png", 2)
    with pytest.raises(ConfigError, match=r"data\.datasets\[1\]\.repeats = 0: Input should be greater"):
        data_cfg({"path": str(stars)}, {"path": str(stars), "repeats": 0})
    with pytest.raises(ConfigError, match=r"data\.datasets\[0\]\.colour = 'red': unknown field; allowed here: path"):
        data_cfg({"path": str(stars), "colour": "red"})
    with pytest.raises(DataError, match=r"data\.datasets\[1\]\.path: .*nowhere does not exist"):
        sdxl_data.scan(data_cfg({"path": str(stars)}, {"path": str(tmp_path / "nowhere")}), 128)
    other = tmp_path / "other"
    other.mkdir()
    for p in stars.iterdir():
        shutil.copy(p, other / (p.stem + (".caption" if p.suffix == ".txt" else p.suffix)))
    with pytest.raises(DataError, match=r"set data\.datasets\[1\]\.caption_extension='\.caption'"):
        sdxl_data.scan(data_cfg({"path": str(stars)}, {"path": str(other)}), 128)
    # With its own extension the same folder is fine.
    ds = sdxl_data.scan(data_cfg({"path": str(stars)}, {"path": str(other), "caption_extension": ".caption"}), 128)
    assert all(it.has_caption for it in ds.items) and len(ds.items) == 4


def test_dataset_tables_survive_the_runs_config_file(tmp_path):
    # A run's config.toml is read again on resume and by the UI: the tables come back as they were.
    stars = copy_samples(tmp_path / "stars", "*_star.png", 1)
    cfg = load_config(extra={"data.datasets": [{"path": str(stars), "repeats": 3, "tag_dropout": 0.2},
                                               {"path": str(stars), "is_regularization": True}]})
    (tmp_path / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    again = load_config(tmp_path / "config.toml")
    assert again.data.datasets == cfg.data.datasets and again.data.datasets[1].repeats is None


# ------------------------------------------------------------------------ captions

def test_tag_dropout_prefix_suffix_and_keep_separator():
    def item(caption, **settings):
        cfg = load_config(extra={f"data.{k}": v for k, v in settings.items()}).data
        return Item(Path("x.png"), caption, 1, (64, 64), (64, 64), Path("."), bool(caption),
                              settings=cfg), cfg
    tags = "sks, star ||| " + ", ".join(f"t{i}" for i in range(10)) + " ||| best quality"
    it, cfg = item(tags, keep_tokens_separator="|||", tag_dropout=0.5, shuffle_tags=True, caption_dropout=0.0)
    outs = [make_caption(it, cfg, random.Random(s)).split(", ") for s in range(50)]
    for parts in outs:
        assert parts[:2] == ["sks", "star"] and parts[-1] == "best quality"
        assert set(parts[2:-1]) <= {f"t{i}" for i in range(10)}
    kept = [len(p) - 3 for p in outs]
    assert 2 < sum(kept) / len(kept) < 8  # about half of the ten free tags survive
    assert len({tuple(p) for p in outs}) > 10
    # Fixed (the text cache's caption): every tag, in order, the separators gone.
    assert make_caption(it, cfg, random.Random(0), fixed=True) == tags.replace(" |||", ",")
    it, cfg = item("a star", caption_prefix="photo of", caption_suffix="masterpiece", trigger_word="sks",
                   caption_dropout=0.0)
    assert make_caption(it, cfg, random.Random(0)) == "sks, photo of a star masterpiece"


def test_wildcards_pick_one_choice_each_time_and_the_cache_takes_the_first():
    cfg = load_config(extra={"data.wildcards": True, "data.caption_dropout": 0.0}).data
    it = Item(Path("x.png"), "sks, a {red|blue|green} star, {{literal}}", 1, (64, 64), (64, 64),
                        Path("."), True, settings=cfg)
    seen = {make_caption(it, cfg, random.Random(s)) for s in range(40)}
    assert seen == {f"sks, a {c} star, {{literal}}" for c in ("red", "blue", "green")}
    assert make_caption(it, cfg, random.Random(0), fixed=True) == "sks, a red star, {literal}"
    assert live_caption(it, cfg)
    plain = Item(Path("y.png"), "sks, a star", 1, (64, 64), (64, 64), Path("."), True, settings=cfg)
    assert not live_caption(plain, cfg)  # nothing to choose: its embedding is cached
    off = load_config().data
    it.settings = off
    assert make_caption(it, off, random.Random(0), fixed=True) == it.caption


# ------------------------------------------------------------------------ regularization

def test_regularization_images_are_balanced_to_the_training_samples_as_kohya_does(tmp_path):
    stars = copy_samples(tmp_path / "stars", "*_star.png", 2)
    few = copy_samples(tmp_path / "few", "prior*.png", 4)
    ds = sdxl_data.scan(data_cfg({"path": str(stars), "repeats": 5},
                                 {"path": str(few), "is_regularization": True}, trigger_word="sks"), 128)
    reg = [it for it in ds.items if it.is_reg]
    # 10 training samples: the 4 reg images once each, then one more repeat each in turn.
    assert [it.repeats for it in reg] == [3, 3, 2, 2]
    assert "balanced to 10 to match the 10 training sample(s)" in ds.report()
    many = copy_samples(tmp_path / "many", "prior*.png", 12)
    ds = sdxl_data.scan(data_cfg({"path": str(stars), "repeats": 5},
                                 {"path": str(many), "is_regularization": True}), 128)
    reg = [it for it in ds.items if it.is_reg]
    assert len(reg) == 10 and all(it.repeats == 1 for it in reg)
    assert "2 image(s) beyond that are not used" in ds.report()


def test_regularization_images_never_get_the_trigger_word(tmp_path):
    stars = copy_samples(tmp_path / "stars", "*_star.png", 2)
    reg = copy_samples(tmp_path / "reg", "prior*.png", 3)
    (reg / sorted(p.name for p in reg.glob("*.txt"))[0]).unlink()  # one without a caption: the fallback
    cfg = data_cfg({"path": str(stars)}, {"path": str(reg), "is_regularization": True, "trigger_word": "sks"},
                   trigger_word="sks", class_token="shape", caption_dropout=0.0)
    ds = sdxl_data.scan(cfg, 128)
    reg_items = [it for it in ds.items if it.is_reg]
    captions = {make_caption(it, cfg, random.Random(s)) for it in reg_items for s in range(3)}
    assert "shape" in captions and not any("sks" in c for c in captions)
    assert all(make_caption(it, cfg, random.Random(0)).startswith("sks")
               for it in ds.items if not it.is_reg)
    with pytest.raises(DataError, match="every \\[\\[data.datasets\\]\\] table has is_regularization"):
        sdxl_data.scan(data_cfg({"path": str(reg), "is_regularization": True}), 128)


class StubUNet(torch.nn.Module):
    def forward(self, noisy, t, encoder_hidden_states=None, added_cond_kwargs=None):
        return SimpleNamespace(sample=0.7 * noisy + 0.3 * torch.sin(noisy) + (t.float() / 1000).view(-1, 1, 1, 1))


@pytest.mark.parametrize("gamma", [0.0, 5.0])
def test_prior_loss_weight_multiplies_each_regularization_samples_loss(gamma):
    from diffusers import DDPMScheduler

    task = SDXLTask(load_config(extra={"train.prior_loss_weight": 0.25, "train.min_snr_gamma": gamma}))
    task.pipe = SimpleNamespace(vae=SimpleNamespace(config=SimpleNamespace(scaling_factor=0.13)),
                                scheduler=DDPMScheduler(num_train_timesteps=1000))
    task.noise_scheduler = task._noise_scheduler()
    g = torch.Generator().manual_seed(0)
    n = 4
    batch = {"latent_mean": torch.randn(n, 4, 8, 8, generator=g), "latent_std": 0.1 * torch.rand(n, 4, 8, 8, generator=g),
             "prompt_embeds": torch.zeros(n, 7, 16), "pooled": torch.zeros(n, 16), "time_ids": torch.zeros(n, 6),
             "sample_key": torch.tensor([sample_key(1, 0, i) for i in range(n)])}
    unet = StubUNet()
    # Each sample's own loss: its draws come from its key, whatever batch it is in.
    alone = [task.loss(unet, {k: v[i:i + 1] for k, v in batch.items()}).item() for i in range(n)]
    weights = torch.tensor([1.0, 0.25, 1.0, 0.25])  # samples 1 and 3 are regularization images
    weighted = task.loss(unet, {**batch, "loss_weight": weights}).item()
    # kohya: each sample's loss times its weight, then the mean over the batch.
    assert weighted == pytest.approx(sum(w * x for w, x in zip(weights.tolist(), alone)) / n, rel=1e-5)
    assert task.loss(unet, {**batch, "loss_weight": torch.ones(n)}).item() == pytest.approx(sum(alone) / n, rel=1e-5)


class LoRAStub(torch.nn.Module):
    """A 'UNet' of one peft LoRA'd Linear over the latent channels: its base is the prior, the adapter learns."""

    def __init__(self):
        from peft import LoraConfig, inject_adapter_in_model

        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["proj"]), self)
        self.proj.base_layer.requires_grad_(False)

    def forward(self, noisy, t, encoder_hidden_states=None, added_cond_kwargs=None):
        return SimpleNamespace(sample=self.proj(noisy.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_prior_prediction_makes_the_base_prediction_the_regularization_target():
    from diffusers import DDPMScheduler

    task = SDXLTask(load_config(extra={"train.prior_prediction": True}))
    task.pipe = SimpleNamespace(vae=SimpleNamespace(config=SimpleNamespace(scaling_factor=0.13)),
                                scheduler=DDPMScheduler(num_train_timesteps=1000))
    task.noise_scheduler = task._noise_scheduler()
    g = torch.Generator().manual_seed(0)
    n = 4
    batch = {"latent_mean": torch.randn(n, 4, 8, 8, generator=g), "latent_std": torch.zeros(n, 4, 8, 8),
             "prompt_embeds": torch.zeros(n, 7, 16), "pooled": torch.zeros(n, 16), "time_ids": torch.zeros(n, 6),
             "sample_key": torch.tensor([sample_key(1, 0, i) for i in range(n)]), "loss_weight": torch.ones(n)}
    unet = LoRAStub()
    reg = {**batch, "is_reg": torch.ones(n, dtype=torch.bool)}
    # A fresh adapter (B = 0) predicts what the base does: nothing to learn on a regularization sample.
    assert task.loss(unet, reg).item() == 0.0
    with torch.no_grad():
        unet.proj.lora_B["default"].weight.normal_()
    loss = task.loss(unet, reg)
    with torch.no_grad():
        x = 0.13 * batch["latent_mean"]
        drawn = task._keyed_draws(x, batch["sample_key"])
        noisy = task.noise_scheduler.add_noise(x, drawn[1], drawn[2])
        ours = unet(noisy, drawn[2]).sample
        base = unet.proj.base_layer(noisy.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    assert loss.item() == pytest.approx(((ours - base) ** 2).mean().item(), rel=1e-5)
    loss.backward()  # the adapter learns from it, and is still trainable afterwards
    assert unet.proj.lora_B["default"].weight.grad.abs().sum() > 0 and unet.proj.lora_A["default"].weight.requires_grad
    # Training rows keep their noise target.
    plain = {**batch, "is_reg": torch.zeros(n, dtype=torch.bool)}
    off = SDXLTask(load_config())
    off.pipe, off.noise_scheduler, off.timestep_max = task.pipe, task.noise_scheduler, task.timestep_max
    assert task.loss(unet, plain).item() == pytest.approx(off.loss(unet, plain).item(), rel=1e-6)


def test_a_run_with_regularization_weights_its_samples_and_reports_each_dataset(tmp_path, monkeypatch):
    from sdxl_lora.cli import main
    from sdxl_lora.sdxl import loss as diffusion

    stars = copy_samples(tmp_path / "stars", "*_star.png", 3)
    reg = copy_samples(tmp_path / "reg", "prior*.png", 3)
    before = {p: snapshot(p) for p in (stars, reg)}
    config = tmp_path / "run.toml"
    config.write_text(f"""
[data]
trigger_word = "sks"
resolution = 64
cache_dir = "{tmp_path / 'cache'}"
[[data.datasets]]
path = "{stars}"
repeats = 2
[[data.datasets]]
path = "{reg}"
is_regularization = true
[[data.datasets]]
class_prompt = "a green circle on a black background"
class_images = 2
is_regularization = true
[train]
prior_loss_weight = 0.5
prior_prediction = true
batch_size = 3
[preview]
prompts = ""
steps = 2
""", encoding="utf-8")
    seen = []
    real = diffusion.diffusion_loss

    def spy(*args, weight=None, **kw):
        seen.append(weight.tolist())
        return real(*args, weight=weight, **kw)

    monkeypatch.setattr(diffusion, "diffusion_loss", spy)
    assert main(["train", str(config), "--out", str(tmp_path), "--name", "r", "--steps", "2"]) == 0
    flat = [w for batch in seen for w in batch]
    assert set(flat) == {1.0, 0.5} and len(flat) == 6
    events = [json.loads(line) for line in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    dataset = next(e for e in events if e["event"] == "dataset")
    # 6 training samples: the 5 regularization images once, in table order, then one more repeat for the first.
    assert [(d["name"], d["images"], d["samples"], d["is_regularization"]) for d in dataset["datasets"]] == \
        [("stars", 3, 6, False), ("reg", 3, 4, True), ("class images", 2, 2, True)]
    # The adapter's kohya metadata counts them apart, as kohya's own files do.
    from safetensors import safe_open
    with safe_open(tmp_path / "r" / "r.safetensors", "pt") as f:
        meta = f.metadata()
    assert (meta["ss_num_train_images"], meta["ss_num_reg_images"]) == ("6", "6")
    assert {p: snapshot(p) for p in (stars, reg)} == before
    # The class images were made by the base, captioned with the prompt, in the cache.
    made = sorted((tmp_path / "cache" / "class_images").glob("*/*.png"))
    assert [p.name for p in made] == ["00000.png", "00001.png"]
    assert made[0].with_suffix(".txt").read_text(encoding="utf-8") == "a green circle on a black background\n"
    assert Image.open(made[0]).size == (64, 64)


def test_a_resume_is_refused_when_a_dataset_setting_or_the_prior_weight_changed(tmp_path):
    from sdxl_lora.core.loop import identity_changes

    stars = copy_samples(tmp_path / "stars", "*_star.png", 2)
    reg = copy_samples(tmp_path / "reg", "prior*.png", 2)

    def identity(reg_table, **train):
        cfg = load_config(extra={"data.datasets": [{"path": str(stars), "trigger_word": "sks"}, reg_table],
                                 **{f"train.{k}": v for k, v in train.items()}})
        task = SDXLTask(cfg)
        task.all_items = sdxl_data.scan(cfg.data, 128).items
        task.has_reg = any(it.is_reg for it in task.all_items)
        task.resolution, task.planned = 128, SimpleNamespace(targets=[], rank={})
        return task.identity()

    base = identity({"path": str(reg), "is_regularization": True})
    assert identity_changes(base, identity({"path": str(reg), "is_regularization": True})) == []
    assert any("prior_loss_weight" in c for c in identity_changes(
        base, identity({"path": str(reg), "is_regularization": True}, prior_loss_weight=0.3)))
    assert any("datasets" in c for c in identity_changes(
        base, identity({"path": str(reg), "is_regularization": True, "caption_prefix": "photo of"})))
    # The same folder as training images instead of regularization ones: other images, other data.
    assert identity_changes(base, identity({"path": str(reg)}))


# ------------------------------------------------------------------------ captions made on the spot

def tiny_blip(folder: Path) -> Path:
    """A BLIP captioner with random weights and a ten-word vocabulary, saved as a transformers folder; its
    output layer favours "star", so it says something."""
    from transformers import (BertTokenizerFast, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor,
                              BlipProcessor)

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "star", "red", "shape", "[DEC]"]
    folder.mkdir(parents=True)
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, bos_token="[DEC]")
    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 37}
    cfg = BlipConfig(text_config={**tiny, "vocab_size": len(words), "max_position_embeddings": 64,
                                  "bos_token_id": 11, "pad_token_id": 0, "sep_token_id": 3,
                                  "encoder_hidden_size": 32},
                     vision_config={**tiny, "image_size": 32, "patch_size": 8}, projection_dim=32)
    torch.manual_seed(0)
    model = BlipForConditionalGeneration(cfg)
    with torch.no_grad():
        model.text_decoder.cls.predictions.bias[words.index("star")] = 50.0
    model.save_pretrained(folder)
    BlipProcessor(BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer).save_pretrained(folder)
    return folder


def test_caption_writes_sidecars_for_uncaptioned_images_and_keeps_the_rest(tmp_path, capsys):
    from sdxl_lora.cli import main

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    Image.new("RGB", (48, 40), (200, 30, 30)).save(data / "a.png")
    Image.new("RGB", (40, 48), (30, 30, 200)).save(data / "b.png")
    (data / "b.txt").write_text("my own caption", encoding="utf-8")
    Image.new("RGB", (40, 40), (30, 200, 30)).save(data / "sub" / "c.jpg")
    model = tiny_blip(tmp_path / "blip")
    images = {p: p.read_bytes() for p in data.rglob("*") if p.suffix in (".png", ".jpg")}
    assert main(["dataset", "caption", str(data), "--model", str(model), "--prefix", "sks,"]) == 0
    assert "captions written: 2; kept (already there): 1" in capsys.readouterr().out
    for written in (data / "a.txt", data / "sub" / "c.txt"):
        text = written.read_text(encoding="utf-8")
        assert text.startswith("sks, ") and "star" in text
    assert (data / "b.txt").read_text(encoding="utf-8") == "my own caption"
    assert {p: p.read_bytes() for p in images} == images
    assert sorted(p.name for p in data.rglob("*")) == ["a.png", "a.txt", "b.png", "b.txt", "c.jpg", "c.txt", "sub"]
    # Training reads them as captions.
    assert all(it.has_caption for it in sdxl_data.scan(load_config(extra={"data.dirs": [str(data)]}).data, 64).items)
    # Again: nothing left to caption; with --overwrite the user's caption is replaced.
    assert main(["dataset", "caption", str(data), "--model", str(model)]) == 0
    assert "captions written: 0; kept (already there): 3" in capsys.readouterr().out
    assert main(["dataset", "caption", str(data), "--model", str(model), "--overwrite"]) == 0
    assert "star" in (data / "b.txt").read_text(encoding="utf-8")
    assert {p: p.read_bytes() for p in images} == images


def test_caption_needs_a_local_model_folder_with_safetensors(tmp_path, capsys):
    from sdxl_lora.cli import main

    data = copy_samples(tmp_path / "data", "*_star.png", 1)
    (data / "00_red_star.txt").unlink()
    assert main(["dataset", "caption", str(data), "--model", "Salesforce/blip-image-captioning-base"]) == 2
    assert "not a folder" in capsys.readouterr().err
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    assert main(["dataset", "caption", str(data), "--model", str(tmp_path / "pickled")]) == 2
    assert "no .safetensors weights" in capsys.readouterr().err
    assert not list(data.glob("*.txt"))


# ------------------------------------------------------------------------ the doctor

def test_the_doctor_finds_planted_duplicates_missing_triggers_small_subjects_and_suggests_steps(tmp_path, capsys):
    from sdxl_lora.cli import main

    stars = copy_samples(tmp_path / "stars", "*_star.png", 4)
    first = sorted(stars.glob("*.png"))[0]
    shutil.copy(first, stars / "copy.png")  # an exact duplicate
    # A near-duplicate: the same picture resized and re-saved as a JPEG.
    Image.open(first).convert("RGB").resize((150, 150)).save(stars / "resaved.jpg", quality=80)
    (stars / "resaved.txt").write_text("sks, a star", encoding="utf-8")
    (stars / "copy.txt").write_text("a star without the word", encoding="utf-8")
    Image.new("RGB", (40, 40), (0, 0, 0)).save(stars / "tiny.png")  # upscaled 3.2x to 128
    (stars / "tiny.txt").write_text("sks, dark", encoding="utf-8")
    reg = copy_samples(tmp_path / "reg", "prior*.png", 2)
    (reg / sorted(p.name for p in reg.glob("*.txt"))[0]).write_text("sks, a circle", encoding="utf-8")
    before = {p: snapshot(p) for p in (stars, reg)}
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\nresolution = 128\n[[data.datasets]]\npath = "{stars}"\ntrigger_word = "sks"\n'
                      f'repeats = 2\n[[data.datasets]]\npath = "{reg}"\nis_regularization = true\n'
                      '[train]\nbatch_size = 4\n', encoding="utf-8")
    assert main(["dataset", "inspect", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    dup = next(line for line in out.splitlines() if "copy.png" in line and "duplicates" not in line)
    assert first.name in dup
    near = out.split("near-duplicates:")[1].splitlines()[1]
    assert "resaved.jpg" in near and first.name in near
    # Only the planted ones: the other stars differ in colour or place.
    assert out.count("star.png") <= 3 + out.count("lack the trigger")
    assert "1 caption(s) in stars lack the trigger word 'sks'" in out and "copy.png" in out
    assert "1 regularization caption(s) hold a training dataset's trigger word" in out
    assert "tiny.png: 40x40 -> 128x128 (3.2x)" in out
    # 7 training images x 2 repeats, balanced by 14 regularization samples: 28 a epoch, 7 steps at batch 4; each
    # image seen 100 times is 50 epochs of repeats 2.
    assert "suggested train.steps: about 350" in out
    assert {p: snapshot(p) for p in (stars, reg)} == before


def test_folders_given_both_as_data_dirs_and_as_tables_are_refused(tmp_path):
    stars = copy_samples(tmp_path / "stars", "*_star.png", 1)
    with pytest.raises(ConfigError, match=r"both name the folders to train on — put each folder in a table"):
        load_config(extra={"data.datasets": [{"path": str(stars)}], "data.dirs": [str(stars)]})


def test_class_images_are_made_once_and_an_interrupted_set_is_finished(tmp_path):
    from sdxl_lora.sdxl import class_images

    calls = []

    class Part(torch.nn.Linear):
        device = torch.device("cpu")  # as diffusers' models have

    class FakePipe:  # what render() calls: one image per call, the seed from its generator
        unet = vae = text_encoder = text_encoder_2 = Part(1, 1)

        def __call__(self, prompt, generator, width, height, **kw):
            calls.append(generator.initial_seed())
            return SimpleNamespace(images=[Image.new("RGB", (width, height), (len(calls) * 40, 0, 0))])

    folder = tmp_path / "class"
    made = class_images.generate(FakePipe(), folder, "a circle", 3, 64, steps=2, guidance=5.0,
                                 device=torch.device("cpu"), autocast_dtype=None, show=False)
    assert made == 3 and calls == [0, 1, 2]
    first = (folder / "00000.png").read_bytes()
    (folder / "00002.txt").unlink()  # as if the run was killed between the image and its caption
    made = class_images.generate(FakePipe(), folder, "a circle", 3, 64, steps=2, guidance=5.0,
                                 device=torch.device("cpu"), autocast_dtype=None, show=False)
    assert made == 1 and calls[3:] == [2] and (folder / "00000.png").read_bytes() == first
    assert (folder / "00002.txt").read_text(encoding="utf-8") == "a circle\n"


def test_class_prompt_tables_say_what_they_need(tmp_path):
    stars = copy_samples(tmp_path / "stars", "*_star.png", 1)
    for table, message in (({"class_prompt": "a man", "class_images": 4}, "set is_regularization = true"),
                           ({"is_regularization": True}, "needs a path"),
                           ({"path": str(stars), "class_prompt": "a man", "class_images": 4,
                             "is_regularization": True}, "never into your folder")):
        with pytest.raises(ConfigError, match=rf"data\.datasets\[1\]: Value error, .*{message}"):
            data_cfg({"path": str(stars)}, table)
    cfg = data_cfg({"path": str(stars)}, {"class_prompt": "a man", "class_images": 4, "is_regularization": True})
    assert "data.datasets[1]: 4 image(s) of 'a man' are made by the base model when training starts" in \
        sdxl_data.scan(cfg, 128).report()
