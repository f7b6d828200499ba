"""train.vram_gb: the whole run planned to fit a memory budget (sdxl/plan.py: fit_budget), on SDXL base's
real architecture (meta device: no weights), and previews drawn from embeddings made at set-up (the text
encoders never come back for them)."""
import json

import numpy as np
import pytest
import torch

from sdxl_lora.cli import main
from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.sdxl.model import unet_skeleton
from sdxl_lora.sdxl.plan import component_bytes, fit_budget, plan_config, run_memory_for
from sdxl_lora.sdxl.preview import tiled_previews

GIB = 2**30


@pytest.fixture(scope="module")
def sdxl():
    cfg = load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 4})
    unet, native = unet_skeleton(cfg.model)
    return cfg, unet, native, component_bytes(cfg)


def test_each_budget_gets_a_whole_run_that_fits_and_a_smaller_one_costs_more_time(sdxl):
    # The documented ladder (docs/qlora.md), batch 4 at 1024: at 24 and 12 GiB selective checkpointing (more
    # of it at 12); at 8 GiB an nf4 base (previews then decode in tiles); at 6 GiB tiled encoding while caching
    # too.
    cfg, unet, native, parts = sdxl
    fits = {b: fit_budget(cfg, b, unet, native, parts) for b in (80, 24, 12, 8, 6)}
    for budget, fit in fits.items():
        assert fit.memory.peak <= budget * GIB
        effective = fit.cfg.train.batch_size * fit.cfg.train.grad_accum
        assert effective == cfg.train.batch_size * cfg.train.grad_accum  # the same images per optimizer step
    assert fits[80].choices == {} and fits[80].slowdown == 1.0
    assert fits[24].cfg.train.checkpoint_budget_gb and fits[24].cfg.model.quantize == "none"
    assert fits[12].cfg.train.checkpoint_budget_gb < fits[24].cfg.train.checkpoint_budget_gb
    assert fits[12].cfg.train.checkpoint_budget_gb and fits[12].cfg.model.quantize == "none"
    assert fits[8].cfg.model.quantize == "nf4" and fits[8].cfg.train.checkpoint_budget_gb
    assert tiled_previews(fits[8].cfg) and fits[8].memory.phases["previews"] < fits[12].memory.phases["previews"]
    assert fits[6].cfg.model.quantize != "none" and fits[6].cfg.model.tiled_vae_encode
    assert fits[6].memory.phases["caching"] < fits[8].memory.phases["caching"]
    slowdowns = [fits[b].slowdown for b in (80, 24, 12, 8, 6)]
    assert slowdowns == sorted(slowdowns) and slowdowns[-1] > slowdowns[0]


# Whole-process peaks (GiB) of `sdxl-lora train` with the defaults on a full-size SDXL and a three-bucket dataset at
# 1024 (auto chose CUDA graphs, nothing compiled), by batch: benchmarks/train_e2e.py,
# benchmarks/RESULTS.md#memory-estimates-against-measured-peaks.
MEASURED_DEFAULT_RUNS = [(1, 12.51), (2, 18.26), (4, 29.73), (8, 53.91), (16, 98.23)]


@pytest.mark.parametrize("batch,measured", MEASURED_DEFAULT_RUNS)
def test_the_default_runs_training_estimate_stays_just_above_its_measured_peak(batch, measured):
    # Too high and a run that fits is refused or slowed by levers it does not need; under it and a run the
    # estimate let start can run out of memory.
    cfg = load_config(extra={"model.path": "arch:sdxl", "data.resolution": 1024, "train.batch_size": batch})
    planned = plan_config(cfg)
    training = run_memory_for(cfg, planned, component_bytes(cfg)).phases["training"] / GIB
    assert measured < training < 1.07 * measured
    # The refit is the trainer's own LoRA step's: peft's products (train.lora_matmul="peft") keep the model's count.
    peft = load_config(extra={"model.path": "arch:sdxl", "data.resolution": 1024, "train.batch_size": batch,
                              "train.lora_matmul": "peft"})
    assert plan_config(peft).memory.activations > planned.memory.activations


def test_levers_the_user_set_are_kept_by_the_budget(sdxl):
    _, unet, native, parts = sdxl
    cfg = load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 4, "model.quantize": "nf4",
                             "train.gradient_checkpointing": False, "preview.vae_tiling": False})
    fit = fit_budget(cfg, 12, unet, native, parts)
    assert fit.cfg.model.quantize == "nf4" and fit.cfg.preview.vae_tiling is False
    assert not fit.cfg.train.gradient_checkpointing and not fit.cfg.train.checkpoint_budget_gb
    assert fit.memory.peak <= 12 * GIB


def test_a_batch_that_needs_checkpointing_to_fit_trains_as_two_accumulated_halves_instead(sdxl):
    # Batch 16 on a whole 80 GB card: two batches of 8 accumulated a step trained as fast as 16 with part of the
    # UNet checkpointed, in 16 GiB less (benchmarks/RESULTS.md#every-card-by-default); the same images a step.
    _, unet, native, parts = sdxl
    cfg = load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 16})
    fit = fit_budget(cfg, 79.5, unet, native, parts)
    assert (fit.cfg.train.batch_size, fit.cfg.train.grad_accum) == (8, 2)
    assert not fit.cfg.train.checkpoint_budget_gb and not fit.cfg.train.gradient_checkpointing
    # Where halving is not enough, the halves are checkpointed rather than quartered (48 GB).
    fit = fit_budget(cfg, 47.5, unet, native, parts)
    assert (fit.cfg.train.batch_size, fit.cfg.train.grad_accum) == (8, 2) and fit.cfg.train.checkpoint_budget_gb


def test_without_bitsandbytes_a_small_card_gets_the_fp8_base_that_torch_alone_runs(sdxl, monkeypatch):
    # nf4 needs the qlora extra: a budget never picks what the run then could not load.
    import importlib.util

    cfg, unet, native, parts = sdxl
    assert fit_budget(cfg, 8, unet, native, parts).cfg.model.quantize == "nf4"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    fit = fit_budget(cfg, 8, unet, native, parts)
    assert fit.cfg.model.quantize == "fp8" and fit.memory.peak <= 8 * GIB


@pytest.mark.parametrize("kind, base", [("loha", "fp8"), ("lokr", "fp8"), ("dora", "nf4")])
def test_a_budget_picks_only_a_base_the_adapter_kind_trains_over(sdxl, kind, base):
    # LoHa and LoKr cannot train over a 4-bit base, DoRA not over fp8: the budget's choice is one the run accepts.
    _, unet, native, parts = sdxl
    cfg = load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 2, "adapter.kind": kind})
    fit = fit_budget(cfg, 8, unet, native, parts)
    assert fit.cfg.model.quantize == base and fit.memory.peak <= 8 * GIB
    type(fit.cfg).model_validate(fit.cfg.model_dump())  # the config the run trains with passes its own checks


def test_a_budget_that_cannot_be_met_is_refused_with_the_smallest_that_works(sdxl, capsys):
    cfg, unet, native, parts = sdxl
    with pytest.raises(ConfigError, match=r"train.vram_gb=3: this run needs at least about (\d+\.\d) GiB") as e:
        fit_budget(cfg, 3, unet, native, parts)
    smallest = float(str(e.value).split("about ")[1].split(" GiB")[0])
    fit = fit_budget(cfg, smallest + 0.1, unet, native, parts)  # what the message names does fit
    assert fit.memory.peak <= (smallest + 0.1) * GIB
    # From the CLI: exit 2, one line naming the field, before any weights are read.
    assert main(["plan", "--model", "arch:sdxl", "--vram", "3"]) == 2
    assert "train.vram_gb=3" in capsys.readouterr().err


def test_plan_prints_every_phase_of_the_run_and_what_the_budget_chose(capsys):
    assert main(["plan", "--model", "arch:sdxl", "--batch-size", "1", "--vram", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    phases = data["run_memory"]["phases_gib"]
    assert set(phases) == {"caching", "training", "previews", "export"}
    assert data["run_memory"]["peak_gib"] == max(phases.values()) <= 8
    assert data["budget_choices"]["model.quantize"] == "'nf4' (was 'none')"
    assert main(["plan", "--model", "arch:sdxl"]) == 0
    out = capsys.readouterr().out
    assert "whole run" in out and "previews" in out and "caching" in out
    # Without a budget the UNet is read onto the GPU before caching: that phase holds its bf16 weights too.
    assert main(["plan", "--model", "arch:sdxl", "--batch-size", "1", "--json"]) == 0
    unbudgeted = json.loads(capsys.readouterr().out)["run_memory"]["phases_gib"]
    assert unbudgeted["caching"] > phases["caching"] + 4.5  # SDXL's UNet: 2.6 billion weights, 4.8 GiB in bf16


def test_the_final_previews_are_counted_beside_the_optimizer_state_they_render_with(capsys):
    # The final previews render after the last step: the training step's CUDA graphs are released by then, but the
    # optimizer state is still held (a stopped run saves it). Step-0 previews come before it exists.
    def previews(*sets):
        args = [a for s in sets for a in ("--set", s)]
        assert main(["plan", "--model", "arch:sdxl", "--batch-size", "1", "--json", *args]) == 0
        data = json.loads(capsys.readouterr().out)
        return data["run_memory"]["phases_gib"]["previews"], data["memory"]["optimizer_gib"]

    both, optimizer = previews()
    before_only, _ = previews("preview.after=false")
    assert optimizer > 0.05
    assert both - before_only == pytest.approx(optimizer * 1.05, abs=0.005)  # the whole process's reserve on it
    # Previews every N steps already hold it (and, with CUDA graphs, their pool): the final set adds nothing.
    every, _ = previews("preview.every=50", "train.cuda_graphs=true")
    every_not_after, _ = previews("preview.every=50", "preview.after=false", "train.cuda_graphs=true")
    assert every == every_not_after > both


def test_the_previews_count_the_copies_the_adapter_is_merged_into(sdxl, monkeypatch):
    # A preview set renders with the adapter merged into copies of the weights it adapts (the originals stay for
    # training): the previews phase holds those copies beside the UNet, where the base's layers are not quantized.
    from sdxl_lora.sdxl import plan as plan_module

    cfg, unet, native, parts = sdxl
    projections = ("to_q", "to_k", "to_v", "to_out.0")  # the default preset: every attention projection
    copies = sum(m.weight.numel() * 2 for n, m in unet.named_modules()  # bf16, the run's compute dtype
                 if isinstance(m, torch.nn.Linear) and ".attn" in n and n.endswith(projections))
    assert copies > 1.5 * GIB
    planned = plan_config(cfg)
    assert plan_module.merged_copy_bytes(cfg, planned) == copies
    counted = run_memory_for(cfg, planned, parts).phases["previews"]
    monkeypatch.setattr(plan_module, "merged_copy_bytes", lambda c, p: 0)
    uncounted = run_memory_for(cfg, planned, parts).phases["previews"]
    assert counted - uncounted == pytest.approx(copies * 1.05, rel=1e-3)  # the whole process's reserve on them
    monkeypatch.undo()
    # A 4-bit base keeps the adapter on its quantized layers for previews: no copies of them.
    nf4 = load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 4, "model.quantize": "nf4",
                             "train.gradient_checkpointing": True})
    assert plan_module.merged_copy_bytes(nf4, plan_config(nf4)) == 0


def test_a_quantized_run_previews_from_16_bit_copies_of_as_many_layers_as_fit_below_its_planned_peak(capsys):
    # QLoRA's previews render from 16-bit copies of the quantized layers as far as those stay under the run's peak:
    # all of them where the training step at batch 1 holds more; with checkpointing (caching is then the peak)
    # the smallest, up to the room there, never raising the peak.
    def planned(*sets):
        args = [a for s in sets for a in ("--set", s)]
        assert main(["plan", "--model", "arch:sdxl", "--batch-size", "1", "--json",
                     "--set", "model.quantize='nf4'", *args]) == 0
        return json.loads(capsys.readouterr().out)["run_memory"]

    fast = planned()
    assert fast["dequantized_previews"] == "all" and fast["peak_gib"] == fast["phases_gib"]["training"]
    assert fast["dequantized_gib"] == pytest.approx(4.145, abs=0.005)  # SDXL's Linear layers in bf16
    lean = planned("train.gradient_checkpointing=true")
    assert lean["dequantized_previews"] == "part" and 0.5 < lean["dequantized_gib"] < fast["dequantized_gib"]
    assert lean["peak_gib"] == lean["phases_gib"]["caching"] > lean["phases_gib"]["training"]
    # Up to the room: within one more layer (SDXL's largest Linear, 1280x10240 in bf16, 25 MiB) of the peak.
    assert lean["peak_gib"] - 0.03 <= lean["phases_gib"]["previews"] <= lean["peak_gib"]
    # The copies are counted, with the whole process's reserve on them.
    assert fast["phases_gib"]["previews"] - lean["phases_gib"]["previews"] == pytest.approx(
        (fast["dequantized_gib"] - lean["dequantized_gib"]) * 1.05, abs=0.005)
    dora = planned("adapter.kind='dora'")  # DoRA keeps its path on 4-bit layers
    assert dora["dequantized_previews"] == "none" and dora["dequantized_gib"] == 0


def test_an_nf4_run_on_an_8_gb_card_previews_from_copies_of_its_smallest_layers_and_on_a_big_card_all(sdxl):
    # On an 8 GB card the copies of every quantized layer do not fit under the run's peak, but those of the
    # smallest do: previews render from as many as fit, their bytes counted exactly, the peak unchanged.
    from sdxl_lora.core.card import pretend_card
    from sdxl_lora.sdxl.memory import RESERVE
    from sdxl_lora.sdxl.plan import plan_run, quantized_sizes

    _, unet, _, _ = sdxl
    small = plan_run(load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 2}), pretend_card(8))
    memory = small.memory
    assert small.cfg.model.quantize == "nf4" and memory.peak <= 8 * GIB
    sizes = quantized_sizes(small.cfg, unet)  # weights, smallest first
    copies, layers = memory.dequantized_layers
    assert memory.dequantized_previews == "part" and 0 < copies < layers == len(sizes)
    assert memory.dequantized_bytes == 2 * sum(sizes[:copies]) > 1.5 * GIB  # bf16 copies of the smallest
    # Under the peak, and the next layer would have raised it.
    assert memory.phases["previews"] <= memory.peak < memory.phases["previews"] + RESERVE * 2 * sizes[copies]
    assert f"previews render from 16-bit copies of {copies} of {layers} quantized layers" in memory.format()
    big = plan_run(load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 2, "model.quantize": "nf4"}),
                   pretend_card(80))
    assert big.memory.dequantized_previews == "all" and big.memory.dequantized_layers == (layers, layers)
    assert big.memory.dequantized_bytes == 2 * sum(sizes) and big.memory.phases["previews"] <= big.memory.peak
    assert f"16-bit copies of all {layers} quantized layers" in big.memory.format()


def test_train_refuses_an_impossible_budget_before_loading_the_model(tiny_dir, tmp_path, capsys):
    code = main(["train", "--model", str(tiny_dir), "--data", "sample_data/images", "--steps", "1",
                 "--out", str(tmp_path), "--vram", "0.1"])
    err = capsys.readouterr().err
    assert code == 2 and "train.vram_gb=0.1" in err and "Traceback" not in err
    assert not list(tmp_path.glob("*/samples/*.png")) and not list(tmp_path.glob("*/checkpoints/*"))


def test_previews_from_embeddings_made_at_set_up_draw_the_same_images(tiny_dir):
    # The preview prompts are encoded once, while the text encoders are on the device for the caches, so
    # previews never bring the text encoders back: the images must be those of the pipeline's own encoding.
    from diffusers import StableDiffusionXLPipeline

    from sdxl_lora.sdxl.preview import PreviewPrompt, encode_prompts, render

    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red star", PreviewPrompt("a blue circle", negative="blurry", guidance=1.0, seed=7)]
    kw = dict(seed=3, steps=3, guidance=5.0, width=64, height=64)
    texts = encode_prompts(pipe, prompts, guidance=kw["guidance"])
    assert "negative_prompt_embeds" in texts[0] and "negative_prompt_embeds" not in texts[1]  # guidance 1: none
    cached = render(pipe, prompts, **kw, texts=texts)
    live = render(pipe, prompts, **kw)
    for a, b in zip(cached, live):
        assert (np.asarray(a) == np.asarray(b)).all()


def test_caption_previews_share_the_most_common_bucket_so_they_render_as_one_batch():
    # A model other than the demo base previews three of the dataset's captions, spread over it (first and last
    # included), the trigger word in, each once; all at the size most of the images train at, so that a GPU
    # renders them in one call instead of one call per aspect.
    from types import SimpleNamespace

    from sdxl_lora.sdxl.preview import default_prompts

    buckets = [(1024, 1024), (1152, 896), (1152, 896), (896, 1152), (1152, 896), (1024, 1024)]
    items = [SimpleNamespace(bucket=b) for b in buckets]
    captions = ["sks, a", "sks, b", "sks, b", "sks, c", "sks, d", "sks, e"]
    prompts = default_prompts("/models/other-sdxl", items, captions)
    assert [p.prompt for p in prompts] == ["sks, a", "sks, c", "sks, e"]
    assert {(p.width, p.height) for p in prompts} == {(1152, 896)}
    # Equally common buckets: the first met in the dataset.
    tie = default_prompts("/models/other-sdxl", items[:2], captions[:2])
    assert {(p.width, p.height) for p in tie} == {(1024, 1024)} and len(tie) == 2
    assert default_prompts("/models/other-sdxl", [], []) == []


def test_previews_with_the_same_settings_render_as_one_batch_on_a_cpu_and_draw_the_same_images(tiny_dir, monkeypatch):
    # On a CPU the prompts that share their settings go through the pipeline as one batch (faster previews),
    # each image with its own seed's noise: the same images as one prompt at a time (to a level of rounding),
    # in the prompts' order; a prompt with settings of its own gets a call of its own.
    from diffusers import StableDiffusionXLPipeline

    from sdxl_lora.sdxl import preview

    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red star", "a red star", preview.PreviewPrompt("a blue circle", steps=2), "a green square",
               "a grey triangle"]
    kw = dict(seed=3, steps=3, guidance=5.0, width=64, height=64)
    calls = []
    call = type(pipe).__call__
    monkeypatch.setattr(type(pipe), "__call__", lambda self, **k: calls.append(
        len(k["generator"]) if isinstance(k["generator"], list) else 1) or call(self, **k))
    batched = preview.render(pipe, prompts, **kw)
    assert calls == [2, 1, 2]
    calls.clear()
    single = preview.render(pipe, prompts, batch=1, **kw)  # render's batch: at most one prompt a call
    assert calls == [1] * 5
    diff = [np.abs(np.asarray(a, int) - np.asarray(b, int)).max() for a, b in zip(batched, single)]
    assert max(diff) <= 1, diff
    assert np.abs(np.asarray(batched[0], int) - np.asarray(batched[1], int)).max() > 10  # seeds 3 and 4


def test_previews_on_a_gpu_render_in_batches_and_decode_each_image_on_its_own():
    # On a GPU render() takes up to `batch` prompts of the same settings a call, with the VAE decoding a batch
    # one image at a time for the call only (the decode's peak stays one image's); a VAE that cannot do that
    # gets one prompt a call. A stand-in pipeline on a "cuda" device records each call: nothing runs on a GPU.
    from types import SimpleNamespace

    from PIL import Image

    from sdxl_lora.sdxl import preview

    calls = []

    class SlicingVAE:
        use_slicing = False

        def enable_slicing(self):
            self.use_slicing = True

        def disable_slicing(self):
            self.use_slicing = False

    class Pipe:
        unet = SimpleNamespace(device=torch.device("cuda"))

        def __init__(self, vae):
            self.vae = vae

        def __call__(self, prompt, generator, width, height, **kw):
            n = len(prompt) if isinstance(prompt, list) else 1
            calls.append((n, getattr(self.vae, "use_slicing", None)))
            return SimpleNamespace(images=[Image.new("RGB", (width, height))] * n)

    prompts = ["a red star", "a blue circle", "a green square", "a grey triangle", "a red circle"]
    kw = dict(seed=3, steps=3, guidance=5.0, width=64, height=64)
    vae = SlicingVAE()
    assert len(preview.render(Pipe(vae), prompts, batch=4, **kw)) == 5
    assert calls == [(4, True), (1, True)] and not vae.use_slicing  # sliced for the render, as it was after it
    calls.clear()
    assert len(preview.render(Pipe(SimpleNamespace()), prompts, batch=4, **kw)) == 5
    assert calls == [(1, None)] * 5
    calls.clear()
    preview.render(Pipe(SlicingVAE()), prompts, **kw)  # no batch given: one at a time on a GPU
    assert calls == [(1, False)] * 5


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_training_loads_the_frozen_unet_in_its_compute_dtype_and_a_base_to_quantize_as_before(
        tiny_dir, monkeypatch, quantize):
    # A bf16 run's UNet was read as fp32 (10 GiB of host memory for SDXL's 2.6B weights, and a cast of each)
    # only to be cast to bf16 at set-up. It is read in bf16 now, the same values; the text encoders and the VAE
    # stay fp32. A base to quantize is read as before, so its 4-bit blocks come from the file's values.
    from types import SimpleNamespace

    from sdxl_lora.sdxl.config import ModelConfig
    from sdxl_lora.sdxl import task as sdxl_task
    from sdxl_lora.sdxl.model import load_pipeline

    fp32 = load_pipeline(ModelConfig(path=str(tiny_dir)))
    bf16 = load_pipeline(ModelConfig(path=str(tiny_dir)), unet_dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.unet.parameters()} == {torch.bfloat16}
    for name in ("vae", "text_encoder", "text_encoder_2"):
        assert {p.dtype for p in getattr(bf16, name).parameters()} == {torch.float32}, name
    for (k, a), b in zip(fp32.unet.state_dict().items(), bf16.unet.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16), b), k
    # On a GPU the UNet is read straight onto the device and cast there (Accelerate's one-device map, the path a
    # GPU takes, here onto the host): the same values, and a plain module, not one dispatched over devices.
    placed = load_pipeline(ModelConfig(path=str(tiny_dir)), unet_dtype=torch.bfloat16, unet_device=torch.device("cpu"))
    assert not hasattr(placed.unet, "hf_device_map")
    assert all(torch.equal(a, b) for a, b in zip(bf16.unet.state_dict().values(), placed.unet.state_dict().values()))
    # Training reads the text encoders as their files store them (the demo base's: fp16; the tiny model's: fp32)
    # and casts them to fp32 only when they encode.
    from sdxl_lora.sdxl.config import DEMO_DIR

    for folder, dtype in ((DEMO_DIR, torch.float16), (tiny_dir, torch.float32)):
        stored = load_pipeline(ModelConfig(path=str(folder)), encoders_as_stored=True)
        for name in ("text_encoder", "text_encoder_2"):
            assert {p.dtype for p in getattr(stored, name).parameters()} == {dtype}, (folder, name)

    asked = []

    class Loaded(Exception):
        pass

    def recording(cfg, **kw):
        asked.append((kw.get("unet_dtype"), kw.get("unet_device")))
        raise Loaded

    monkeypatch.setattr(sdxl_task, "load_pipeline", recording)
    for device, budget in (("cpu", None), ("cuda", None), ("cuda", 12)):
        t = sdxl_task.SDXLTask(load_config(extra={"model.path": str(tiny_dir), "model.quantize": quantize}))
        t._budget = None  # set-up alone, with the budget's field as the config gives it
        t.cfg.train.vram_gb = budget
        with pytest.raises(Loaded):
            t.setup(SimpleNamespace(device=torch.device(device), mixed_precision="bf16"), run=None)
    # The UNet goes to a GPU at once unless it is to be quantized (its layers wait on the host and go one at a
    # time) or the run has a memory budget (its caching phase holds the VAE and the text encoders alone).
    dtype = torch.bfloat16 if quantize == "none" else None
    assert asked == [(dtype, None), (dtype, torch.device("cuda") if quantize == "none" else None), (dtype, None)]
