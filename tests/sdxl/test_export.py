"""Export and interop: the kohya file loads in diffusers with the training-time output and image, its
names map onto SDXL's real UNet through diffusers' own (independent) mapper, every format imports back
to the same outputs, and merged checkpoints equal base + adapter at that strength.

Adapters are built in-process with peft on the tiny SDXL (random LoRA weights, so every layer matters).
"""
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import unet_io
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdxl_lora.sdxl.formats import export
from sdxl_lora.core import inject
from sdxl_lora.sdxl import slots as unet_slots
from sdxl_lora.cli import main
from sdxl_lora.sdxl.config import AdapterConfig

PROMPT = "a red circle on a white background"


pytestmark = pytest.mark.usefixtures("one_thread")


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _plan(unet, mixed_alpha: bool):
    """Mixed ranks (as the injector's policies make them); alpha 3 (not the rank), or mixed too."""
    plan = unet_slots.make_plan(unet, AdapterConfig(preset="attn", rank=4, alpha=3.0))
    for i, s in enumerate(plan.targets):
        plan.rank[s.name] = 8 if i % 3 == 1 else 4
        plan.alpha[s.name] = 6.0 if mixed_alpha and i % 3 == 2 else 3.0
    return plan


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):
    """The tiny pipeline with a peft adapter as training leaves it (mixed ranks, alpha != rank), its
    UNet output on fixed inputs, and its kohya export."""
    pipe = unet_io.pipe(tiny_dir)
    plan = _plan(pipe.unet, mixed_alpha=False)
    inject.apply_plan(pipe.unet, plan)
    _randomize(pipe.unet, 1)
    pipe.unet.eval()
    inputs = unet_io.inputs(pipe.unet)
    d = tmp_path_factory.mktemp("export")
    kohya_file = export.save_kohya_lora(pipe.unet, d / "k.safetensors", metadata={"modelspec.title": "t"})
    return SimpleNamespace(pipe=pipe, unet=pipe.unet, plan=plan, inputs=inputs,
                           ref=unet_io.out(pipe.unet, inputs), dir=d, kohya=kohya_file)


@pytest.fixture(scope="module")
def mixed(tiny_dir):
    """A UNet whose adapter has mixed ranks and mixed alphas (rank_pattern and alpha_pattern both used)."""
    unet = unet_io.fresh_unet(tiny_dir)
    plan = _plan(unet, mixed_alpha=True)
    inject.apply_plan(unet, plan)
    _randomize(unet, 2)
    unet.eval()
    inputs = unet_io.inputs(unet)
    return SimpleNamespace(unet=unet, plan=plan, inputs=inputs, ref=unet_io.out(unet, inputs))


# ---------------------------------------------------------------------------------------- kohya


def test_kohya_keys_are_sgm_names_with_each_layers_true_alpha(mixed, tmp_path):
    path = export.save_kohya_lora(mixed.unet, tmp_path / "m.safetensors", uniform_alpha=False)
    sd = load_file(path)
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    assert {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"} <= sd.keys()
    assert "lora_unet_output_blocks_5_1_transformer_blocks_0_attn2_to_out_0.alpha" in sd
    assert len(sd) == 3 * len(mixed.plan.targets)
    assert not any("down_blocks" in k or "up_blocks" in k or "mid_block" in k for k in sd)
    from sdxl_lora.sdxl.formats.single_file import map_module_path, unet_diffusers_to_sgm
    m = unet_diffusers_to_sgm(dict(mixed.unet.config))
    for s in mixed.plan.targets:
        k = "lora_unet_" + map_module_path(s.name, m).replace(".", "_")
        assert sd[f"{k}.alpha"].item() == mixed.plan.alpha[s.name]
        assert sd[f"{k}.lora_down.weight"].shape[0] == mixed.plan.rank[s.name]
    assert {sd[k].item() for k in sd if k.endswith(".alpha")} == {3.0, 6.0}

    # By default one alpha for all, each layer's own folded into its up weights: the same update.
    uni = load_file(export.save_kohya_lora(mixed.unet, tmp_path / "u.safetensors"))
    assert uni.keys() == sd.keys() and {uni[k].item() for k in uni if k.endswith(".alpha")} == {3.0}
    for k in (k for k in sd if k.endswith(".alpha")):
        n = k.removesuffix(".alpha")
        torch.testing.assert_close(uni[k] * uni[f"{n}.lora_up.weight"], sd[k] * sd[f"{n}.lora_up.weight"])
    with safe_open(str(tmp_path / "u.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_network_args"])["training_alphas_folded"] == [3.0, 6.0]


def test_kohya_metadata_marks_sdxl_and_holds_no_absolute_path(trained, tmp_path):
    meta = {**export.training_metadata(title="run", steps=3, resolution=1024, trigger_phrase="ohwx",
                                       base_model=str(tmp_path / "models" / "sdxl.safetensors"),
                                       datasets={"images": [("ohwx, red", 2), ("blue", 2)]}),
            "note": str(tmp_path / "secret" / "file.txt")}
    path = export.save_kohya_lora(trained.unet, tmp_path / "a.safetensors", metadata=meta)
    with safe_open(str(path), "pt") as f:
        got = f.metadata()
    assert got["ss_base_model_version"] == "sdxl_base_v1-0"
    assert got["ss_network_module"] == "networks.lora"
    assert got["ss_network_dim"] == "4" and got["ss_network_alpha"] == "3"
    assert got["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert got["modelspec.title"] == "run" and got["modelspec.trigger_phrase"] == "ohwx"
    assert got["modelspec.resolution"] == "1024x1024" and got["ss_resolution"] == "(1024, 1024)"
    assert got["ss_steps"] == "3" and got["ss_num_train_images"] == "4"
    assert json.loads(got["ss_dataset_dirs"]) == {"images": {"n_repeats": 2, "img_count": 2}}
    assert json.loads(got["ss_tag_frequency"])["images"]["ohwx"] == 1
    assert got["ss_sd_model_name"] == "sdxl.safetensors" and got["note"] == "file.txt"
    assert not any(str(tmp_path) in v or v.startswith("/") for v in got.values())
    assert len(got["sshs_model_hash"]) == 64

    bare = export.save_kohya_lora(trained.unet, tmp_path / "bare.safetensors", metadata=False)
    with safe_open(str(bare), "pt") as f:
        assert not f.metadata()
    assert load_file(bare).keys() == load_file(path).keys()

    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        export.save_kohya_lora(trained.unet, path)
    assert path.read_bytes() == before
    export.save_kohya_lora(trained.unet, path, metadata=False, overwrite=True)
    assert path.read_bytes() != before


@pytest.mark.parametrize("names", ["sgm", "diffusers"])
def test_kohya_export_loaded_by_diffusers_gives_the_training_time_unet_output(trained, tiny_dir, names, tmp_path):
    path = trained.kohya if names == "sgm" else export.save_kohya_lora(trained.unet, tmp_path / "d.safetensors",
                                                                         names="diffusers")
    if names == "diffusers":
        assert any(k.startswith("lora_unet_down_blocks_1_attentions_0_") for k in load_file(path))
    pipe = unet_io.pipe(tiny_dir)
    base = unet_io.out(pipe.unet, trained.inputs)
    pipe.load_lora_weights(str(path))
    n = sum(1 for name, _ in pipe.unet.named_modules() if name.endswith(".lora_A.default_0"))
    assert n == len(trained.plan.targets)
    assert (base - trained.ref).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(unet_io.out(pipe.unet, trained.inputs), trained.ref, rtol=0, atol=1e-5)


def test_kohya_export_gives_the_training_time_image_through_generate(trained, tiny_dir, tmp_path):
    """The previews' pipeline (training-time peft UNet) and `sdxl-lora generate --lora` (the kohya file merged into
    a fresh pipeline) render the same image at the same seed, to the rounding of the file's uniform alpha."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    from sdxl_lora.sdxl.preview import render

    p = trained.pipe
    train_pipe = StableDiffusionXLPipeline(
        vae=p.vae, text_encoder=p.text_encoder, text_encoder_2=p.text_encoder_2, tokenizer=p.tokenizer,
        tokenizer_2=p.tokenizer_2, unet=trained.unet, scheduler=EulerDiscreteScheduler.from_config(p.scheduler.config))
    train_pipe.set_progress_bar_config(disable=True)
    ref = render(train_pipe, [PROMPT], seed=5, steps=2, guidance=5.0, width=64, height=64)[0]
    assert main(["generate", "--model", str(tiny_dir), "--lora", str(trained.kohya), "--prompt", PROMPT,
                 "--seed", "5", "--steps", "2", "--size", "64", "--device", "cpu", "--out", str(tmp_path)]) == 0
    got = np.asarray(Image.open(tmp_path / "seed5.png").convert("RGB"), dtype=np.int16)
    want = np.asarray(ref, dtype=np.int16)
    assert np.abs(got - want).max() <= 1
    base = np.asarray(render(unet_io.pipe(tiny_dir), [PROMPT], seed=5, steps=2, guidance=5.0, width=64, height=64)[0],
                      dtype=np.int16)
    assert np.abs(base - want).mean() > 0.5  # without the adapter the image differs


def test_mixed_alphas_load_in_diffusers_at_the_right_strength(mixed, tiny_dir, tmp_path, caplog):
    """diffusers' kohya loader gives attention layers one alpha, so by default the file has one alpha
    and the rest folded into the weights; keeping the training alphas warns."""
    with caplog.at_level(logging.WARNING, logger="sdxl_lora.sdxl.formats.export"):
        export.save_kohya_lora(mixed.unet, tmp_path / "true.safetensors", uniform_alpha=False)
    assert "different alphas" in caplog.text
    _, text = export.inspect_adapter(tmp_path / "true.safetensors", tiny_dir)
    assert "attention layers have different alphas" in text
    path = export.save_kohya_lora(mixed.unet, tmp_path / "u.safetensors")
    pipe = unet_io.pipe(tiny_dir)
    pipe.load_lora_weights(str(path))
    torch.testing.assert_close(unet_io.out(pipe.unet, mixed.inputs), mixed.ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", ["attn", "full"])
def test_full_sdxl_kohya_keys_map_onto_the_unet_through_diffusers_mapper(preset):
    """SDXL base's real architecture (meta device, no weights): diffusers' own sgm -> diffusers mapper
    puts every exported layer on an existing UNet module of the right shape, one to one, none left over."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.lora_conversion_utils import (_convert_non_diffusers_lora_to_diffusers,
                                                         _maybe_map_sgm_blocks_to_diffusers)
    from diffusers.utils import convert_unet_state_dict_to_peft

    from sdxl_lora.sdxl.formats.single_file import unet_config

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config())
        plan = unet_slots.make_plan(unet, AdapterConfig(preset=preset, rank=16))
        inject.apply_plan(unet, plan)
    if preset == "attn":
        assert len(plan.targets) == 560
    sd = export.kohya_state_dict(export.adapter_from_model(unet), unet.config)
    assert len(sd) == 3 * len(plan.targets)
    assert all(k.startswith(("lora_unet_input_blocks_", "lora_unet_middle_block_", "lora_unet_output_blocks_"))
               for k in sd)
    mapped = _maybe_map_sgm_blocks_to_diffusers(dict(sd), unet.config)  # raises if anything is left over
    converted, alphas = _convert_non_diffusers_lora_to_diffusers(mapped)  # raises if any key is not renamed
    peft_sd = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
    assert len(peft_sd) == 2 * len(plan.targets) and len(alphas) == len(plan.targets)
    named = dict(unet.named_modules())
    modules = {}
    for k, v in peft_sd.items():
        module, part = k.rsplit(".lora_", 1)
        assert module in named, f"{k} maps onto no module of the UNet"
        modules.setdefault(module, {})[part] = v.shape
    assert set(modules) == {s.name for s in plan.targets}
    for module, shapes in modules.items():
        base = named[module].base_layer.weight.shape
        assert shapes["A.weight"][1] == base[1] and shapes["B.weight"][0] == base[0]


def test_text_encoder_layers_get_kohya_te1_te2_names_and_round_trip(tiny_dir, tmp_path):
    from peft import LoraConfig, inject_adapter_in_model

    pipe = unet_io.pipe(tiny_dir)
    layers = {}
    for comp in ("text_encoder", "text_encoder_2"):
        te = getattr(pipe, comp)
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=2, target_modules=["q_proj", "v_proj", "fc1"]), te)
        _randomize(te, 3)
        layers.update(export.adapter_from_model(te, comp).layers)
    path = export.save_kohya_lora(export.Adapter(layers), tmp_path / "te.safetensors")
    keys = load_file(path).keys()
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha" in keys
    assert "lora_te2_text_model_encoder_layers_2_mlp_fc1.lora_up.weight" in keys
    back = export.load_adapter(path, tiny_dir)
    assert not back.unknown and back.layers.keys() == layers.keys()
    fresh = unet_io.pipe(tiny_dir)
    for comp in ("text_encoder", "text_encoder_2"):
        export.apply_adapter(getattr(fresh, comp), back, comp)

    def enc(p):
        with torch.no_grad():
            e, _, pooled, _ = p.encode_prompt(PROMPT, device="cpu", num_images_per_prompt=1,
                                              do_classifier_free_guidance=False)
        return e, pooled
    for a, b in zip(enc(fresh), enc(pipe)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------- import


def _write(unet, fmt: str, d: Path) -> Path:
    if fmt == "kohya":
        return export.save_kohya_lora(unet, d / "k.safetensors")
    if fmt == "kohya-true-alpha":
        return export.save_kohya_lora(unet, d / "kt.safetensors", uniform_alpha=False)
    if fmt == "kohya-diffusers-names":
        return export.save_kohya_lora(unet, d / "kd.safetensors", names="diffusers")
    if fmt == "diffusers":
        return export.save_diffusers_lora(unet, d / "d.safetensors")
    if fmt == "diffusers-no-metadata":
        return export.save_diffusers_lora(unet, d / "dn.safetensors", metadata=False)
    return export.save_peft_adapter(unet, d / "peft")


@pytest.mark.parametrize("fmt", ["kohya", "kohya-true-alpha", "kohya-diffusers-names", "diffusers",
                                 "diffusers-no-metadata", "peft"])
def test_export_import_onto_a_fresh_unet_gives_the_same_output(mixed, tiny_dir, tmp_path, fmt):
    path = _write(mixed.unet, fmt, tmp_path)
    adapter = export.load_adapter(path, tiny_dir)
    assert not adapter.unknown
    assert adapter.format.startswith(fmt.split("-")[0])
    assert set(adapter.component("unet")) == {s.name for s in mixed.plan.targets}
    for s in mixed.plan.targets:
        layer = adapter.layers[f"unet.{s.name}"]
        assert layer.rank == mixed.plan.rank[s.name]
        # Without its config a diffusers file has alpha = rank, the scale folded into the weights; a
        # kohya file has one alpha unless asked for the training ones.
        want = {"diffusers-no-metadata": layer.rank, "kohya": 3.0, "kohya-diffusers-names": 3.0}
        assert layer.alpha == want.get(fmt, mixed.plan.alpha[s.name])
    unet = unet_io.fresh_unet(tiny_dir)
    assert export.apply_adapter(unet, adapter) == len(mixed.plan.targets)
    torch.testing.assert_close(unet_io.out(unet, mixed.inputs), mixed.ref, rtol=0, atol=1e-5)


def test_peft_folder_loads_with_peft_itself(mixed, tiny_dir, tmp_path):
    from peft import PeftModel

    folder = export.save_peft_adapter(mixed.unet, tmp_path / "peft")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = PeftModel.from_pretrained(unet_io.fresh_unet(tiny_dir), str(folder))
    torch.testing.assert_close(unet_io.out(model.base_model.model, mixed.inputs), mixed.ref, rtol=0, atol=1e-5)


def test_unknown_keys_are_returned_and_logged_not_dropped(trained, tiny_dir, tmp_path, caplog):
    sd = load_file(trained.kohya)
    extra = {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.hada_w1_a": torch.zeros(2, 2),
             "lora_unet_input_blocks_99_1_nothing.lora_down.weight": torch.zeros(2, 2),
             "lora_unet_input_blocks_99_1_nothing.lora_up.weight": torch.zeros(2, 2),
             "something_else": torch.zeros(1)}
    path = tmp_path / "odd.safetensors"
    save_file({**sd, **extra}, str(path))
    with caplog.at_level(logging.WARNING, logger="sdxl_lora.sdxl.formats.read"):
        adapter = export.load_adapter(path, tiny_dir)
    assert adapter.unknown == sorted(extra)
    assert len(adapter.layers) == len(trained.plan.targets)
    assert "4 of" in adapter.problems[0] and "LyCORIS" in adapter.problems[0]
    assert "name no layer" in caplog.text
    out = tmp_path / "out.safetensors"
    assert main(["export", str(path), "--format", "kohya", "--out", str(out), "--model", str(tiny_dir)]) == 2
    assert not out.exists()
    assert main(["export", str(path), "--format", "kohya", "--out", str(out), "--model", str(tiny_dir),
                 "--drop-unknown"]) == 0
    assert load_file(out).keys() == sd.keys()


# ---------------------------------------------------------------------------------------- a run, the CLI


def _save_run(unet, out: Path, name: str) -> dict:
    """What a finished run does with its adapter: SDXLTask.save_adapter, without the training before it."""
    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.sdxl import data as sdxl_data
    from sdxl_lora.sdxl.task import SDXLTask

    cfg = load_config(None, [], {"output.runs_dir": str(out), "output.name": name, "data.trigger_word": "ohwx"})
    run = create_run(cfg)
    task = SDXLTask(cfg)
    task.dataset, task.resolution = sdxl_data.scan(cfg.data, 128), 128
    task.accelerator = SimpleNamespace(mixed_precision="no")
    return task.save_adapter(unet, run, 3)


@pytest.fixture(scope="module")
def run_dir(trained, tmp_path_factory):
    """A run folder as a finished run leaves it."""
    out = tmp_path_factory.mktemp("runs")
    paths = _save_run(trained.unet, out, "r")
    assert paths == {"kohya": out / "r" / "r.safetensors", "diffusers": out / "r" / "r.diffusers.safetensors"}
    return out / "r"


def test_a_run_writes_kohya_as_main_file_and_diffusers_beside_it(run_dir, trained):
    main_sd, diff_sd = load_file(run_dir / "r.safetensors"), load_file(run_dir / "r.diffusers.safetensors")
    assert all(k.startswith("lora_unet_") for k in main_sd)
    assert all(k.startswith("unet.") and ".lora_" in k for k in diff_sd)
    with safe_open(str(run_dir / "r.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_steps"] == "3" and meta["ss_output_name"] == "r" and meta["modelspec.trigger_phrase"] == "ohwx"
    assert json.loads(meta["ss_dataset_dirs"]) == {"images": {"n_repeats": 1, "img_count": 64}}
    assert meta["ss_sd_model_name"] == "tiny-sdxl-demo" and meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert not any(v.startswith("/") or "/work/" in v for v in meta.values())


def test_cli_export_every_format_from_a_run_folder(run_dir, mixed, tmp_path, capsys):
    d = tmp_path / "d.safetensors"
    assert main(["export", str(run_dir), "--format", "diffusers", "--out", str(d), "--no-metadata"]) == 0
    with safe_open(str(d), "pt") as f:
        assert not f.metadata()
    assert main(["export", str(run_dir), "--format", "peft", "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "adapter_config.json").is_file()
    k = tmp_path / "k.safetensors"
    assert main(["export", str(run_dir / "r.diffusers.safetensors"), "--format", "kohya", "--out", str(k),
                 "--model", "tiny-sdxl"]) == 0
    assert load_file(k).keys() == load_file(run_dir / "r.safetensors").keys()
    with safe_open(str(k), "pt") as f:
        assert f.metadata()["ss_steps"] == "3"  # the description travels with the weights
    capsys.readouterr()
    assert main(["export", str(run_dir), "--format", "kohya", "--out", str(k)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--format", "kohya", "--out", str(k), "--overwrite"]) == 0


def test_cli_inspect_shows_format_base_blocks_metadata_and_problems(run_dir, tmp_path, capsys):
    assert main(["inspect", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "format     : kohya" in text and "ss_base_model_version=sdxl_base_v1-0" in text
    assert "input_blocks.4.1" in text and "down_blocks.1.attentions.0" in text
    assert "rank       : 4, 8" in text and "alpha      : 3" in text
    assert "ss_steps = 3" in text
    # Checked against the model the run trained on (the tiny one): nothing wrong with it.
    assert "problems   : none" in text and "do not fit" not in text and "SDXL's take" not in text
    # Against SDXL base, its shapes and its cross-attention width are flagged: it will not load there.
    assert main(["inspect", str(run_dir), "--model", "arch:sdxl"]) == 0
    text = capsys.readouterr().out
    assert "layers do not fit the model's shapes" in text and "SDXL's take 2048" in text


def test_inspecting_a_runs_adapter_file_checks_it_against_the_model_the_run_trained_on(run_dir, tmp_path, capsys):
    import shutil

    for f in (run_dir / "r.safetensors", run_dir / "r.diffusers.safetensors"):
        assert main(["inspect", str(f)]) == 0
        text = capsys.readouterr().out
        assert "problems   : none" in text, text[-600:]
    # Copied out of its run, a file trained on a built-in model says which in its metadata.
    alone = tmp_path / "alone.safetensors"
    shutil.copyfile(run_dir / "r.safetensors", alone)
    assert main(["inspect", str(alone)]) == 0
    assert "problems   : none" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- merge


def test_merge_equals_base_plus_adapter_at_that_strength(trained, run_dir, tiny_dir, tmp_path):
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(tiny_dir), "--lora", f"{trained.kohya}:0.7", "--out", str(out)]) == 0
    from diffusers import UNet2DConditionModel

    merged = UNet2DConditionModel.from_pretrained(str(out / "unet"))
    pipe = unet_io.pipe(tiny_dir)
    pipe.load_lora_weights(str(trained.kohya), adapter_name="a")
    pipe.set_adapters(["a"], adapter_weights=[0.7])
    want = unet_io.out(pipe.unet, trained.inputs)
    torch.testing.assert_close(unet_io.out(merged, trained.inputs), want, rtol=0, atol=1e-5)

    # A single file, two adapters in two formats whose strengths add up to the same 0.7.
    from sdxl_lora.sdxl.formats.merge import merge_checkpoint

    single = merge_checkpoint(tiny_dir, [(trained.kohya, 0.5), (run_dir / "r.diffusers.safetensors", 0.2)],
                              tmp_path / "merged.safetensors")
    with safe_open(str(single), "pt") as f:
        w = f.get_tensor("model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight")
        assert json.loads(f.metadata()["sdxl_lora.merged"])[1]["strength"] == 0.2
    want_w = merged.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q.weight
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-6)
    with pytest.raises(FileExistsError):
        merge_checkpoint(tiny_dir, [(trained.kohya, 1.0)], single)


def test_merging_into_a_16_bit_base_rounds_each_weight_once(trained, tiny_dir, tmp_path):
    """A base stored in fp16 is merged in its own dtype (half the memory of fp32), each changed layer summed in
    fp32 over every adapter and rounded once: bit for bit what merging in fp32 and storing fp16 gives."""
    from diffusers import UNet2DConditionModel

    from sdxl_lora.sdxl.formats.export import load_adapter, weight_with
    from sdxl_lora.sdxl.formats.merge import merge_checkpoint, source_dtype

    base16 = tmp_path / "base16"
    unet_io.pipe(tiny_dir).to(torch.float16).save_pretrained(base16, safe_serialization=True)
    loras = [(trained.kohya, 0.5), (trained.kohya, 0.25)]
    out = merge_checkpoint(base16, loras, tmp_path / "merged16")
    assert source_dtype(out) == torch.float16
    got = UNet2DConditionModel.from_pretrained(str(out / "unet"), dtype=torch.float16)
    base = dict(UNet2DConditionModel.from_pretrained(str(base16 / "unet"), dtype=torch.float16).named_modules())
    adapter = load_adapter(trained.kohya, tiny_dir)
    named = dict(got.named_modules())
    layers = {k.split(".", 1)[1]: lay for k, lay in adapter.layers.items() if k.startswith("unet.")}
    assert layers
    for path, layer in layers.items():
        w32 = base[path].weight.float()
        for _, strength in loras:
            w32 = weight_with(w32, layer, strength)
        assert torch.equal(named[path].weight, w32.to(torch.float16)), path


def test_a_single_file_merged_into_a_built_in_base_loads_back_in_generate(trained, tmp_path):
    from diffusers import UNet2DConditionModel

    from sdxl_lora.sdxl.config import ModelConfig
    from sdxl_lora.sdxl.formats.merge import merge_checkpoint
    from sdxl_lora.sdxl.model import load_pipeline, unet_skeleton

    # tiny-sdxl is not SDXL base's size: read as SDXL base, the file would not load.
    single = merge_checkpoint("tiny-sdxl", [(trained.kohya, 0.7)], tmp_path / "merged.safetensors")
    folder = merge_checkpoint("tiny-sdxl", [(trained.kohya, 0.7)], tmp_path / "merged")
    pipe = load_pipeline(ModelConfig(path=str(single)))
    want = UNet2DConditionModel.from_pretrained(str(folder / "unet")).state_dict()
    got = pipe.unet.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    assert unet_skeleton(ModelConfig(path=str(single)))[0].config.block_out_channels == \
        pipe.unet.config.block_out_channels  # plan and train read it the same way
    out = tmp_path / "images"
    assert main(["generate", "--model", str(single), "--prompt", "a red star", "--steps", "1", "--size", "64",
                 "--out", str(out)]) == 0
    assert (out / "seed0.png").is_file()


def test_dora_magnitude_travels_as_dora_scale(tiny_dir, tmp_path):
    from peft import LoraConfig

    unet = unet_io.fresh_unet(tiny_dir)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=["to_q", "to_v"]))
    _randomize(unet, 4)
    inputs = unet_io.inputs(unet)
    ref = unet_io.out(unet, inputs)
    path = export.save_kohya_lora(unet, tmp_path / "dora.safetensors")
    sd = load_file(path)
    scale = sd["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.dora_scale"]
    assert scale.shape == (sd["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight"].shape[0], 1)
    fresh = unet_io.fresh_unet(tiny_dir)
    export.apply_adapter(fresh, export.load_adapter(path, tiny_dir))
    torch.testing.assert_close(unet_io.out(fresh, inputs), ref, rtol=0, atol=1e-5)


def test_lora_bias_travels_in_diffusers_and_peft_formats_and_merges(tiny_dir, tmp_path):
    """LoRA-Bias (adapter.lora_bias) has no kohya form: the kohya writer refuses it, a run writes its main
    file in diffusers format, and the bias loads in diffusers, imports and merges exactly."""
    from peft import LoraConfig

    from sdxl_lora.sdxl.formats.merge import merge_adapter

    unet = unet_io.fresh_unet(tiny_dir)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=2, lora_bias=True, target_modules=["to_out.0", "ff.net.2"]))
    _randomize(unet, 5)
    inputs = unet_io.inputs(unet)
    ref = unet_io.out(unet, inputs)
    with pytest.raises(export.AdapterError, match="LoRA bias"):
        export.save_kohya_lora(unet, tmp_path / "k.safetensors")
    path = export.save_diffusers_lora(unet, tmp_path / "d.safetensors")
    assert any(k.endswith(".lora_B.bias") for k in load_file(path))
    pipe = unet_io.pipe(tiny_dir)
    pipe.load_lora_weights(str(path))
    torch.testing.assert_close(unet_io.out(pipe.unet, inputs), ref, rtol=0, atol=1e-5)
    adapter = export.load_adapter(path, tiny_dir)
    fresh = unet_io.fresh_unet(tiny_dir)
    export.apply_adapter(fresh, adapter)
    torch.testing.assert_close(unet_io.out(fresh, inputs), ref, rtol=0, atol=1e-5)
    base = unet_io.pipe(tiny_dir)
    merge_adapter(base, adapter, 1.0)
    torch.testing.assert_close(unet_io.out(base.unet, inputs), ref, rtol=0, atol=1e-5)
    assert _save_run(unet, tmp_path, "b") == {"diffusers": tmp_path / "b" / "b.safetensors"}


# ---------------------------------------------------------------------------------------- destinations


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def resumable(run_dir, tmp_path):
    """A copy of the finished run with a training state in checkpoints/ and its events, as a run that can be
    resumed holds them."""
    import shutil

    from sdxl_lora.core import checkpoint

    run = tmp_path / "runs" / "r"
    shutil.copytree(run_dir, run)
    (run / "events.jsonl").write_text('{"event": "start", "step": 0}\n', encoding="utf-8")
    state = checkpoint.save_state(run / "checkpoints", 3, {"w": torch.ones(2)}, {"state": {}, "param_groups": []},
                                  {"step": 3, "epoch": 0, "position": 3, "schedule": {}, "rng": {}}, keep=2)
    return SimpleNamespace(dir=run, state=state, before=_tree(run))


def _refused(proc, out, said: str) -> None:
    assert proc.returncode == 2, (out, proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert str(out) in err and said in err, err
    assert "Traceback" not in err and "\n" not in err  # one paragraph


def test_export_never_writes_over_or_into_what_it_reads_or_a_runs_states_with_or_without_overwrite(
        resumable, tmp_path, cli):
    from sdxl_lora.core import checkpoint

    run, state = resumable.dir, resumable.state
    peft = tmp_path / "peft"
    assert cli("export", str(run), "--format", "peft", "--out", str(peft)).returncode == 0
    peft_before = _tree(peft)
    refusals = [(run, "peft", "is the folder of run r"),                       # the run whole
                (run / "checkpoints", "peft", "is run r's training states"),  # every state
                (state / "adapter.safetensors", "kohya", "run r's training states"),
                (run / "config.toml", "kohya", "is run r's config"),
                (run / "r.safetensors", "kohya", "is what the export reads"),  # the adapter it is read from
                (run.parent, "peft", "holds the run folder")]                 # the runs folder
    for out, fmt, said in refusals:
        for overwrite in ([], ["--overwrite"]):
            _refused(cli("export", str(run), "--format", fmt, "--out", str(out), *overwrite), out, said)
    # A PEFT folder read is not written into either.
    for overwrite in ([], ["--overwrite"]):
        for out in (peft, peft / "adapter_model.safetensors", peft / "x.safetensors"):
            proc = cli("export", str(peft), "--format", "kohya", "--out", str(out), "--model", "tiny-sdxl", *overwrite)
            _refused(proc, out, "is what the export reads" if out == peft else "lies inside")
    assert _tree(run) == resumable.before and _tree(peft) == peft_before
    checkpoint.load_state(state)  # still a state --resume takes
    # Beside the run's records, its exports go inside it.
    assert cli("export", str(run), "--format", "kohya", "--out", str(run / "exports" / "x.safetensors")).returncode == 0


def test_merge_extract_resize_and_generate_refuse_their_sources_and_a_runs_states(resumable, tiny_dir, tmp_path, cli):
    import os
    import shutil

    run, state = resumable.dir, resumable.state
    base = tmp_path / "base"  # a copy: were a refusal missed, the session's model would be written over
    shutil.copytree(tiny_dir, base, copy_function=os.link)
    base_before = _tree(base)
    lora = str(run / "r.safetensors")
    commands = {
        "merge": (["merge", "--model", str(base), "--lora", f"{lora}:0.5"],
                  {base: "is what the merge reads", base / "unet": "lies inside", run / "r.safetensors": "is what"}),
        "extract": (["extract", "--base", str(base), "--tuned", lora, "--rank", "2"],
                    {base / "unet" / "x.safetensors": "lies inside", run / "r.safetensors": "what the extraction reads"}),
        "resize": (["resize", str(run), "--rank", "2"], {run / "r.safetensors": "what the resize reads"}),
        "generate": (["generate", "--model", str(base), "--lora", lora, "--prompt", "x"],
                     {base / "unet": "lies inside"}),
    }
    for name, (argv, refusals) in commands.items():
        refusals.update({run / "checkpoints": "run r's training states", state: "run r's training states"})
        if name != "generate":  # images are written beside a run's files; a folder or file at RUN replaces it
            refusals[run] = "folder of run r"
        for out, said in refusals.items():
            for overwrite in ([], ["--overwrite"]):
                shown = out / "seed0.png" if name == "generate" else out
                _refused(cli(*argv, "--out", str(out), *overwrite), shown, said)
    assert _tree(run) == resumable.before and _tree(base) == base_before


def test_llm_merge_refuses_its_adapter_and_a_runs_states(resumable, tmp_path, cli):
    from safetensors.torch import save_file as save

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": null}', encoding="utf-8")
    save({"w": torch.ones(1)}, str(adapter / "adapter_model.safetensors"))
    before = _tree(adapter)
    (tmp_path / "model").mkdir()
    for out, said in ((adapter, "is what the merge reads"), (resumable.dir / "checkpoints", "training states")):
        for overwrite in ([], ["--overwrite"]):
            _refused(cli("llm", "merge", "--adapter", str(adapter), "--model", str(tmp_path / "model"), "--out",
                         str(out), *overwrite), out, said)
    assert _tree(adapter) == before and _tree(resumable.dir) == resumable.before


def test_the_ui_export_and_upload_refuse_what_they_read_and_a_runs_states(resumable, tmp_path):
    import shutil

    from sdxl_lora.ui import dataset_edit, tab_export
    from sdxl_lora.ui.folders import Folders

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    args = ("kohya", "x", "", "", "", "", True, "sgm", False)
    written, msg = tab_export.export(f, "runs/r", *args, False)
    assert written == str(resumable.dir / "exports" / "x.safetensors"), msg
    export_before = Path(written).read_bytes()
    # Re-exporting that export under its own name, overwrite ticked: it is what the export reads.
    written, msg = tab_export.export(f, "runs/r/exports/x.safetensors", *args, True)
    assert written is None and "is what the export reads" in msg
    assert Path(resumable.dir / "exports" / "x.safetensors").read_bytes() == export_before
    # A dataset folder that is a run's states (the datasets folder holding a run): no upload lands there.
    shutil.copytree(resumable.dir, f.datasets / "r")
    image = tmp_path / "a.png"
    Image.new("RGB", (64, 64), "red").save(image)
    msg = dataset_edit.upload(f, "r/checkpoints", [("a.png", image)], ".txt", True)
    assert msg.startswith("uploaded 0 file(s)") and "run r's training states" in msg
    assert not (f.datasets / "r" / "checkpoints" / "a.png").exists()


# An export in a process of its own, SIGKILLed at its KILL_AT-th rename (a write done, not yet in place): no
# clean-up runs, as in a power cut.
_KILLED_EXPORT = """
import os, signal, sys
rename, calls = os.replace, [0]
def replace(*args, **kw):
    calls[0] += 1
    if calls[0] == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(*args, **kw)
os.replace = replace
from sdxl_lora.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _export_killed(kill_at: int, *argv: str) -> None:
    import os
    import signal
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, "export", *argv], capture_output=True, text=True,
                       env={**os.environ, "KILL_AT": str(kill_at), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


def test_what_a_killed_export_left_goes_at_the_next_export_into_that_folder_and_a_replaced_folder_comes_back(
        run_dir, tmp_path, cli):
    import os

    out = tmp_path / "exports"
    assert cli("export", str(run_dir), "--format", "peft", "--out", str(out / "old")).returncode == 0
    old = _tree(out / "old")
    hidden = (lambda: sorted(p.name for p in out.iterdir() if p.name.startswith(".")))
    _export_killed(1, str(run_dir), "--format", "kohya", "--out", str(out / "a.safetensors"))  # the file's rename
    assert [n.split(".writing-")[0] for n in hidden()] == [".a.safetensors"]
    _export_killed(1, str(run_dir), "--format", "peft", "--out", str(out / "p"))  # inside the folder being built
    assert [n.split(".writing-")[0] for n in hidden()] == [".p"]  # its start cleared the file's temp
    # Replacing "old": killed after it was moved aside, before the new one took its place.
    _export_killed(4, str(run_dir), "--format", "peft", "--out", str(out / "old"), "--overwrite")
    assert [n.split("-")[0] for n in hidden()] == [".old.replaced", ".old.writing"] and not (out / "old").exists()
    # A write still going on beside it (this process's) is not litter.
    live = out / f".b.safetensors.writing-{os.getpid()}.abcd1234.tmp"
    live.write_bytes(b"being written")

    assert cli("export", str(run_dir), "--format", "kohya", "--out", str(out / "b.safetensors")).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == [live.name, "b.safetensors", "old"]
    assert _tree(out / "old") == old  # as it was before the interrupted replacement
