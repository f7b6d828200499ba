"""Training extras a kohya/OneTrainer user expects: masked loss, separate learning rates, text encoder
LoRA, EMA of the adapter, TensorBoard, kohya-style preview prompt options, and the MFU figure.

One tiny run with everything on (masks, text encoder LoRA, EMA, TensorBoard, own learning rates) is
trained once and checked from several sides; a second run stops half-way and resumes to the same files.
"""
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from sdxl_lora.core.config import load_config
from sdxl_lora.sdxl import data as sdxl_data
from sdxl_lora.sdxl import loss as diffusion
from sdxl_lora.sdxl.dataset import DataError
from sdxl_lora.sdxl.pixels import load_mask, load_pixels
from sdxl_lora.sdxl.task import SDXLTask

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data" / "images"


# ---------------------------------------------------------------- masked loss (the formula)

def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(3, 4, 6, 6, generator=g, requires_grad=True)
    target = torch.randn(3, 4, 6, 6, generator=g)
    mask = torch.rand(3, 1, 6, 6, generator=g)
    mask[0, :, :, :3] = 0.0  # image 0: left half ignored
    mask[2] = 0.0            # image 2: all ignored
    t = torch.tensor([10, 500, 900])
    ac = torch.linspace(0.99, 0.01, 1000)
    return pred, target, mask, t, ac


@pytest.mark.parametrize("gamma", [0.0, 5.0])
def test_masked_loss_is_the_mask_weighted_mean_of_each_image(gamma):
    pred, target, mask, t, ac = _loss_inputs()
    got = diffusion.diffusion_loss(pred, target, t, ac, mask=mask, min_snr_gamma=gamma)
    p, y, m = pred.detach().double(), target.double(), mask.double()
    per_image = []
    for i in range(3):
        w = m[i].expand_as(p[i])
        per_image.append(((p[i] - y[i]) ** 2 * w).sum() / w.sum() if w.sum() > 0 else torch.tensor(0.0).double())
    per_image = torch.stack(per_image)
    if gamma:
        snr = ac.double()[t] / (1 - ac.double()[t])
        per_image = per_image * torch.clamp(gamma / snr, max=1.0)
    assert got.item() == pytest.approx(per_image.mean().item(), rel=1e-6)
    # An all-white mask is the plain loss.
    plain = diffusion.diffusion_loss(pred, target, t, ac, min_snr_gamma=gamma)
    assert diffusion.diffusion_loss(pred, target, t, ac, mask=torch.ones_like(mask), min_snr_gamma=gamma).item() \
        == pytest.approx(plain.item(), rel=1e-6)


def test_a_black_mask_region_gives_no_gradient():
    pred, target, mask, t, ac = _loss_inputs()
    diffusion.diffusion_loss(pred, target, t, ac, mask=mask).backward()
    g = pred.grad
    assert torch.count_nonzero(g[0, :, :, :3]) == 0 and torch.count_nonzero(g[2]) == 0
    assert torch.count_nonzero(g[0, :, :, 3:]) > 0 and torch.count_nonzero(g[1]) > 0


def test_the_task_loss_applies_the_batch_mask():
    from diffusers import DDPMScheduler

    task = SDXLTask(load_config(extra={"model.path": "tiny-sdxl"}))  # a base that recommends no settings
    task.pipe = SimpleNamespace(vae=SimpleNamespace(config=SimpleNamespace(scaling_factor=0.13)),
                                scheduler=DDPMScheduler(num_train_timesteps=1000))
    task.noise_scheduler = task._noise_scheduler()
    unet = lambda x, t, encoder_hidden_states, added_cond_kwargs: SimpleNamespace(sample=0.5 * x)  # noqa: E731
    g = torch.Generator().manual_seed(1)
    batch = {"latent_mean": torch.randn(2, 4, 8, 8, generator=g), "latent_std": torch.zeros(2, 4, 8, 8),
             "prompt_embeds": torch.zeros(2, 7, 16), "pooled": torch.zeros(2, 16), "time_ids": torch.zeros(2, 6),
             "mask": torch.zeros(2, 1, 8, 8)}
    batch["mask"][:, :, :4] = 1.0
    torch.manual_seed(5)
    masked = task.loss(unet, batch)
    # The same draws, computed directly over the top half only.
    torch.manual_seed(5)
    x0 = batch["latent_mean"] * 0.13
    torch.randn_like(x0)  # the latent sample's draw (std is 0 here)
    noise = torch.randn_like(x0)
    t = torch.randint(0, 1000, (2,))
    noisy = task.noise_scheduler.add_noise(x0, noise, t)
    expected = ((0.5 * noisy - noise) ** 2)[:, :, :4].mean()
    assert masked.item() == pytest.approx(expected.item(), rel=1e-5)


# ---------------------------------------------------------------- masks beside the images

def _dataset(folder: Path, n: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in sorted(SAMPLES.iterdir())[: 2 * n]:
        shutil.copy(f, folder / f.name)
    return folder


def _left_half_mask(image: Path, suffix: str = "-masklabel") -> Path:
    w, h = Image.open(image).size
    m = Image.new("L", (w, h), 0)
    m.paste(255, (0, 0, w // 2, h))
    path = image.with_name(image.stem + suffix + ".png")
    m.save(path)
    return path


def test_masks_pair_with_their_images_and_follow_crop_and_flip(tmp_path):
    folder = _dataset(tmp_path / "d", 3)
    first = sorted(folder.glob("*.png"))[0]
    mask = _left_half_mask(first)
    cfg = load_config(extra={"data.dirs": [str(folder)], "data.masked_loss": True}).data
    ds = sdxl_data.scan(cfg, 128)
    assert len(ds.items) == 3  # the mask is not a training image
    item = next(it for it in ds.items if it.path == first)
    assert item.mask == mask
    assert "2 of 3 images have no mask" in ds.report()
    _, time_ids = load_pixels(item, "center", False, None)
    m = load_mask(item, False, time_ids)
    bw, bh = item.bucket
    assert m.shape == (1, bh // 8, bw // 8)
    assert m[0, :, : bw // 16 - 1].min() > 0.99 and m[0, :, bw // 16 + 1:].max() < 0.01
    flipped = load_mask(item, True, time_ids)
    assert torch.allclose(flipped, m.flip(-1), atol=1e-2)  # mirrored with its image
    other = next(it for it in ds.items if it.path != first)
    assert torch.equal(load_mask(other, False, time_ids), torch.ones(1, bh // 8, bw // 8))
    # Without masked_loss the mask is neither used nor trained on as an image, and the report says so.
    off = sdxl_data.scan(load_config(extra={"data.dirs": [str(folder)]}).data, 128)
    assert len(off.items) == 3 and all(it.mask is None for it in off.items)
    assert "look like loss masks" in off.report()


def test_a_mask_of_the_wrong_size_is_refused_naming_it(tmp_path):
    folder = _dataset(tmp_path / "d", 2)
    first = sorted(folder.glob("*.png"))[0]
    bad = first.with_name(first.stem + ".mask.png")
    Image.new("L", (31, 17), 255).save(bad)
    cfg = load_config(extra={"data.dirs": [str(folder)], "data.masked_loss": True, "data.mask_suffix": ".mask"}).data
    with pytest.raises(DataError, match=r"\.mask\.png is 31x17 but its image"):
        sdxl_data.scan(cfg, 128)


# ---------------------------------------------------------------- one run with everything on

def _cfg(tmp, name, cache, data, steps=3, **extra):
    base = {"data.dirs": [str(data)], "data.cache_dir": str(cache), "data.masked_loss": True,
            "output.runs_dir": str(tmp), "output.name": name, "preview.prompts": "", "train.steps": steps,
            "train.batch_size": 2, "train.log_every": 1, "train.save_every": 0, "train.save_every_minutes": 0,
            "train.lr": 1e-3, "train.unet_lr": 2e-3, "train.text_encoder_lr": 5e-4,
            "adapter.train_text_encoder": True, "adapter.rank": 4, "train.ema": True, "train.ema_decay": 0.6,
            "train.tensorboard": True, "train.seed": 7}
    base.update(extra)
    return load_config(extra=base)


def _trainer(cfg, resume=None):
    from sdxl_lora.core.runs import Run, create_run
    from sdxl_lora.core.loop import Trainer

    run = create_run(cfg) if resume is None else Run(Path(cfg.output.runs_dir) / cfg.output.name)
    trainer = Trainer(cfg, SDXLTask(cfg), run, resume=resume)
    trainer.setup()
    return trainer


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extras")
    data = _dataset(tmp / "data", 4)
    _left_half_mask(sorted(data.glob("*.png"))[0])
    cache = tmp / "cache"
    trainer = _trainer(_cfg(tmp, "full", cache, data))
    start = {n: p.detach().clone() for n, p in trainer._trainable().items()}
    seen = []  # the raw weights after each optimizer step
    real_update = trainer.ema.update

    def update():
        seen.append({n: p.detach().clone() for n, p in trainer._trainable().items()})
        real_update()

    trainer.ema.update = update
    groups = [(g.get("name"), g["lr"], len(g["params"])) for g in trainer.optimizer.param_groups]
    result = trainer.fit()
    return SimpleNamespace(tmp=tmp, data=data, cache=cache, trainer=trainer, result=result, start=start,
                           seen=seen, groups=groups, final=result.adapter)


def test_unet_and_text_encoder_learning_rates_reach_the_optimizer(full_run):
    names = {name: lr for name, lr, _ in full_run.groups}
    assert names == {"unet": 2e-3, "text_encoder": 5e-4}
    te_tensors = sum(n for name, _, n in full_run.groups if name == "text_encoder")
    assert te_tensors == sum(1 for k in full_run.start if k.startswith("text_encoder"))


def test_lr_multipliers_split_the_unet_groups():
    task = SDXLTask(load_config(extra={"train.lr_multipliers": {"*attn2*": 3.0}, "train.unet_lr": 1e-4}))
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    mods = {"x.attn1.to_q": SimpleNamespace(parameters=lambda: [a]),
            "x.attn2.to_q": SimpleNamespace(parameters=lambda: [b, c])}
    task.pipe = SimpleNamespace(unet=SimpleNamespace(named_modules=lambda: mods.items()))
    task.plan = SimpleNamespace(targets=[SimpleNamespace(name=n, block=None) for n in mods])
    task._adapter_model = None
    groups = task.param_groups()
    assert [(g["lr"], len(g["params"])) for g in groups] == [(1e-4, 1), (pytest.approx(3e-4), 2)]


def test_text_encoder_lora_trains_and_is_exported_for_kohya_and_diffusers(full_run, tiny_dir):
    end = full_run.seen[-1]
    for te in ("text_encoder.", "text_encoder_2."):
        te_b = [k for k in full_run.start if k.startswith(te) and "lora_B" in k]
        # lora_B starts at zero. (SDXL reads the penultimate layer, so the first encoder's last layer learns nothing.)
        assert te_b and any(torch.count_nonzero(end[k]) > 0 for k in te_b), te
    kohya = load_file(full_run.final["kohya"])
    assert any(k.startswith("lora_te1_") for k in kohya) and any(k.startswith("lora_te2_") for k in kohya)
    assert any(k.startswith("lora_unet_") for k in kohya)
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_dir)
    pipe.load_lora_weights(str(full_run.final["diffusers"]))
    file = load_file(full_run.final["diffusers"])
    loaded = {n: p for n, p in pipe.text_encoder_2.named_parameters() if "lora_B" in n}
    assert loaded
    for n, p in loaded.items():
        module = n.split(".lora_B")[0]
        assert torch.equal(p.detach(), file[f"text_encoder_2.{module}.lora_B.weight"])
    # And the kohya file reads back with its text encoder layers.
    from sdxl_lora.sdxl.formats.export import load_adapter

    adapter = load_adapter(full_run.final["kohya"])
    assert {"unet", "text_encoder", "text_encoder_2"} <= set(adapter.components())


def test_the_exported_adapter_is_the_ema_of_the_step_weights(full_run):
    decay = 0.6
    assert len(full_run.seen) == 3
    ema = {k: v.clone() for k, v in full_run.start.items()}
    for weights in full_run.seen:
        for k in ema:
            ema[k] = decay * ema[k] + (1 - decay) * weights[k]
    file = load_file(full_run.final["diffusers"])
    for name, value in ema.items():
        key = name.replace(".default.", ".")
        assert torch.allclose(file[key], value, atol=1e-7, rtol=1e-6), name
    # The trained (not averaged) weights are back in the model after the export.
    raw = full_run.trainer._trainable()
    name = next(k for k in raw if "lora_B" in k)
    assert torch.equal(raw[name].detach(), full_run.seen[-1][name]) and not torch.equal(raw[name].detach(), ema[name])
    from safetensors import safe_open

    with safe_open(str(full_run.final["kohya"]), "pt") as f:
        assert f.metadata()["sdxl_lora.ema_decay"] == "0.6"


def test_tensorboard_gets_the_figures_of_the_events_file(full_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sdxl_lora.core.runs import read_events

    run_dir = full_run.result.run.dir
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "lr", "grad_norm", "images_per_s", "loss/eval"} <= tags
    steps = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"]
    assert [s.step for s in acc.Scalars("loss/train")] == [e["step"] for e in steps] == [1, 2, 3]
    assert [s.value for s in acc.Scalars("loss/train")] == pytest.approx([e["loss"] for e in steps], rel=1e-6)
    assert all(e["grad_norm"] > 0 for e in steps) and all("mfu" not in e for e in steps)  # CPU: no MFU


def test_a_resumed_ema_run_ends_with_the_same_files(full_run, monkeypatch):
    cfg = _cfg(full_run.tmp, "halves", full_run.cache, full_run.data)
    trainer = _trainer(cfg)
    real = SDXLTask.loss
    calls = {"n": 0}

    def loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 2:
            trainer._stop = "SIGTERM"  # as a signal during step 2: finish it, save, stop
        return real(self, model, batch)

    monkeypatch.setattr(SDXLTask, "loss", loss)
    first = trainer.fit()
    monkeypatch.undo()
    assert first.interrupted == "SIGTERM" and first.steps == 2
    assert "ema" in torch.load(first.state / "trainer.pt", weights_only=True)
    second = _trainer(cfg, resume=first.state).fit()
    assert second.steps == 3
    for kind in ("kohya", "diffusers"):
        a, b = load_file(full_run.final[kind]), load_file(second.adapter[kind])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind


# ---------------------------------------------------------------- previews

def test_prompt_lines_carry_kohya_options():
    from sdxl_lora.sdxl.preview import PreviewPrompt, parse_prompt_line

    p = parse_prompt_line("a red circle, flat --n blurry, lowres --w 96 --h 64 --s 3 --l 6.5 --d 42")
    assert p == PreviewPrompt("a red circle, flat", negative="blurry, lowres", width=96, height=64, steps=3,
                              guidance=6.5, seed=42)
    assert parse_prompt_line("plain") == PreviewPrompt("plain")
    with pytest.raises(ValueError, match="unknown option --q"):
        parse_prompt_line("x --q 3")
    with pytest.raises(ValueError, match="must be an integer"):
        parse_prompt_line("x --w wide")


def test_structured_prompt_files(tmp_path):
    from sdxl_lora.sdxl.preview import PreviewPrompt, read_prompts

    toml = tmp_path / "p.toml"
    toml.write_text('[[prompt]]\nprompt = "a cat"\nnegative_prompt = "dog"\nwidth = 64\nsample_steps = 4\n'
                    'scale = 3.0\nseed = 9\n\n[[prompt]]\nprompt = "a dog"\n')
    assert read_prompts(toml) == [PreviewPrompt("a cat", "dog", 64, None, 4, 3.0, 9), PreviewPrompt("a dog")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a cat", "height": 32, "guidance": 2}\n\n{"prompt": "b", "steps": 2}\n')
    assert read_prompts(jsonl) == [PreviewPrompt("a cat", height=32, guidance=2.0), PreviewPrompt("b", steps=2)]
    jsonl.write_text('{"prompt": "a", "colour": 1}\n')
    with pytest.raises(ValueError, match="line 1: unknown field.*colour"):
        read_prompts(jsonl)


def test_per_prompt_settings_reach_the_pipeline():
    from sdxl_lora.sdxl.preview import PreviewPrompt, render

    calls = []

    class Pipe:
        unet = SimpleNamespace(device=torch.device("cpu"))

        def __call__(self, **kw):
            calls.append(kw)
            return SimpleNamespace(images=[Image.new("RGB", (kw["width"], kw["height"]))])

    images = render(Pipe(), [PreviewPrompt("a", "neg", 96, 64, 3, 6.5, 42), "b"], seed=100, steps=20,
                    guidance=5.0, width=128, height=128)
    a, b = calls
    assert (a["prompt"], a["negative_prompt"], a["width"], a["height"], a["num_inference_steps"],
            a["guidance_scale"]) == ("a", "neg", 96, 64, 3, 6.5)
    assert a["generator"].initial_seed() == 42 and b["generator"].initial_seed() == 101
    assert (b["width"], b["num_inference_steps"], b["guidance_scale"]) == (128, 20, 5.0)
    assert [im.size for im in images] == [(96, 64), (128, 128)]


def test_previews_under_zero_terminal_snr_sample_from_pure_noise(tiny_dir):
    from diffusers import EulerDiscreteScheduler

    from sdxl_lora.sdxl.preview import preview_scheduler

    base = EulerDiscreteScheduler.from_pretrained(tiny_dir, subfolder="scheduler").config
    s = preview_scheduler(base, zero_terminal_snr=True)
    s.set_timesteps(4)
    assert s.config.rescale_betas_zero_snr and s.config.timestep_spacing == "trailing"
    assert int(s.timesteps[0]) == s.config.num_train_timesteps - 1
    assert s.alphas_cumprod[-1] < 1e-6  # the last step is (almost exactly) pure noise
    plain = preview_scheduler(base, zero_terminal_snr=False)
    assert not plain.config.rescale_betas_zero_snr


# ---------------------------------------------------------------- MFU

def test_mfu_arithmetic_and_peak_table():
    from sdxl_lora.core import tracking

    # 1 TFLOP per image at 989 images/s on one H200 is 100 %; on two GPUs, 50 %.
    assert tracking.mfu(1e12, 989.0, 989.0) == pytest.approx(1.0)
    assert tracking.mfu(1e12, 989.0, 989.0, num_gpus=2) == pytest.approx(0.5)
    assert tracking.peak_tflops("NVIDIA H200") == 989.0
    assert tracking.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert tracking.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert tracking.peak_tflops("NVIDIA L40S") == 362.0
    assert tracking.peak_tflops("NVIDIA GeForce RTX 4090") == 165.0
    assert tracking.peak_tflops("Some New GPU") is None
    assert tracking.peak_tflops("Some New GPU", override=123.0) == 123.0
    # The FLOP count of a known matmul: 2 * m * n * k.
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert tracking.count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def test_mfu_counts_the_unets_step_on_the_meta_device_as_the_model_itself_counts(tiny_dir):
    """The MFU figure's FLOPs come from a copy of the UNet on the meta device (no memory, no kernels): the same
    count as a forward of the trained model itself, doubled for the step."""
    from diffusers import UNet2DConditionModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sdxl_lora.core import inject, tracking
    from sdxl_lora.sdxl.config import AdapterConfig
    from sdxl_lora.sdxl import slots as unet_slots

    unet = UNet2DConditionModel.from_pretrained(str(tiny_dir / "unet"), local_files_only=True)
    task = SDXLTask(load_config())
    task.plan = unet_slots.make_plan(unet, AdapterConfig(preset="full", rank=4), resolution=128, native=128)
    inject.apply_plan(unet, task.plan)
    task.pipe = SimpleNamespace(unet=unet)
    c = unet.config
    batch = {"latent_mean": torch.zeros(3, 4, 12, 16), "prompt_embeds": torch.zeros(3, 77, c.cross_attention_dim),
             "pooled": torch.zeros(3, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim),
             "time_ids": torch.zeros(3, 6)}
    # Attention as the math path, which the meta device runs too (the CPU's own kernel goes uncounted).
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        forward = tracking.count_flops(lambda: unet(
            torch.zeros(1, 4, 12, 16), torch.tensor([500]), encoder_hidden_states=batch["prompt_embeds"][:1],
            added_cond_kwargs={"text_embeds": batch["pooled"][:1], "time_ids": batch["time_ids"][:1]}))
    assert forward > 0 and task.flops_per_sample(batch) == 2 * forward
    # The text encoders' LoRA (their forward is in the step): the loop counts on the device.
    assert task.flops_per_sample({"latent_mean": batch["latent_mean"], "input_ids": torch.zeros(3, 77)}) is None


def test_mfu_counts_grouped_query_attention_as_every_query_head_attending():
    """Llama 3 and most LLMs have fewer key/value heads than query heads; the GPU's attention kernels take
    them as they are. The count (what the MFU figure of an LLM run rests on) is that of keys and values
    repeated to every query head, on each kernel the GPU may pick (shapes only: meta tensors)."""
    from sdxl_lora.core import tracking

    aten = torch.ops.aten
    q = torch.empty(2, 8, 16, 32, device="meta")
    kv_grouped, kv_full = torch.empty(2, 2, 16, 32, device="meta"), torch.empty(2, 8, 16, 32, device="meta")
    expected = 2 * (2 * 2 * 8 * 16 * 16 * 32)  # Q K^T and the weights times V
    kernels = {"flash": lambda k, v: aten._scaled_dot_product_flash_attention(q, k, v),
               "efficient": lambda k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, False),
               "cudnn": lambda k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)}
    for name, kernel in kernels.items():
        assert tracking.count_flops(lambda: kernel(kv_grouped, kv_grouped)) == expected, name
        assert tracking.count_flops(lambda: kernel(kv_full, kv_full)) == expected, name


def test_missing_tensorboard_names_the_package(monkeypatch, tmp_path):
    import importlib.util

    from sdxl_lora.core import tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a))
    with pytest.raises(ImportError, match="pip install tensorboard"):
        tracking.Trackers(["tensorboard"], tmp_path, {})


def test_ema_state_round_trips_and_swaps_back():
    from sdxl_lora.core.ema import EMA

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = EMA({"w": p}, 0.5)
    with torch.no_grad():
        p.add_(2.0)
    ema.update()  # 0.5 * [1, 2] + 0.5 * [3, 4]
    assert torch.equal(ema.shadow["w"], torch.tensor([2.0, 3.0]))
    with ema.applied():
        assert torch.equal(p.detach(), torch.tensor([2.0, 3.0]))
    assert torch.equal(p.detach(), torch.tensor([3.0, 4.0]))
    other = EMA({"w": torch.nn.Parameter(torch.zeros(2))}, 0.5)
    other.load_state_dict(ema.state_dict())
    assert torch.equal(other.shadow["w"], ema.shadow["w"]) and other.updates == 1
    with pytest.raises(KeyError, match="does not match"):
        EMA({"v": p}, 0.5).load_state_dict(ema.state_dict())
