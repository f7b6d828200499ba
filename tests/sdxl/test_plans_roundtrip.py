"""Every kind of plan (topology, cross-attn, a rank budget, a rank schedule) trains on the tiny model,
exports, and reloads in diffusers with the trained model's outputs; the rank schedule shrinks by SVD
(exact when the update's rank fits), the export carries the final ranks, and a resume across a shrink
gives the same adapter as a run that was never stopped."""
import pytest
import torch
from safetensors.torch import load_file

from sdxl_lora.core import inject
from sdxl_lora.core.config import load_config
from sdxl_lora.core.runs import create_run, read_events
from sdxl_lora.sdxl.task import SDXLTask
from sdxl_lora.core.loop import Trainer


def unet_inputs(unet):
    g = torch.Generator().manual_seed(5)
    c = unet.config
    s = c.sample_size
    return dict(sample=torch.randn(1, c.in_channels, s, s, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 77, c.cross_attention_dim, generator=g),
                added_cond_kwargs={"text_embeds": torch.randn(1, c.projection_class_embeddings_input_dim
                                                              - 6 * c.addition_time_embed_dim, generator=g),
                                   "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]])})


def train(tmp_path, name, steps, **settings):
    # The random-weights tiny SDXL: the outputs are compared with tiny_dir's (the same model).
    cfg = load_config(extra={"output.runs_dir": str(tmp_path), "output.name": name, "train.steps": steps,
                             "preview.prompts": "", "train.lr": 3e-3, "model.path": "tiny-sdxl", **settings})
    run = create_run(cfg) if not (tmp_path / name).exists() else None
    task = SDXLTask(cfg)
    trainer = Trainer(cfg, task, run)
    trainer.setup()
    return trainer.fit(), task


@pytest.mark.parametrize("settings", [
    {"adapter.preset": "topology"},
    {"adapter.preset": "cross-attn"},
    {"adapter.rank_budget": 40_000},
    {"adapter.rank": 8, "adapter.rank_schedule": {2: 4}, "adapter.preset": "attn"},
], ids=["topology", "cross-attn", "budget", "schedule"])
def test_plan_trains_exports_and_reloads_with_the_same_outputs(tmp_path, tiny_dir, settings, shared_cache):
    from diffusers import StableDiffusionXLPipeline

    result, task = train(tmp_path, "r", 3, **settings, **{"data.cache_dir": str(shared_cache)})
    trained = task.pipe.unet.eval()
    x = unet_inputs(trained)
    with torch.no_grad():
        want = trained(**x).sample
    base = StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), local_files_only=True)
    with torch.no_grad():
        before = base.unet(**x).sample
    assert (want - before).abs().max() > 1e-4  # the adapter does something
    for kind, path in result.adapter.items():
        pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), local_files_only=True)
        pipe.load_lora_weights(str(path))
        with torch.no_grad():
            got = pipe.unet(**x).sample
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{kind} export of {settings}")
    # The export's ranks are the plan's ranks at the end (after any schedule).
    sd = load_file(result.adapter["diffusers"])
    ranks = {k.removeprefix("unet.").removesuffix(".lora_A.weight"): v.shape[0]
             for k, v in sd.items() if k.endswith("lora_A.weight")}
    assert ranks == task.plan.rank
    if "adapter.rank_schedule" in settings:  # shrunk at step 2 to base rank 4: half of every planned rank
        ev = [e for e in read_events(result.run.dir / "events.jsonl") if e["event"] == "rank_schedule"]
        assert [(e["step"], e["base_rank"]) for e in ev] == [(2, 4)]
        assert task.plan.rank == {n: max(1, round(r / 2)) for n, r in task.planned.rank.items()}
        assert ev[0]["trainable_params"] == task.plan.trainable_params < task.planned.trainable_params
        kohya = load_file(result.adapter["kohya"])
        assert sorted(v.shape[0] for k, v in kohya.items() if k.endswith("lora_down.weight")) == \
            sorted(task.plan.rank.values())


def test_svd_truncation_keeps_an_update_that_fits_and_is_the_best_approximation_otherwise():
    torch.manual_seed(0)
    layer = torch.nn.Sequential()
    layer.add_module("proj", torch.nn.Linear(24, 20))
    plan = inject.Plan([inject.Slot("proj", "mid", None, None, "", "other", "proj", 24, 20, False)],
                       {"proj": 8}, {"proj": 16.0}, base_rank=8)
    inject.apply_plan(layer, plan)
    lora = layer.proj
    with torch.no_grad():
        # An update of rank 3 spread over the 8 factors: truncating to 4 must keep it exactly.
        lora.lora_B["default"].weight.copy_(torch.randn(20, 3) @ torch.randn(3, 8))
    x = torch.randn(5, 24)
    with torch.no_grad():
        want = layer(x)
    shrunk = inject.shrink_adapters(layer, plan, {"proj": 4})
    assert shrunk.rank == {"proj": 4} and shrunk.alpha == {"proj": 8.0}
    assert lora.lora_A["default"].weight.shape == (4, 24) and lora.r["default"] == 4
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5)
        # A full-rank update: rank 2 keeps the two largest singular directions of up @ down.
        lora.lora_B["default"].weight.copy_(torch.randn(20, 4))
        product = lora.lora_B["default"].weight @ lora.lora_A["default"].weight
    inject.shrink_adapters(layer, shrunk, {"proj": 2})
    u, s, vh = torch.linalg.svd(product)
    best = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
    got = lora.lora_B["default"].weight @ lora.lora_A["default"].weight
    torch.testing.assert_close(got, best, rtol=1e-4, atol=1e-5)


def test_resume_across_a_shrink_gives_the_same_adapter(tmp_path, monkeypatch, shared_cache):
    from sdxl_lora.core import checkpoint
    from sdxl_lora.core.runs import Run

    settings = {"adapter.rank": 8, "adapter.rank_schedule": {2: 4}, "train.save_every": 3,
                "data.cache_dir": str(shared_cache)}
    full, _ = train(tmp_path, "full", 5, **settings)

    def crash(kind, n):
        if kind == "step" and n == 5:
            raise RuntimeError("simulated crash in step 5")

    monkeypatch.setattr(checkpoint, "test_fault", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tmp_path, "part", 5, **settings)
    monkeypatch.undo()
    run = Run(tmp_path / "part")
    state = checkpoint.newest_valid(run.checkpoints_dir)
    assert state is not None and "3" in state.name  # saved after the shrink at step 2
    cfg = load_config(run.dir / "config.toml")
    t = Trainer(cfg, SDXLTask(cfg), run, resume=state)
    t.setup()
    want = inject.scheduled_ranks(t.task.planned, t.task.planned, 4, cfg.adapter.min_rank)
    assert t.task.plan.rank == want != t.task.planned.rank  # the shapes the schedule gave by step 3
    result = t.fit()
    a = load_file(full.adapter["diffusers"])
    b = load_file(result.adapter["diffusers"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
