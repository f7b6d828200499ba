"""Speed levers give the same training signal as the plain path: the same loss and the same adapter
gradients on the tiny UNet (channels_last, regional compilation, selective checkpointing), and the
profiler leaves a trace and a breakdown in the run folder. CUDA graphs need a GPU; their equality check
runs in benchmarks/sdxl_step.py (benchmarks/RESULTS.md)."""
import json

import pytest
import torch

from sdxl_lora import inject, speed
from sdxl_lora.config import AdapterConfig


def tiny_unet_with_lora(tiny_dir):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(tiny_dir / "unet"), local_files_only=True)
    plan = inject.make_plan(unet, AdapterConfig(preset="full", rank=4), resolution=128, native=128)
    inject.apply_plan(unet, plan)
    # Non-zero up projections, so every adapter has a gradient and changes the output.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_B" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return unet


def batch_for(unet, b=2):
    g = torch.Generator().manual_seed(0)
    cfg = unet.config
    size = cfg.sample_size
    return dict(
        sample=torch.randn(b, cfg.in_channels, size, size, generator=g),
        timestep=torch.tensor([100, 700][:b]),
        encoder_hidden_states=torch.randn(b, 77, cfg.cross_attention_dim, generator=g),
        added_cond_kwargs={"text_embeds": torch.randn(b, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim, generator=g),
                           "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]] * b)})


def loss_and_grads(unet, batch):
    unet.zero_grad(set_to_none=True)
    out = unet(**batch).sample
    loss = (out.float() ** 2).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in unet.named_parameters() if p.requires_grad}


def assert_same(ref, got, rtol=1e-4, atol=1e-6):
    assert got[0] == pytest.approx(ref[0], rel=rtol)
    assert ref[1].keys() == got[1].keys() and ref[1]
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], rtol=rtol, atol=atol, msg=n)


def test_channels_last_same_loss_and_gradients(tiny_dir):
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    speed.to_channels_last(unet)
    conv = next(m for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert_same(ref, loss_and_grads(unet, batch))


def test_regional_compile_same_loss_and_gradients(tiny_dir, monkeypatch):
    # aot_eager: dynamo's graph capture and AOTAutograd's forward/backward split, as with inductor,
    # without a C++ build per graph (minutes on 2 CPU cores).
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    n = speed.compile_regions(unet)
    n_expected = sum(type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D") for m in unet.modules())
    assert n == n_expected > 0
    assert_same(ref, loss_and_grads(unet, batch))
    torch._dynamo.reset()


def test_selective_checkpointing_measures_chooses_and_keeps_gradients(tiny_dir):
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    saved = speed.measure_block_activations(unet, lambda: unet(**batch).sample)
    names = [n for n, _ in speed.checkpointable_blocks(unet)]
    assert set(saved) == set(names)
    # The first down block has no adapter and nothing before it trains: it saves nothing for backward,
    # so checkpointing it would buy nothing. Every block after the first adapter saves activations.
    assert saved["down_blocks.0"] == 0
    assert all(v > 0 for k, v in saved.items() if k != "down_blocks.0")

    total = sum(saved.values())
    largest = max(saved, key=saved.get)
    # A budget that fits everything checkpoints nothing; one just under the total takes the largest block.
    assert speed.choose_checkpointed(saved, total + 10, 10) == []
    assert speed.choose_checkpointed(saved, total - 1, 0) == [largest]
    # An impossible budget takes every block, largest first.
    every = speed.choose_checkpointed(saved, 0, 0)
    assert sorted(every) == sorted(set(names) - {"down_blocks.0"}) and every[0] == largest

    chosen = speed.choose_checkpointed(saved, total // 2, 0)
    speed.apply_selective_checkpointing(unet, chosen)
    on = {n for n, b in speed.checkpointable_blocks(unet) if b.gradient_checkpointing}
    assert on == set(chosen) and 0 < len(on) < len(names)
    unet.train()
    assert_same(ref, loss_and_grads(unet, batch))


def test_budgeted_run_and_profile_land_in_the_run_folder(tmp_path):
    from sdxl_lora.cli import main

    rc = main(["train", "--out", str(tmp_path), "--name", "p", "--steps", "4", "--resolution", "64",
               "--set", "preview.prompts=''", "--set", "train.profile_steps=2", "--set", "train.log_every=2",
               "--set", "train.checkpoint_budget_gb=0.001", "--set", "train.save_every=0"])
    assert rc == 0
    run = tmp_path / "p"
    assert (run / "profile" / "trace.json").stat().st_size > 0
    json.loads((run / "profile" / "trace.json").read_text())  # a complete trace, not a cut-off file
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    prof = [e for e in events if e["event"] == "profile"]
    assert len(prof) == 1 and prof[0]["step"] == 4
    for phase in ("data", "forward", "backward", "optimizer"):
        assert phase in prof[0]["summary"]
    ck = [e for e in events if e["event"] == "checkpointing"]
    # A budget below the frozen weights alone: every block that saves activations is checkpointed (with
    # the demo base's recommended LoRA on the ResNet convolutions, all seven), and the run still trains.
    assert ck and sorted(ck[0]["blocks"]) == sorted(["down_blocks.0", "down_blocks.1", "down_blocks.2", "mid_block",
                                                      "up_blocks.0", "up_blocks.1", "up_blocks.2"])
    assert (run / "p.safetensors").is_file()
