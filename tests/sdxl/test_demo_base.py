"""The demo base (docs/demo_base.md): the synthetic shapes, the concept detector, the pretraining stages
on the project's Trainer, the preview hook, and the shipped base drawing its shapes."""
from __future__ import annotations

import math

import pytest
import torch

from sdxl_lora.sdxl.config import ModelConfig, PreviewConfig, SDXLConfig as Config, TrainConfig
from sdxl_lora.core.runs import Run
from sdxl_lora.sdxl.demo import pretrain, shapes
from sdxl_lora.core.loop import Trainer


def _specs(shape: str, n: int = 6) -> list[shapes.Spec]:
    """n images of `shape`, colours, backgrounds, sizes and positions varied."""
    colours, bgs = list(shapes.COLOURS), list(shapes.BACKGROUNDS)
    return [shapes.Spec(shape, colours[i % len(colours)], bgs[i % len(bgs)], 0.42 + 0.03 * i, 0.58 - 0.03 * i,
                        0.2 + 0.025 * i) for i in range(n)]


@pytest.mark.parametrize("size", [64, 128])
def test_detector_knows_the_generators_shapes_and_colours(size):
    chance = 1 / len(shapes.SHAPES)
    for shape in shapes.SHAPES:
        specs = _specs(shape)
        images = shapes.render(specs, size)
        assert shapes.concept_score(images, shape) > 0.8, shape
        assert shapes.concept_scores(images[:1], f"{specs[0].colour} {shape}")[0] > 0.7
        for d, sp in zip(shapes.detect(images), specs):
            assert d.shape[shape] > 0.7 and d.colour[sp.colour] > 0.8, (sp, d)
            assert all(d.shape[o] < 0.1 for o in shapes.SHAPES if o != shape), (sp, d)
            assert all(d.colour[c] < 0.1 for c in shapes.COLOURS if c != sp.colour), (sp, d)
    # What is no shape scores low for every shape: noise (an untrained model's renders), a blank image.
    noise = torch.rand(4, 3, size, size, generator=torch.Generator().manual_seed(0))
    # Blotchy colour noise, like an untrained model's renders.
    blotches = torch.nn.functional.interpolate(torch.rand(4, 3, size // 8, size // 8,
                                                          generator=torch.Generator().manual_seed(1)),
                                               size=(size, size), mode="bilinear")
    blank = torch.full((1, 3, size, size), 0.5)
    for shape in shapes.SHAPES:
        assert shapes.concept_score(noise, shape) < chance / 2
        assert shapes.concept_score(blotches, shape) < chance / 2
        assert shapes.concept_score(blank, shape) < chance / 2
    with pytest.raises(ValueError, match="the detector knows the shapes"):
        shapes.concept_score(noise, "hexagon")


def test_synthetic_set_is_deterministic_and_never_shows_the_new_concept():
    a = [shapes.spec(0, i) for i in range(2000)]
    assert a == [shapes.spec(0, i) for i in range(2000)]
    assert {s.shape for s in a} == set(shapes.BASE_SHAPES)          # the base never sees a star
    assert len({s.caption for s in a}) == len(shapes.all_captions())  # every caption occurs
    assert shapes.spec(1, 0) != shapes.spec(0, 0)
    assert torch.equal(shapes.render(a[:3], 32), shapes.render(a[:3], 32))
    assert a[0].caption.startswith(("a ", "an ")) and a[0].caption.endswith(" background")


def test_demo_concept_set_is_captioned_stars(tmp_path):
    from sdxl_lora.sdxl.config import DataConfig
    from sdxl_lora.sdxl import data

    paths = shapes.write_demo_concept(tmp_path / "images", n=4, size=64)
    scanned = data.scan(DataConfig(dirs=[str(tmp_path / "images")], trigger_word=shapes.DEMO_TRIGGER), 64)
    assert len(scanned.items) == 4 and not scanned.problems
    assert all(it.caption.startswith(f"{shapes.DEMO_TRIGGER}, ") and " star on a " in it.caption
               for it in scanned.items)
    from PIL import Image
    assert shapes.concept_score([Image.open(p) for p in paths], "star") > 0.8
    prompts = shapes.write_demo_prompts(tmp_path / "prompts.txt").read_text().splitlines()
    trigger = [p for p in prompts if p.startswith(f"{shapes.DEMO_TRIGGER}, ")]
    others = [p for p in prompts if p not in trigger]
    # Prompts with the trigger ask for the star; the others, without it, for shapes the base knows.
    assert trigger and all(f" {shapes.DEMO_CONCEPT} " in p for p in trigger)
    assert others and all(shapes.DEMO_TRIGGER not in p and shapes.DEMO_CONCEPT not in p for p in others)
    assert all(any(s in p.split() for s in shapes.BASE_SHAPES) for p in others)


def test_sample_data_is_the_generators_demo_concept(tmp_path):
    """sample_data/ is exactly what its script makes: the demo concept, the prior shapes and the prompts,
    nothing else."""
    from sdxl_lora.core.config import SAMPLE_DATA

    paths = shapes.write_demo_set(tmp_path / "images")
    captions = [p.with_suffix(".txt").read_text() for p in paths]
    assert sum(c.startswith(f"{shapes.DEMO_TRIGGER}, ") for c in captions) == 16  # the stars
    prior = [c for c in captions if shapes.DEMO_TRIGGER not in c]
    assert len(prior) == 48 and not any(shapes.DEMO_CONCEPT in c for c in prior)  # three to a star
    assert {c.split()[2] for c in prior} <= set(shapes.BASE_SHAPES)
    shapes.write_demo_prompts(tmp_path / "prompts.txt")
    made = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert sorted(p.name for p in (SAMPLE_DATA / "images").iterdir()) == made
    from PIL import Image

    for name in made:
        a, b = SAMPLE_DATA / "images" / name, tmp_path / "images" / name
        if name.endswith(".png"):
            assert Image.open(a).tobytes() == Image.open(b).tobytes(), name
        else:
            assert a.read_text() == b.read_text(), name
    assert (SAMPLE_DATA / "prompts.txt").read_text() == (tmp_path / "prompts.txt").read_text()


def test_preview_concept_hook_writes_the_score_event(tmp_path):
    run = Run(tmp_path)
    star = shapes.render(_specs("star", 1), 64)
    circle = shapes.render(_specs("circle", 1), 64)
    images = shapes.to_pil(torch.cat([star, circle, circle]))
    out = shapes.report_concept(run, 7, "star", ["sks, a red star", "sks, a blue star", "a circle"], images)
    # Only the prompts naming the concept count: one star drawn, one missed.
    assert out["score"] == pytest.approx(0.5, abs=0.05)
    (event,) = [e for e in run.events() if e["event"] == "concept"]
    assert event["step"] == 7 and event["concept"] == "star"
    assert set(event["prompts"]) == {"sks, a red star", "sks, a blue star"}
    # Prompts that do not name it (a user's own prompts): nothing scored, no event.
    assert shapes.report_concept(run, 8, "star", ["a circle"], images[:1]) is None
    assert len([e for e in run.events() if e["event"] == "concept"]) == 1


def test_concept_event_measures_the_prompts_without_the_concept(tmp_path):
    """The prompts without the trigger: each one's own shape scored, and how far it moved from the base's
    render (the baseline), pixel by pixel."""
    run = Run(tmp_path)
    star, circle, square = (shapes.render(_specs(s, 1), 64) for s in ("star", "circle", "square"))
    prompts = ["sks, a red star", "a red circle", "a blue square"]
    base = shapes.to_pil(torch.cat([circle, circle, square]))
    # After training: the star appears with the trigger; the circle prompt kept its circle, the square one
    # turned into a star (what a drifting adapter does).
    after = shapes.to_pil(torch.cat([star, circle, star]))
    out = shapes.report_concept(run, 5, "star", prompts, after, baseline=base)
    (event,) = [e for e in run.events() if e["event"] == "concept"]
    assert event["score"] > 0.8 and set(event["prompts"]) == {"sks, a red star"}
    assert event["others"]["a red circle"]["shape"] == "circle" and event["others"]["a red circle"]["score"] > 0.8
    assert event["others"]["a blue square"]["score"] < 0.1
    assert event["others"]["a red circle"]["change"] == 0.0 and event["others"]["a blue square"]["change"] > 0.02
    assert event["others_score"] == pytest.approx(out["others_score"]) and 0.4 < event["others_score"] < 0.6
    assert event["others_change"] == pytest.approx(event["others"]["a blue square"]["change"] / 2, abs=1e-4)
    # Without a baseline (the step-0 preview itself, or previews.before off): no pixel change.
    shapes.report_concept(run, 0, "star", prompts, base)
    first = [e for e in run.events() if e["event"] == "concept"][-1]
    assert "others_change" not in first and "change" not in first["others"]["a red circle"]


def _stage_config(**train) -> Config:
    return Config(train=TrainConfig(device="cpu", log_every=1, save_every=0, save_every_minutes=0, **train),
                  preview=PreviewConfig(prompts="", before=False, after=False))


def test_pretraining_stages_train_every_parameter_and_learn(tmp_path):
    """Both stages on the project's Trainer at a tiny size: finite losses, the fixed evaluation falls,
    and the base saved in fp16 loads back as a diffusers SDXL folder with the measured latent scale."""
    from sdxl_lora.sdxl.model import load_pipeline

    torch.manual_seed(0)
    demo = pretrain.DemoConfig(resolution=32, latent_bank=8, eval_images=4)
    pipe = pretrain.build_pipeline(tmp_path / "build", seed=0)
    results = {}
    for name, task_cls, train in (("vae", pretrain.VAEStage, dict(steps=8, batch_size=4, lr=2e-3)),
                                  ("unet", pretrain.UNetStage, dict(steps=8, batch_size=4, lr=1e-3))):
        if name == "unet":
            scale = pretrain.measure_latent_scale(pipe.vae, 0, 32, "cpu", n=16)
            pipe.vae.register_to_config(scaling_factor=scale)
        cfg = _stage_config(**train)
        (tmp_path / name).mkdir()
        trainer = Trainer(cfg, task_cls(cfg, demo, pipe), Run(tmp_path / name))
        trainer.setup()
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        assert len(trainable) == len(list(trainer.model.parameters()))  # full training, not an adapter
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        result = trainer.fit()
        results[name] = result
        assert result.interrupted is None and result.steps == train["steps"]
        assert all(math.isfinite(x) for x in result.losses)
        assert result.eval_after < result.eval_before, name
        changed = sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        assert changed > 0.9 * len(before), name
        assert all(p.is_file() for p in result.adapter.values())
    out = pretrain.save_base(pipe, tmp_path / "tiny-sdxl-demo")
    assert pretrain.weights_size(out) <= 30e6
    loaded = load_pipeline(ModelConfig(path=str(out)))
    assert loaded.vae.config.scaling_factor == pytest.approx(scale)
    assert loaded.unet.dtype == torch.float32  # fp16 on disk, fp32 when loaded for training


def test_shipped_demo_base_draws_its_shapes():
    """The shipped base draws the shape and the colour a prompt asks for: for each training shape, the
    detector's P(asked shape) is above chance and above every other shape's, the clearest shape scores
    well above chance, and the asked colour wins (chance 1/6). Six renders a shape, two on each background:
    the detector's square is strict (rounded corners cost it its fill), and one render of a square may read
    as a circle."""
    folder = pretrain.SHIPPED
    if not (folder / "model_index.json").is_file():
        pytest.fail(f"the demo base weights are absent: {folder} has no model_index.json. Make them with "
                    "`python scripts/pretrain_demo.py --out OUT` on a GPU (docs/demo_base.md) and copy "
                    f"OUT/tiny-sdxl-demo to {folder}")
    from sdxl_lora.sdxl.model import load_pipeline

    assert pretrain.weights_size(folder) <= 30e6
    pipe = load_pipeline(ModelConfig(path=str(folder)))
    scores, images = pretrain.render_and_score(pipe, per_shape=6, size=128, steps=20, guidance=5.0, device="cpu")
    for shape, imgs in zip(shapes.BASE_SHAPES, images):
        found = shapes.detect(imgs)
        mean = {s: sum(d.shape[s] for d in found) / len(found) for s in shapes.SHAPES}
        assert mean[shape] > pretrain.chance(), (shape, mean)
        assert all(mean[shape] > mean[o] for o in shapes.SHAPES if o != shape), (shape, mean)
        assert scores[shape]["colour"] > 0.5, (shape, scores)
    assert max(s["shape"] for s in scores.values()) > 2 * pretrain.chance(), scores


def test_pretraining_encodes_prompts_as_the_sdxl_pipeline_does(tmp_path):
    """What the UNet learns from in pretraining is what diffusers' pipeline feeds it when rendering:
    the same prompt embeddings and pooled embedding, and zeros for the unconditional half."""
    pipe = pretrain.build_pipeline(tmp_path, seed=0)
    caption = shapes.spec(0, 3).caption
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(prompt=caption, device="cpu", num_images_per_prompt=1,
                                                         do_classifier_free_guidance=True)
    seen = {}
    unet_forward = pipe.unet.forward

    def spy(sample, t, encoder_hidden_states, added_cond_kwargs, **kw):
        seen["embeds"], seen["pooled"] = encoder_hidden_states, added_cond_kwargs["text_embeds"]
        return unet_forward(sample, t, encoder_hidden_states=encoder_hidden_states,
                            added_cond_kwargs=added_cond_kwargs, **kw)

    pipe.unet.forward = spy
    net = pretrain.Denoiser(pipe).eval()
    ids1, ids2 = pretrain.tokenize(pipe.tokenizer, [caption] * 2), pretrain.tokenize(pipe.tokenizer_2, [caption] * 2)
    with torch.no_grad():
        net(torch.zeros(2, 4, 4, 4), torch.tensor([10, 10]), ids1, ids2, torch.tensor([1.0, 0.0]),
            torch.full((2, 6), 32.0))
    torch.testing.assert_close(seen["embeds"][0], embeds[0])
    torch.testing.assert_close(seen["pooled"][0], pooled[0])
    assert not neg.any() and not neg_pooled.any()  # force_zeros_for_empty_prompt: the dropped captions
    assert not seen["embeds"][1].any() and not seen["pooled"][1].any()


def _digest(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_default_job_trains_on_the_demo_base_and_reports_the_concept(tmp_path, capsys):
    """`sdxl-lora train` with only a short length: the demo base is the model (read where it ships,
    never written), the previews are scored for the star before and after, and the summary says so."""
    from sdxl_lora.cli import main
    from sdxl_lora.core.config import load_config

    shipped = _digest(pretrain.SHIPPED)
    assert main(["train", "--out", str(tmp_path), "--name", "d", "--steps", "2", "--set", "preview.steps=2"]) == 0
    assert _digest(pretrain.SHIPPED) == shipped
    assert load_config(tmp_path / "d" / "config.toml").model.path == "tiny-sdxl-demo"
    events = Run(tmp_path / "d").events()
    concept = [e for e in events if e["event"] == "concept"]
    assert [e["step"] for e in concept] == [0, 2] and all(e["concept"] == "star" for e in concept)
    trigger = [p for p in shapes.DEMO_PROMPTS if p.startswith(shapes.DEMO_TRIGGER)]
    others = [p for p in shapes.DEMO_PROMPTS if p not in trigger]
    for e in concept:
        assert sorted(e["prompts"]) == sorted(trigger) and sorted(e["others"]) == sorted(others)
        assert 0 <= e["score"] <= 1 and 0 <= e["others_score"] <= 1
    assert "others_change" not in concept[0] and 0 <= concept[1]["others_change"] < 1
    out = capsys.readouterr().out
    assert "concept    : 'star' " in out and "(step 0 -> 2;" in out
    assert "others     : own shape " in out and "mean pixel change from the base" in out
