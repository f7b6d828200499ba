"""`sdxl-lora resize`: an adapter's ranks cut by SVD to a fixed rank or per layer by a dynamic method; the file
loads where the original did, applies the closest update of its rank, and LoHa/LoKr come out as LoRA.

The adapter is built in-process with peft on the tiny SDXL (random LoRA weights on attention and ResNet
convolutions, so every layer matters)."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import unet_io
from safetensors.torch import load_file

from sdxl_lora.core import inject
from sdxl_lora.sdxl.config import AdapterConfig
from sdxl_lora.sdxl.formats import export, resize
from sdxl_lora.sdxl import slots as unet_slots
from sdxl_lora.sdxl.formats.lycoris import LohaLayer, LokrLayer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rank8(tiny_dir, tmp_path_factory):
    """A rank-8 LoRA (alpha 4) on attention, feed-forward and ResNet convolutions, saved as a kohya file, with its
    UNet output on fixed inputs and the base's."""
    unet = unet_io.fresh_unet(tiny_dir)
    inputs = unet_io.inputs(unet)
    base = unet_io.out(unet, inputs)
    plan = unet_slots.make_plan(unet, AdapterConfig(preset="locon", rank=8, alpha=4.0, conv_rank=8, conv_alpha=4.0))
    inject.apply_plan(unet, plan)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    unet.eval()
    d = tmp_path_factory.mktemp("resize")
    path = export.save_kohya_lora(unet, d / "r8.safetensors", metadata={"modelspec.title": "r8", "ss_steps": "7"})
    return SimpleNamespace(path=path, inputs=inputs, base=base, ref=unet_io.out(unet, inputs),
                           adapter=export.load_adapter(path, "tiny-sdxl"))


def _with(tiny_dir, adapter, inputs):
    """The UNet output of a fresh tiny UNet with `adapter` loaded through diffusers' own kohya loader."""
    pipe = unet_io.pipe(tiny_dir)
    pipe.load_lora_weights(str(adapter))
    n = sum(1 for name, _ in pipe.unet.named_modules() if name.endswith(".lora_A.default_0"))
    return unet_io.out(pipe.unet, inputs), n


def test_resizing_to_the_trained_rank_loads_in_diffusers_with_the_same_output(rank8, tiny_dir, tmp_path, cli):
    src = rank8.path.read_bytes()
    out = tmp_path / "same.safetensors"
    r = cli("resize", str(rank8.path), "--rank", "8", "--out", str(out), "--model", "tiny-sdxl")
    assert r.returncode == 0, r.stderr
    assert f"{len(rank8.adapter.layers)} layers: update rank 8 -> 8" in r.stdout
    assert rank8.path.read_bytes() == src  # the source is never touched
    got, n = _with(tiny_dir, out, rank8.inputs)
    assert n == sum(1 for k in rank8.adapter.layers if k.startswith("unet."))
    torch.testing.assert_close(got, rank8.ref, rtol=0, atol=1e-4)


def test_a_smaller_rank_applies_the_closest_update_of_that_rank(rank8, tiny_dir, tmp_path, cli):
    out = tmp_path / "r2.safetensors"
    r = cli("resize", str(rank8.path), "--rank", "2", "--out", str(out), "--model", "tiny-sdxl")
    assert r.returncode == 0, r.stderr
    small = export.load_adapter(out, "tiny-sdxl")
    assert small.layers.keys() == rank8.adapter.layers.keys() and small.kinds() == ["lora"]
    assert {lay.rank for lay in small.layers.values()} == {2}
    assert out.stat().st_size < rank8.path.stat().st_size / 3
    # The description travels, and the file says what it was resized from.
    assert small.metadata["ss_steps"] == "7"
    assert '"from": "r8.safetensors", "rank": 2' in small.metadata["sdxl_lora.resized"]
    for name, lay in rank8.adapter.layers.items():
        full = lay.delta().flatten(1)
        s = torch.linalg.svdvals(full)
        # Eckart-Young: no rank-2 update is closer to the trained one than what is left after the top two.
        err = (small.layers[name].delta().flatten(1) - full).norm()
        torch.testing.assert_close(err, s[2:].square().sum().sqrt(), rtol=1e-3, atol=1e-5)
    got, _ = _with(tiny_dir, out, rank8.inputs)
    # Between the base and the trained adapter: nearer the trained output than the base is.
    assert (got - rank8.ref).norm() < 0.9 * (rank8.base - rank8.ref).norm()
    assert (got - rank8.ref).abs().max() > 1e-4  # but not the same: rank was cut


def test_dynamic_methods_choose_each_layers_rank_from_its_singular_values(rank8, tmp_path, cli):
    s = torch.tensor([4.0, 2.0, 1.0, 0.5])
    assert resize.new_rank(s, 8, "sv_fro", 0.9) == 2       # sqrt(20 / 21.25) = 0.97 >= 0.9 > sqrt(16 / 21.25)
    assert resize.new_rank(s, 8, "sv_fro", 0.99) == 3
    assert resize.new_rank(s, 8, "sv_cumulative", 0.8) == 2  # (4 + 2) / 7.5
    assert resize.new_rank(s, 8, "sv_ratio", 3) == 2         # within a third of the largest
    assert resize.new_rank(s, 8, "sv_ratio", 8) == 4
    assert resize.new_rank(s, 1, "sv_ratio", 8) == 1         # --rank caps every method
    assert resize.new_rank(torch.zeros(4), 8) == 1           # an update of zeros keeps one rank
    out = tmp_path / "dyn.safetensors"
    r = cli("resize", str(rank8.path), "--rank", "6", "--dynamic-method", "sv_fro", "--dynamic-param", "0.8",
            "--out", str(out), "--model", "tiny-sdxl")
    assert r.returncode == 0, r.stderr
    dyn = export.load_adapter(out, "tiny-sdxl")
    for name, lay in dyn.layers.items():
        s = torch.linalg.svdvals(rank8.adapter.layers[name].delta().flatten(1))
        assert lay.rank == resize.new_rank(s, 6, "sv_fro", 0.8)
        kept = (lay.delta().flatten(1).norm() / s.square().sum().sqrt())
        assert kept >= 0.8 - 1e-4
    assert len({lay.rank for lay in dyn.layers.values()}) > 1  # the random layers differ, so do their ranks


def test_loha_and_lokr_layers_become_lora_with_the_same_update(rank8, tmp_path):
    g = torch.Generator().manual_seed(5)
    items = sorted(rank8.adapter.layers.items())
    linear = [(n, lay) for n, lay in items if len(lay.update_shape) == 2][:6]
    conv = [(n, lay) for n, lay in items if len(lay.update_shape) == 4][:2]
    layers = {}
    for i, (name, lay) in enumerate(linear + conv):
        shape = lay.update_shape
        out_f, in_f = shape[0], int(torch.tensor(shape[1:]).prod())
        if i % 2 == 0 or len(shape) == 4:  # LoHa on convolutions too: its factors span in x kernel
            layers[name] = LohaLayer(*(torch.randn(s, generator=g) for s in ((out_f, 2), (2, in_f), (out_f, 2),
                                                                                (2, in_f))), alpha=1.0, shape=shape)
        else:  # LoKr: a 2x2 w1 kron a rank-2 w2
            layers[name] = LokrLayer(torch.randn(2, 2, generator=g), None, None, None,
                                     torch.randn(out_f // 2, 2, generator=g), torch.randn(2, in_f // 2, generator=g),
                                     alpha=2.0, shape=shape)
    lyco = export.Adapter(layers)
    path = export.save_kohya_lora(lyco, tmp_path / "lyco.safetensors")
    read = export.load_adapter(path, "tiny-sdxl")
    assert read.kinds() == ["loha", "lokr"]
    done = resize.resize_adapter(read, 64)
    out = export.save_kohya_lora(done.adapter, tmp_path / "as-lora.safetensors")
    back = export.load_adapter(out, "tiny-sdxl")
    assert back.kinds() == ["lora"]
    for name, lay in read.layers.items():
        # A LoHa of rank 2 is an update of rank up to 4, a LoKr with a 2x2 w1 and rank-2 w2 too: all kept.
        assert back.layers[name].rank <= 4
        torch.testing.assert_close(back.layers[name].delta(), lay.delta(), rtol=1e-4, atol=1e-5)
    assert min(r.kept for r in done.layers) > 0.9999


def test_several_adapters_resize_into_one_that_applies_their_blend(rank8, tmp_path, cli):
    """kohya_ss's "merge LoRA": a LoRA at 0.5 and a LoHa/LoKr file at 0.8 (on some of the same layers) become
    one LoRA whose every layer applies 0.5 x the first's update + 0.8 x the second's."""
    g = torch.Generator().manual_seed(7)
    items = sorted(rank8.adapter.layers.items())
    picked = [(n, lay) for n, lay in items if len(lay.update_shape) == 2][:3] + \
        [(n, lay) for n, lay in items if len(lay.update_shape) == 4][:1]
    layers = {}
    for i, (name, lay) in enumerate(picked):
        shape = lay.update_shape
        out_f, in_f = shape[0], int(torch.tensor(shape[1:]).prod())
        if i % 2 == 0:
            layers[name] = LohaLayer(*(torch.randn(s, generator=g) * 0.1 for s in ((out_f, 2), (2, in_f), (out_f, 2),
                                                                                      (2, in_f))), alpha=1.0, shape=shape)
        else:
            layers[name] = LokrLayer(torch.randn(2, 2, generator=g), None, None, None,
                                     torch.randn(out_f // 2, 2, generator=g) * 0.1,
                                     torch.randn(2, in_f // 2, generator=g), alpha=2.0, shape=shape)
    lyco = export.save_kohya_lora(export.Adapter(layers), tmp_path / "lyco.safetensors")
    out = tmp_path / "blend.safetensors"
    r = cli("resize", f"{rank8.path}:0.5", f"{lyco}:0.8", "--rank", "32", "--out", str(out), "--model", "tiny-sdxl")
    assert r.returncode == 0, r.stderr
    assert f"{len(rank8.adapter.layers)} layers" in r.stdout and "the least 100.0%" in r.stdout
    blend = export.load_adapter(out, "tiny-sdxl")
    assert blend.kinds() == ["lora"] and blend.layers.keys() == rank8.adapter.layers.keys()
    second = export.load_adapter(lyco, "tiny-sdxl")
    for name, lay in rank8.adapter.layers.items():
        want = 0.5 * lay.delta().float()
        if name in second.layers:
            want = want + 0.8 * second.layers[name].delta().float()
        torch.testing.assert_close(blend.layers[name].delta().float(), want, rtol=1e-3, atol=1e-5)
    assert "r8.safetensors:0.5 + lyco.safetensors:0.8" in blend.metadata["sdxl_lora.resized"]
    # A DoRA layer does not add to another: refused, naming it, and nothing is written.
    dora = export.Adapter({n: dataclasses.replace(lay, magnitude=torch.ones(lay.update_shape[0]))
                           for n, lay in list(rank8.adapter.layers.items())[:1]})
    with pytest.raises(export.AdapterError, match="DoRA"):
        resize.resize_adapters([(rank8.adapter, 1.0), (dora, 1.0)], 8)


def test_dora_keeps_its_magnitude_and_lora_bias_its_added_term():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(16, 12, generator=g)
    lay = export.LoraLayer(down=torch.randn(4, 12, generator=g), up=torch.randn(16, 4, generator=g), alpha=2.0,
                           magnitude=torch.rand(16, generator=g) + 0.5, bias=torch.randn(16, generator=g))
    new, row = resize.resize_layer(lay, 4)
    assert row.rank_after == 4 and new.alpha == 4
    torch.testing.assert_close(export.weight_with(w, new), export.weight_with(w, lay), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new.bias * new.scale, lay.bias * lay.scale)


def test_bad_input_is_refused_by_name_and_nothing_is_overwritten(rank8, tmp_path, cli):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"mine")
    r = cli("resize", str(rank8.path), "--rank", "4", "--out", str(out), "--model", "tiny-sdxl")
    assert r.returncode == 2 and "already exists" in r.stderr and out.read_bytes() == b"mine"
    r = cli("resize", str(rank8.path), "--rank", "4", "--dynamic-method", "sv_fro", "--dynamic-param", "1.5",
            "--out", str(tmp_path / "p.safetensors"), "--model", "tiny-sdxl")
    assert r.returncode == 2 and "sv_fro" in r.stderr and "(0, 1]" in r.stderr
    r = cli("resize", str(rank8.path), "--rank", "4", "--dynamic-method", "sv_ratio",
            "--out", str(tmp_path / "p.safetensors"), "--model", "tiny-sdxl")
    assert r.returncode == 2 and "--dynamic-param" in r.stderr
    assert not (tmp_path / "p.safetensors").exists()
    src = rank8.path.read_bytes()
    r = cli("resize", str(rank8.path), "--rank", "4", "--out", str(rank8.path), "--model", "tiny-sdxl", "--overwrite")
    assert r.returncode == 2 and "never replaced" in r.stderr and rank8.path.read_bytes() == src
    r = cli("resize", str(rank8.path), "--rank", "4", "--out", str(out), "--model", "tiny-sdxl", "--overwrite")
    assert r.returncode == 0 and load_file(out)


def test_the_export_tab_resizes_a_runs_adapter_into_its_exports(rank8, tiny_dir, tmp_path):
    from sdxl_lora.ui import tab_export
    from sdxl_lora.ui.folders import Folders

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    run = f.runs / "r"
    run.mkdir()
    (run / "r.safetensors").write_bytes(rank8.path.read_bytes())
    (run / "config.toml").write_text(f'[model]\npath = "{tiny_dir.as_posix()}"\n', encoding="utf-8")
    args = ("kohya", "small", "", "", "", "", True, "sgm", False, False)
    written, msg = tab_export.export(f, "runs/r", *args, 3, "sv_fro", 0.5)
    assert written == str(run / "exports" / "small.safetensors"), msg
    assert "Resized:" in msg and "update rank 8 -> " in msg
    small = export.load_adapter(written, tiny_dir)
    ranks = {lay.rank for lay in small.layers.values()}
    assert max(ranks) <= 3 and len(ranks) > 1
    assert '"method": "sv_fro", "param": 0.5' in small.metadata["sdxl_lora.resized"]
    _, msg = tab_export.export(f, "runs/r", "kohya", "ratio", "", "", "", "", True, "sgm", False, False, 3,
                               "sv_ratio", 0.5)
    assert msg.startswith("**Error:** sv\\_ratio") and "1 or more" in msg
    assert not (run / "exports" / "ratio.safetensors").exists()


@pytest.fixture(scope="module")
def tuned(rank8, tiny_dir, tmp_path_factory):
    """The tiny SDXL with rank8's adapter merged in: a "fine-tuned" model whose difference from the base is known."""
    from sdxl_lora.sdxl.formats.merge import merge_checkpoint

    return merge_checkpoint(str(tiny_dir), [(rank8.path, 1.0)], tmp_path_factory.mktemp("tuned") / "model")


def test_extract_from_a_tuned_model_gives_the_lora_that_moves_the_base_there(rank8, tuned, tiny_dir, tmp_path, cli):
    out = tmp_path / "x.safetensors"
    r = cli("extract", "--base", str(tiny_dir), "--tuned", str(tuned), "--rank", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = export.load_adapter(out, tiny_dir)
    # The layers the merged adapter changed, and only those: the text encoders are equal in both, so left out.
    assert got.layers.keys() == rank8.adapter.layers.keys()
    assert f"{len(got.layers)} layers: update rank 8 -> 8" in r.stdout
    for name, lay in got.layers.items():
        torch.testing.assert_close(lay.delta(), rank8.adapter.layers[name].delta(), rtol=1e-3, atol=1e-5)
    moved, n = _with(tiny_dir, out, rank8.inputs)
    assert n == len(got.layers)
    torch.testing.assert_close(moved, rank8.ref, rtol=0, atol=1e-4)
    # A smaller rank: the closest update of that rank to each layer's difference, and says what it kept.
    small = tmp_path / "x2.safetensors"
    r = cli("extract", "--base", str(tiny_dir), "--tuned", str(tuned), "--rank", "2", "--conv-rank", "3",
            "--out", str(small))
    assert r.returncode == 0, r.stderr
    two = export.load_adapter(small, tiny_dir)
    assert {lay.rank for n_, lay in two.layers.items() if lay.down.dim() == 2} == {2}
    assert {lay.rank for n_, lay in two.layers.items() if lay.down.dim() == 4 and lay.down.shape[-1] == 3} == {3}
    assert "kept" in r.stdout and "-> 2-3" in r.stdout


def test_extract_refuses_equal_models_and_an_existing_file(tuned, tiny_dir, tmp_path, cli):
    out = tmp_path / "x.safetensors"
    r = cli("extract", "--base", str(tiny_dir), "--tuned", str(tiny_dir), "--rank", "4", "--out", str(out))
    assert r.returncode == 2 and "the same model" in r.stderr
    r = cli("extract", "--base", str(tiny_dir), "--tuned", str(tmp_path / "nowhere"), "--rank", "4", "--out", str(out))
    assert r.returncode == 2 and "--tuned" in r.stderr and "no such file or folder" in r.stderr
    assert not out.exists()
    out.write_bytes(b"mine")
    r = cli("extract", "--base", str(tiny_dir), "--tuned", str(tuned), "--rank", "4", "--out", str(out))
    assert r.returncode == 2 and "already exists" in r.stderr and out.read_bytes() == b"mine"


def test_extract_reads_text_encoder_changes_from_a_folder_and_from_a_single_file_alike(tiny_dir, tmp_path, cli):
    """Rank-1 changes to three text-encoder layers (the second encoder's k projection is stored fused with q and
    v in a single file, so reading the wrong third would show) come back exactly, from either form of the model."""
    from sdxl_lora.sdxl.model import CONFIGS_FROM
    from sdxl_lora.sdxl.formats.single_file import save_single_file

    pipe = unet_io.pipe(tiny_dir)
    g = torch.Generator().manual_seed(5)
    changed = {"text_encoder.encoder.layers.0.self_attn.k_proj": pipe.text_encoder.encoder.layers[0].self_attn.k_proj,
               "text_encoder_2.text_model.encoder.layers.1.self_attn.k_proj":
                   pipe.text_encoder_2.text_model.encoder.layers[1].self_attn.k_proj,
               "text_encoder_2.text_model.encoder.layers.0.mlp.fc1": pipe.text_encoder_2.text_model.encoder.layers[0].mlp.fc1}
    deltas = {}
    with torch.no_grad():
        for key, layer in changed.items():
            rows, cols = layer.weight.shape
            deltas[key] = torch.outer(torch.randn(rows, generator=g), torch.randn(cols, generator=g)) * 0.05
            layer.weight += deltas[key]
    folder = tmp_path / "tuned"
    pipe.save_pretrained(folder, safe_serialization=True)
    single = save_single_file(pipe, tmp_path / "tuned.safetensors", metadata={CONFIGS_FROM: "tiny-sdxl"})
    for form, model in (("folder", folder), ("file", single)):
        out = tmp_path / f"x-{form}.safetensors"
        r = cli("extract", "--base", "tiny-sdxl", "--tuned", str(model), "--rank", "4", "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert "3 layers: update rank 1 -> 1" in r.stdout, r.stdout
        got = export.load_adapter(out, tiny_dir)
        assert got.layers.keys() == deltas.keys(), form
        for name, lay in got.layers.items():
            torch.testing.assert_close(lay.delta(), deltas[name], rtol=1e-3, atol=1e-5, msg=f"{form}: {name}")


def test_the_export_tab_extracts_a_lora_from_a_model_of_the_models_folder(rank8, tuned, tiny_dir, tmp_path):
    import shutil

    from sdxl_lora.ui import tab_export
    from sdxl_lora.ui.folders import Folders, model_choices

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    shutil.copytree(tiny_dir, f.models / "base")
    shutil.copytree(tuned, f.models / "ft")
    assert {"base", "ft"} <= set(model_choices(f.models))
    seen = []
    written, msg = tab_export.extract(f, "base", "ft", 8, 0, tab_export.FIXED, None, True, "", False,
                                      progress=lambda done, desc: seen.append(done))
    assert written == str(f.models / "loras" / "exports" / "ft-extracted.safetensors"), msg
    assert "update rank 8 -> 8" in msg and seen[-1][0] == seen[-1][1]
    got = export.load_adapter(written, tiny_dir)
    assert got.layers.keys() == rank8.adapter.layers.keys()
    assert got.metadata["sdxl_lora.extracted_from"] == "ft"
    # An existing file is kept unless asked, a path out of the models folder is refused, each by name.
    _, msg = tab_export.extract(f, "base", "ft", 8, 0, tab_export.FIXED, None, True, "", False)
    assert msg.startswith("**Error:**") and "already exists" in msg
    _, msg = tab_export.extract(f, "base", "../elsewhere", 8, 0, tab_export.FIXED, None, True, "x", False)
    assert msg.startswith("**Error:**") and "outside the models folder" in msg
    assert not (f.models / "loras" / "exports" / "x.safetensors").exists()


def test_the_export_tab_merges_adapters_into_a_model_the_other_tabs_offer(rank8, tiny_dir, tmp_path):
    import shutil

    from safetensors import safe_open

    from sdxl_lora.sdxl.formats.export import weight_with
    from sdxl_lora.sdxl.formats.single_file import UNET_PREFIX, map_module_path, unet_diffusers_to_sgm
    from sdxl_lora.ui import tab_export
    from sdxl_lora.ui.folders import Folders, model_choices

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    shutil.copytree(tiny_dir, f.models / "base")
    (f.models / "loras").mkdir()
    shutil.copy(rank8.path, f.models / "loras" / "r8.safetensors")
    slots = ("models/loras/r8.safetensors", 0.5, "models/loras/r8.safetensors", 0.25, None, 1.0)
    msg = tab_export.merge(f, "base", "mine", tab_export.MERGE_FORMS[0], "auto", False, *slots)
    assert "Merged r8.safetensors at 0.5, r8.safetensors at 0.25" in msg, msg
    assert "mine.safetensors" in model_choices(f.models)
    # The two strengths add up in each weight, as `sdxl-lora merge` does.
    mapping = unet_diffusers_to_sgm(json.loads((tiny_dir / "unet" / "config.json").read_text()))
    base = dict(unet_io.fresh_unet(tiny_dir).named_modules())
    with safe_open(str(f.models / "mine.safetensors"), "pt") as fh:
        for key, layer in rank8.adapter.layers.items():
            if key.startswith("unet."):
                path = key.split(".", 1)[1]
                want = weight_with(weight_with(base[path].weight, layer, 0.5), layer, 0.25)
                got = fh.get_tensor(UNET_PREFIX + map_module_path(path + ".weight", mapping))
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # Nothing is written over, and an empty pick or a bad name is refused by name.
    msg = tab_export.merge(f, "base", "mine", tab_export.MERGE_FORMS[0], "auto", False, *slots)
    assert msg.startswith("**Error:**") and "already exists" in msg
    assert tab_export.merge(f, "base", "x", tab_export.MERGE_FORMS[1], "auto", False, None, 1.0).startswith(
        "**Error:** pick")
    msg = tab_export.merge(f, "base", "../up", tab_export.MERGE_FORMS[1], "auto", False, *slots)
    assert msg.startswith("**Error:**") and "name" in msg
    assert not (tmp_path / "up").exists()
    # Not even with "overwrite" does a merge replace the base it reads.
    before = (f.models / "base" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    msg = tab_export.merge(f, "base", "base", tab_export.MERGE_FORMS[1], "auto", True, *slots)
    assert msg.startswith("**Error:**") and "never replaced" in msg
    assert (f.models / "base" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == before
    # Nor does a folder that holds the base or an adapter get replaced by the merge written there.
    from sdxl_lora.sdxl.formats.merge import MergeError, merge_checkpoint

    for out, holds in ((f.models, "base"), (f.models / "loras", "r8.safetensors")):
        with pytest.raises(MergeError, match=f"holds .*{holds}"):
            merge_checkpoint(f.models / "base", [(f.models / "loras" / "r8.safetensors", 1.0)], out, overwrite=True)
    assert (f.models / "base" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == before
    assert (f.models / "loras" / "r8.safetensors").is_file()
