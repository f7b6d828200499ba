"""Compare (sdxl/compare.py, the UI's Compare tab) for every adapter kind: a saved state of a LoHa, LoKr or DoRA
run reads back as the update training applied, an export at strength s loads with s times the update baked in
(LoHa, LoKr) or is refused naming the kind and what to do (DoRA), and the grid's cell at a strength is the image
of the base with that checkpoint merged at that strength, the shared pipeline left as it was."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_lora.core import inject
from sdxl_lora.core.config import load_config
from sdxl_lora.sdxl.config import ModelConfig
from sdxl_lora.sdxl import compare
from sdxl_lora.sdxl.formats.export import layer_table, load_adapter, weight_with

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data" / "images"
MODEL = "tiny-sdxl"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir):
    """Three-step runs of LoHa (with the text encoders), LoKr and DoRA: a saved state at step 2, the adapter at 3.
    alpha != rank and the convolutions' own ratio, so every layer's scale matters."""
    from sdxl_lora.training import fit, new_job

    out = tmp_path_factory.mktemp("runs")
    done = {}
    for name, extra in (("loha", {"adapter.train_text_encoder": True}), ("lokr", {}), ("dora", {}),
                        ("rslora", {"adapter.kind": "lora", "adapter.rslora": True, "adapter.train_text_encoder": True})):
        kind = extra.pop("adapter.kind", name)
        cfg = load_config(extra={
            "model.path": MODEL, "adapter.kind": kind, "adapter.preset": "locon", "adapter.rank": 6,
            "adapter.alpha": 3.0, "adapter.conv_rank": 2, "adapter.conv_alpha": 5.0, "data.dirs": [str(SAMPLES)],
            "data.resolution": 64, "data.cache_dir": str(out / "cache"), "output.runs_dir": str(out),
            "output.name": name, "preview.prompts": "", "preview.before": False, "train.device": "cpu",
            "train.steps": 3, "train.batch_size": 1, "train.lr": 1e-2, "train.save_every": 2,
            "train.keep_checkpoints": 5, "train.save_every_minutes": 0, **extra})
        fit(new_job(cfg))
        done[name] = out / name
    return done


def _table():
    return layer_table(MODEL)


def _trained_models(run: Path, state: Path) -> dict[str, torch.nn.Module]:
    """The run's models with its adapter injected by peft as training did, holding the state's weights."""
    from sdxl_lora.sdxl.model import load_pipeline
    from sdxl_lora.sdxl.plan import plan_config, text_encoder_rank_alpha
    from sdxl_lora.sdxl.task import TE_TARGETS

    cfg = load_config(run / "config.toml")
    pipe = load_pipeline(ModelConfig(path=MODEL))
    models = {"unet": pipe.unet}
    inject.apply_plan(pipe.unet, plan_config(cfg).plan)
    if cfg.adapter.train_text_encoder:
        from peft import inject_adapter_in_model

        rank, alpha = text_encoder_rank_alpha(cfg.adapter)
        for name in ("text_encoder", "text_encoder_2"):
            models[name] = inject_adapter_in_model(inject.adapter_config(cfg.adapter.kind, rank, alpha, TE_TARGETS,
                                                                         rslora=cfg.adapter.rslora), getattr(pipe, name))
    holder = torch.nn.ModuleDict(models) if len(models) > 1 else pipe.unet
    _, unexpected = holder.load_state_dict(load_file(str(state / "adapter.safetensors")), strict=False)
    assert not unexpected
    return models


@torch.no_grad()
def _peft_weights(models) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted layer's (base weight, weight with the adapter) as peft merges it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {}
    for comp, model in models.items():
        for name, mod in model.named_modules():
            if isinstance(mod, BaseTunerLayer):
                w = mod.get_base_layer().weight
                before = w.detach().clone()
                mod.merge()
                out[f"{comp}.{name}"] = before, w.detach().clone()
                mod.unmerge()
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora"])
def test_a_saved_state_of_each_kind_reads_back_as_the_update_training_applied(runs, kind):
    run = runs[kind]
    cfg = load_config(run / "config.toml")
    state = next(c for c in compare.run_checkpoints(run) if not c.final)
    assert state.step == 2
    adapter = compare.state_adapter(state, run, cfg, _table())
    truth = _peft_weights(_trained_models(run, state.path))
    assert set(adapter.layers) == set(truth) and adapter.kinds() == [kind]
    if kind == "loha":
        assert {"text_encoder", "text_encoder_2", "unet"} == set(adapter.components())
    if kind == "lokr":  # both of LoKr's forms: a factored second factor, and whole factors (scale folded in)
        assert {lay.rank is None for lay in adapter.layers.values()} == {True, False}
    for comp in adapter.components():  # trained (SDXL reads no text encoder's last layer: it stays at zero)
        assert any(not torch.equal(*truth[k]) for k in truth if k.startswith(f"{comp}.")), comp
    for key, (base, trained) in truth.items():
        assert _close(weight_with(base, adapter.layers[key]), trained), key


def test_an_rslora_state_without_the_runs_diffusers_file_reads_back_at_rsloras_scale(runs):
    # The scales come from the run's diffusers file where it has one; without it (deleted, or a run stopped
    # before its end), from the plan: alpha / sqrt(rank) for rsLoRA, as peft scaled each layer in training.
    run = runs["rslora"]
    (run / f"{run.name}.diffusers.safetensors").unlink()
    cfg = load_config(run / "config.toml")
    state = next(c for c in compare.run_checkpoints(run) if not c.final)
    adapter = compare.state_adapter(state, run, cfg, _table())
    truth = _peft_weights(_trained_models(run, state.path))
    assert set(adapter.layers) == set(truth) and {"text_encoder", "unet"} <= set(adapter.components())
    for key, (base, trained) in truth.items():
        assert _close(weight_with(base, adapter.layers[key]), trained), key


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_lycoris_checkpoint_exported_at_a_strength_loads_with_that_strength_baked_in(runs, kind, tmp_path):
    run, table = runs[kind], _table()
    for ck in compare.run_checkpoints(run):  # the step-2 state and the final adapter
        files = {s: compare.export_checkpoint(run, ck, s, "kohya", tmp_path / f"{ck.step}-{s}.safetensors", table)
                 for s in (1.0, 0.5)}
        full, half = (load_adapter(files[s], table) for s in (1.0, 0.5))
        assert not half.problems and half.kinds() == [kind] and set(half.layers) == set(full.layers)
        for key, layer in full.layers.items():
            assert _close(half.layers[key].delta(), 0.5 * layer.delta()), (ck.label, key)
        # Strength 1 is the checkpoint as trained: the final adapter as the run wrote it.
        if ck.final:
            for key, layer in load_adapter(ck.path, table).layers.items():
                assert _close(full.layers[key].delta(), layer.delta()), key


def test_the_compare_tab_exports_a_loha_run_at_half_strength_and_names_what_to_do_for_dora(runs):
    from sdxl_lora.ui import tab_compare
    from sdxl_lora.ui.folders import Folders

    f = Folders.create(SAMPLES.parent, ModelConfig().cache_dir, runs["loha"].parent)
    path, msg = tab_compare.export(f, "loha", "step 2", 0.5, "kohya", "", False)
    assert msg.startswith("kohya adapter written") and path.endswith("loha-step2-x50.safetensors")
    path, msg = tab_compare.export(f, "dora", "step 2", 0.5, "kohya", "", False)
    assert path is None and "a DoRA adapter" in msg and "Export at strength 1 and set the strength where you load it" in msg
    path, msg = tab_compare.export(f, "dora", "step 2", 1.0, "kohya", "", False)
    assert msg.startswith("kohya adapter written")


@pytest.mark.parametrize("kind", ["loha", "dora"])
def test_a_grid_cell_is_the_base_with_the_checkpoint_merged_at_its_strength(runs, kind):
    from sdxl_lora.sdxl.formats.merge import merge_adapter
    from sdxl_lora.sdxl.model import load_pipeline
    from sdxl_lora.sdxl.preview import PreviewPrompt, Sampler, render

    run, table = runs[kind], _table()
    cfg = load_config(run / "config.toml")
    state = next(c for c in compare.run_checkpoints(run) if not c.final)
    pipe = load_pipeline(ModelConfig(path=MODEL))
    pipe.set_progress_bar_config(disable=True)
    models = ("unet", "text_encoder", "text_encoder_2")
    before = {m: {k: v.clone() for k, v in getattr(pipe, m).state_dict().items()} for m in models}
    prompt = PreviewPrompt("a red circle", width=64, height=64, steps=1, seed=3)
    settings = compare.Settings(seed=0, steps=1, guidance=5.0, size=64)
    grid, = compare.compare_grids(pipe, run, [state], [prompt], [0.5, 1.0], settings, MODEL, table)
    assert grid.rendered == 2 and grid.path.is_file()
    for m in models:  # the shared pipeline is as it was
        assert all(torch.equal(v, before[m][k]) for k, v in getattr(pipe, m).state_dict().items()), m
    p = settings.resolve(prompt)
    adapter = compare.state_adapter(state, run, cfg, table)
    cells = {}
    for s in (0.5, 1.0):
        cells[s] = _pixels(run / compare.CACHE_DIR / f"{compare._cell_key(state, s, p, MODEL, Sampler.of_run(cfg))}.png")
        merge_adapter(pipe, adapter, s)
        image = render(pipe, [p], seed=p.seed, steps=p.steps, guidance=p.guidance, width=p.width, height=p.height)[0]
        for m in models:
            getattr(pipe, m).load_state_dict(before[m])
        assert torch.equal(_pixels(image), cells[s]), s
    assert not torch.equal(cells[0.5], cells[1.0])


def _pixels(image) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    image = Image.open(image) if isinstance(image, Path) else image
    return torch.from_numpy(np.asarray(image.convert("RGB")).copy())


def test_generate_renders_loha_and_dora_files_merged_at_their_strengths_leaving_the_shared_pipeline_as_it_was(
        runs, tmp_path):
    # diffusers' load_lora_weights does not read LyCORIS LoHa/LoKr files and drops a kohya DoRA file's
    # dora_scale: the Generate tab and `sdxl-lora generate` merge them into the weights for the render, in
    # the order given, and put the weights back after.
    from sdxl_lora.cli import main
    from sdxl_lora.sdxl.formats.merge import merge_adapter
    from sdxl_lora.sdxl.preview import render
    from sdxl_lora.ui import tab_generate
    from sdxl_lora.ui.folders import Folders

    f = Folders.create(SAMPLES.parent, ModelConfig().cache_dir, runs["loha"].parent)
    assert "runs/loha/loha.safetensors" in tab_generate.adapter_choices(f)
    pipes = tab_generate.Pipelines(f)
    args = (MODEL, "a red circle", "", 3, 2, 5.0, 64)
    base, tuned, msg = tab_generate.generate(f, pipes, *args, "runs/loha/loha.safetensors", 0.5,
                                             "runs/dora/dora.safetensors", 1.0, progress=lambda *a, **k: None)
    assert "adapters: loha.safetensors x 0.5, dora.safetensors x 1" in msg
    pipe = pipes.get(MODEL)
    again, none, _ = tab_generate.generate(f, pipes, *args, progress=lambda *a, **k: None)
    assert none is None and torch.equal(_pixels(again), _pixels(base))  # the shared pipeline is as it was
    merge_adapter(pipe, load_adapter(runs["loha"] / "loha.safetensors", _table()), 0.5)
    # A run's own adapter renders from its diffusers file where it has one (DoRA: the trained weights as they are).
    merge_adapter(pipe, load_adapter(runs["dora"] / "dora.diffusers.safetensors", _table()), 1.0)  # magnitudes too
    expect = render(pipe, ["a red circle"], seed=3, steps=2, guidance=5.0, width=64, height=64)[0]
    assert torch.equal(_pixels(tuned), _pixels(expect)) and not torch.equal(_pixels(tuned), _pixels(base))

    # The CLI: a LoKr file at strength 0 renders the base, at 1 another image.
    images = {}
    for scale in ("0", "1"):
        out = tmp_path / f"lokr-{scale}"
        assert main(["generate", "--model", MODEL, "--prompt", "a red circle", "--steps", "2", "--size", "64",
                     "--seed", "3", "--out", str(out), "--lora", str(runs["lokr"] / "lokr.safetensors"),
                     "--scale", scale]) == 0
        images[scale] = _pixels(out / "seed3.png")
    assert not torch.equal(images["0"], images["1"])
