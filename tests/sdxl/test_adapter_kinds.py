"""The adapter kinds (adapter.kind: lora, dora, loha, lokr; preset locon; rsLoRA; LoRA+): a trained layer of
each kind, exported, gives the loaders the weight training used, the files have the names and shapes the
loaders expect on SDXL base's real UNet, they import and merge back, and bad combinations are refused by name.

The loaders' weight rules are reproduced here from their public source (not copied), each cited by
repository, file and commit:
  ComfyUI   comfyanonymous/ComfyUI comfy/lora.py (model_lora_keys_unet: "lora_unet_" + the checkpoint's
            module path with "." -> "_"); comfy/weight_adapter/lora.py @6fd406fb14ca663225b88c6f75d7a7f2b997e5a0,
            loha.py @183b377588102d00131247aec399f8b34e1122b4, lokr.py @e8f3bc5ab766ba0149ac8ba8f67c328f8bb3da7d.
  LyCORIS   KohakuBlueleaf/LyCORIS lycoris/modules/locon.py @f49d30d670591ec8841d241d79aaa8449b30a715
            (apply_weight_decompose, wd_on_out: DoRA's rule). ComfyUI's own output-axis DoRA normalises by
            the base weight's norm instead of the adapted one's (comfy/weight_adapter/base.py
            @9c0cf36cd7964978850fd40f8cf76ac2cf9f9e15, an open fix in Comfy-Org/ComfyUI#15458), so DoRA is
            checked against LyCORIS' rule, the one peft trains with; docs/export.md says what ComfyUI shows.
"""
import hashlib

import pytest
import torch
from torch import nn
from safetensors.torch import load_file

from sdxl_lora.core import inject
from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.sdxl.config import AdapterConfig
from sdxl_lora.sdxl.formats import export
from sdxl_lora.sdxl import slots as unet_slots

KINDS = ("lora", "dora", "loha", "lokr")


pytestmark = pytest.mark.usefixtures("one_thread")


def _unet(tiny_dir):
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel.from_pretrained(str(tiny_dir / "unet"))


def _inputs(unet, seed=11, side=8):
    cfg = unet.config
    g = torch.Generator().manual_seed(seed)
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    return dict(sample=torch.randn(2, 4, side, side, generator=g), timestep=torch.tensor([10, 700]),
                encoder_hidden_states=torch.randn(2, 77, cfg.cross_attention_dim, generator=g),
                added_cond_kwargs={"text_embeds": torch.randn(2, pooled, generator=g),
                                   "time_ids": torch.randn(2, 6, generator=g)})


def _trained(tiny_dir, kind, quantize=None, **adapter):
    """The tiny UNet with a `kind` adapter (attention, feed-forward and ResNet convolutions) after a few AdamW
    steps on a fixed target: every factor has moved off its initialisation. `quantize`: QLoRA's base first."""
    unet = _unet(tiny_dir)
    cfg = AdapterConfig(kind=kind, preset="locon", rank=4, alpha=3.0, conv_rank=2, conv_alpha=1.0, **adapter)
    plan = unet_slots.make_plan(unet, cfg)
    if quantize:
        from sdxl_lora.core.quantize import quantize_model
        from sdxl_lora.sdxl.quantize import unet_skip

        quantize_model(unet, quantize, compute_dtype=torch.float32, skip=unet_skip)
    torch.manual_seed(0)
    inject.apply_plan(unet, plan)
    params = inject.trainable_parameters(unet)
    opt = torch.optim.AdamW(params, lr=2e-2)
    x = _inputs(unet)
    target = torch.randn_like(unet(**x).sample)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(unet(**x).sample, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return unet, plan


@torch.no_grad()
def _training_deltas(unet) -> dict[str, torch.Tensor]:
    """Each adapted layer's weight change as peft itself applies it (peft's merge; for DoRA the normalised
    weight), keyed by a hash of the layer's base weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {}
    for mod in unet.modules():
        if isinstance(mod, BaseTunerLayer):
            base = mod.get_base_layer().weight
            before = base.detach().clone()
            mod.merge()
            out[_key(before)] = base.detach() - before
            mod.unmerge()
    return out


def _key(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _loader_weight(kind, parts, w):
    """The weight the loaders compute for one file layer (`parts`: suffix -> tensor) on base weight `w`, at
    strength 1, as reproduced from the sources cited above."""
    alpha = parts["alpha"].item() if "alpha" in parts else None
    if "lora_up.weight" in parts:  # comfy lora.py: alpha / down's rank, up.flatten(1) @ down.flatten(1)
        up, down = parts["lora_up.weight"], parts["lora_down.weight"]
        diff = (up.flatten(1) @ down.flatten(1)).reshape(w.shape) * (alpha / down.shape[0] if alpha else 1.0)
        if "dora_scale" not in parts:
            return w + diff
        # LyCORIS apply_weight_decompose (wd_on_out): (W + diff) * m / ||W + diff|| per output channel
        v = w + diff
        norm = v.reshape(v.shape[0], -1).norm(dim=1).reshape(v.shape[0], *[1] * (v.dim() - 1))
        return v * (parts["dora_scale"] / norm)
    if "hada_w1_a" in parts:  # comfy loha.py: (w1a @ w1b) * (w2a @ w2b) * alpha / w1b's rank
        m1 = parts["hada_w1_a"] @ parts["hada_w1_b"]
        m2 = parts["hada_w2_a"] @ parts["hada_w2_b"]
        return w + (m1 * m2).reshape(w.shape) * (alpha / parts["hada_w1_b"].shape[0] if alpha else 1.0)
    # comfy lokr.py: w1/w2 whole or a @ b; the rank of the last factored part scales alpha, else scale 1
    dim = None
    w1 = parts.get("lokr_w1")
    if w1 is None:
        dim, w1 = parts["lokr_w1_b"].shape[0], parts["lokr_w1_a"] @ parts["lokr_w1_b"]
    w2 = parts.get("lokr_w2")
    if w2 is None:
        dim, w2 = parts["lokr_w2_b"].shape[0], parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    if w2.dim() == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    return w + torch.kron(w1, w2).reshape(w.shape) * (alpha / dim if alpha is not None and dim else 1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_gives_the_loaders_the_weights_training_used(tiny_dir, tmp_path, kind):
    """Exported, every file key is read by the loaders' rule on the base weight it names, and the result is
    the weight peft trained with, on attention, feed-forward and 3x3/1x1 convolutions alike."""
    from sdxl_lora.sdxl.formats.single_file import _unet_sgm

    unet, plan = _trained(tiny_dir, kind)
    want = _training_deltas(unet)
    path = export.save_kohya_lora(unet, tmp_path / f"{kind}.safetensors")
    sd = load_file(path)
    # ComfyUI's key map: "lora_unet_" + the original-layout checkpoint's module path, dots as underscores.
    base = _unet(tiny_dir)
    sgm = {k.removeprefix("model.diffusion_model.").removesuffix(".weight"): v
           for k, v in _unet_sgm(base).items() if k.endswith(".weight")}
    key_map = {"lora_unet_" + k.replace(".", "_"): k for k in sgm}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        name, suffix = k.split(".", 1)
        assert name in key_map, f"{k}: ComfyUI's key map has no layer {name}"
        layers.setdefault(name, {})[suffix] = v.float()
    assert len(layers) == len(plan.targets)
    convs = 0
    for name, parts in layers.items():
        w = sgm[key_map[name]].float()
        delta = _loader_weight(kind, parts, w) - w
        torch.testing.assert_close(delta, want[_key(w)], rtol=1e-4, atol=1e-6, msg=name)
        convs += w.dim() == 4 and w.shape[-1] == 3
    assert convs > 0  # the ResNets' 3x3 convolutions are in the file too
    suffixes = {s for parts in layers.values() for s in parts}
    expected = {"lora": {"lora_down.weight", "lora_up.weight", "alpha"},
                "dora": {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"},
                "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}}.get(kind)
    if expected:
        assert suffixes == expected
    else:
        assert {"lokr_w1", "alpha"} <= suffixes and suffixes <= {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}


@pytest.mark.parametrize("kind", KINDS)
def test_previews_run_each_kind_merged_and_training_resumes_on_the_same_weights(tiny_dir, kind):
    """Previews (sdxl/preview.py) render with the adapter merged into copies of the weights it adapts
    (inject.merged_for_inference), one product a layer as the tools users render with, its layers out of the
    UNet meanwhile: the UNet gives the adapter's output, and afterwards every weight the training step reads is
    the tensor it was, value for value, the fused q/k/v weights still views of their one buffer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from sdxl_lora.sdxl import speed as unet_speed

    unet, _ = _trained(tiny_dir, kind)
    assert unet_speed.fuse_projections(unet) > 0  # train.fuse_qkv, on by default
    tuners = [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]
    x = _inputs(unet)
    with torch.no_grad():
        want = unet(**x).sample
    state = {n: (t, t.detach().clone()) for n, t in [*unet.named_parameters(), *unet.named_buffers()]}
    with inject.merged_for_inference(unet) as merged, torch.no_grad():
        assert merged == len(tuners) and all(m.merged for m in tuners)  # peft's forward skips the adapter
        got = unet(**x).sample
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not any(m.merged for m in tuners)
    after = dict([*unet.named_parameters(), *unet.named_buffers()])
    for name, (tensor, value) in state.items():
        now = after[name]
        assert now.data_ptr() == tensor.data_ptr() and torch.equal(now, value), name
    attn = next(m for m in unet.modules() if hasattr(m, "fused_qkv"))
    fused = attn.fused_qkv.weight
    assert all(layer.get_base_layer().weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
               for layer in (attn.to_q, attn.to_k, attn.to_v))
    with torch.no_grad():
        assert torch.equal(unet(**x).sample, want)
    # As the previews render: the merged layers out of the UNet and its attentions on diffusers' own processor,
    # the bare UNet's modules with the adapter in their weights; the same output, and everything back after.
    processors = {name: m.processor for name, m in unet.named_modules() if hasattr(m, "processor")}
    with inject.merged_for_inference(unet, unwrap=True), unet_speed.stock_attention(unet) as stock, torch.no_grad():
        assert stock > 0 and not any(isinstance(m, BaseTunerLayer) for m in unet.modules())
        torch.testing.assert_close(unet(**x).sample, want, rtol=1e-4, atol=1e-4)
    assert [m for m in unet.modules() if isinstance(m, BaseTunerLayer)] == tuners and not any(m.merged for m in tuners)
    assert {name: m.processor for name, m in unet.named_modules() if hasattr(m, "processor")} == processors
    with torch.no_grad():
        assert torch.equal(unet(**x).sample, want)


@pytest.mark.parametrize("quantize", ["nf4", "fp8"])
def test_previews_of_a_quantized_base_run_from_16_bit_copies_and_training_resumes_on_its_bits(tiny_dir, quantize):
    """A QLoRA run's previews (sdxl/preview.py, where the plan says the copies fit) render from 16-bit copies of
    the quantized layers with the LoRA folded in (inject.dequantized_for_inference): the bare UNet's modules and
    the adapter's output; afterwards the same modules hold the same quantized bits."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from sdxl_lora.core.quantize import quantized_classes
    from sdxl_lora.sdxl import speed as unet_speed
    from sdxl_lora.sdxl.preview import _plain_unet

    unet, _ = _trained(tiny_dir, "lora", quantize=quantize)
    assert unet_speed.fuse_projections(unet, "merged") > 0  # quantized bases fuse with lora_matmul="merged"
    modules = dict(unet.named_modules())
    quantized = [n for n, m in modules.items() if isinstance(m, quantized_classes())]
    assert quantized
    x = _inputs(unet)
    with torch.no_grad():
        want = unet(**x).sample
    state = {n: t.detach().clone() for n, t in unet.state_dict().items()}
    with _plain_unet(unet, unet, dequantized=inject.dequantized_bytes(unet)), torch.no_grad():
        now = list(unet.modules())
        assert not any(isinstance(m, (BaseTunerLayer, *quantized_classes())) for m in now)
        assert {type(m) for m in now if isinstance(m, nn.Linear)} == {nn.Linear}
        assert all(m.weight.dtype == torch.float32 for m in now if isinstance(m, nn.Linear))  # the compute dtype
        # The attentions project through those copies: diffusers' own processor, not the one fused over the bits.
        assert not any(isinstance(getattr(m, "processor", None), unet_speed.FusedProjectionsProcessor) for m in now)
        torch.testing.assert_close(unet(**x).sample, want, rtol=1e-4, atol=1e-4)
    assert dict(unet.named_modules()) == modules
    after = unet.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[n], t) for n, t in state.items())
    with torch.no_grad():
        assert torch.equal(unet(**x).sample, want)


def test_previews_of_a_quantized_base_copy_its_smallest_layers_up_to_the_budget(tiny_dir):
    """Where not all the copies fit (the plan's budget: the room under the run's peak), previews copy the
    smallest quantized layers up to the first that does not fit, and the rest keep their quantized path: the
    same output either way. An attention fused over quantized bases with only some of
    its projections copied renders through diffusers' processor, which calls the modules in place (the fused one
    would compute from the quantized bases and lose the adapter folded into a copy); attentions with none copied
    keep the fused one. Afterwards the same modules hold the same bits."""
    from sdxl_lora.core.quantize import quantized_classes
    from sdxl_lora.sdxl import speed as unet_speed
    from sdxl_lora.sdxl.preview import _plain_unet

    unet, _ = _trained(tiny_dir, "lora", quantize="nf4")
    assert unet_speed.fuse_projections(unet, "merged") > 0
    modules = dict(unet.named_modules())
    sizes = {n: inject.dequantized_bytes(m) for n, m in modules.items() if isinstance(m, quantized_classes())}
    order = sorted(sizes, key=sizes.get)  # ties in the model's order
    # A budget that ends inside an attention's fused projections: its to_q copied, its to_k and to_v not.
    cut = next(i for i, n in enumerate(order) if n.endswith("attn1.to_q.base_layer")
               and order[i + 1] == n.replace("to_q", "to_k"))
    budget = sum(sizes[n] for n in order[:cut + 1])
    assert budget < sum(sizes.values())
    x = _inputs(unet, side=32)  # enough tokens a projection for the fused processor's merged product
    with torch.no_grad():
        want = unet(**x).sample
    state = {n: t.detach().clone() for n, t in unet.state_dict().items()}
    processors = {n: m.processor for n, m in modules.items() if hasattr(m, "processor")}
    with _plain_unet(unet, unet, dequantized=budget), torch.no_grad():
        now = dict(unet.named_modules())
        copied = [n for n in order if not isinstance(now.get(n), quantized_classes())]
        assert copied == order[:cut + 1]  # the smallest, up to the budget
        split = order[cut].rsplit(".to_q", 1)[0]
        for name, attn in now.items():
            if isinstance(processors.get(name), unet_speed.FusedProjectionsProcessor):
                projections = {f"{name}.{p}.base_layer" for p in ("to_q", "to_k", "to_v")}
                fused = isinstance(attn.processor, unet_speed.FusedProjectionsProcessor)
                assert fused == (not projections & set(copied)), name
        assert isinstance(processors[split], unet_speed.FusedProjectionsProcessor)
        assert not isinstance(now[split].processor, unet_speed.FusedProjectionsProcessor)
        torch.testing.assert_close(unet(**x).sample, want, rtol=1e-4, atol=1e-4)
    assert dict(unet.named_modules()) == modules
    assert {n: m.processor for n, m in unet.named_modules() if hasattr(m, "processor")} == processors
    after = unet.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[n], t) for n, t in state.items())
    with torch.no_grad():
        assert torch.equal(unet(**x).sample, want)


def test_previews_of_a_quantized_base_copy_no_more_than_the_device_has_room_for(tiny_dir, monkeypatch):
    from sdxl_lora.core.quantize import quantized_classes

    unet, _ = _trained(tiny_dir, "lora", quantize="nf4")
    modules = dict(unet.named_modules())
    sizes = sorted(inject.dequantized_bytes(m) for m in modules.values() if isinstance(m, quantized_classes()))
    # (free room, budget) -> layers copied: the smallest under the lesser of the two; none where none fits.
    for room, budget, copied in ((0, None, 0), (sizes[0] - 1, None, 0), (sum(sizes[:3]), None, 3),
                                 (sum(sizes[:3]), sum(sizes), 3), (sum(sizes), sum(sizes[:2]) + 1, 2),
                                 (sum(sizes), None, len(sizes))):
        monkeypatch.setattr(inject, "_room_for_copies", lambda device, need=0: room)
        with inject.dequantized_for_inference(unet, budget) as replaced:
            assert replaced == copied, (room, budget)
            now = list(unet.modules())
            assert sum(inject.dequantized_bytes(m) for m in now if isinstance(m, quantized_classes())) == sum(
                sizes[copied:])
        assert dict(unet.named_modules()) == modules


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_imports_inspects_and_merges_back(tiny_dir, tmp_path, kind, capsys):
    """The file read back (import) gives the trained UNet's output on a fresh UNet; `inspect` names the kind;
    `merge` at strength 1 bakes the same output into a checkpoint, at 0 leaves the base as it was."""
    from sdxl_lora.cli import main
    from sdxl_lora.sdxl.formats.merge import merge_adapter
    from sdxl_lora.sdxl.model import load_pipeline
    from sdxl_lora.core.config import ModelConfig

    unet, _ = _trained(tiny_dir, kind)
    x = _inputs(unet, seed=5)
    with torch.no_grad():
        ref = unet(**x).sample
    path = export.save_kohya_lora(unet, tmp_path / "a.safetensors")
    adapter = export.load_adapter(path, tiny_dir)
    assert not adapter.unknown and adapter.kinds() == [kind]
    fresh = _unet(tiny_dir)
    export.apply_adapter(fresh, adapter)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**x).sample, ref, rtol=0, atol=2e-5)
    assert main(["inspect", str(path), "--model", str(tiny_dir)]) == 0
    assert f"kind       : {export.KIND_NAMES[kind]}" in capsys.readouterr().out
    weights = {}
    for strength in (1.0, 0.0, 0.5):
        pipe = load_pipeline(ModelConfig(path=str(tiny_dir)))
        merge_adapter(pipe, adapter, strength)
        weights[strength] = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
        if strength in (0.0, 1.0):
            with torch.no_grad():
                got = pipe.unet(**x).sample
                want = ref if strength else _unet(tiny_dir)(**x).sample
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    # Strength blends the base and the trained weights linearly, for every kind (DoRA: as ComfyUI/Forge do).
    changed = [k for k in weights[1.0] if not torch.equal(weights[1.0][k], weights[0.0][k])]
    assert len(changed) >= len(adapter.layers)
    for k in changed:
        torch.testing.assert_close(weights[0.5][k], (weights[0.0][k] + weights[1.0][k]) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_each_kinds_keys_and_shapes_on_sdxl_base(kind):
    """SDXL base's real UNet (meta device, no weights) with the locon preset: every adapted layer gets a file
    name diffusers' own sgm mapper places on the layer it came from, and tensors whose update has that layer's
    weight shape: conv factors flattened as LyCORIS stores them, DoRA's scale one per output channel."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.lora_conversion_utils import (_convert_non_diffusers_lora_to_diffusers,
                                                         _maybe_map_sgm_blocks_to_diffusers)
    from diffusers.utils import convert_unet_state_dict_to_peft

    from sdxl_lora.sdxl.formats.single_file import unet_config, unet_diffusers_to_sgm

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config())
        plan = unet_slots.make_plan(unet, AdapterConfig(kind=kind, preset="locon", rank=16, conv_rank=8))
        inject.apply_plan(unet, plan)
    adapter = export.adapter_from_model(unet)
    sd = export.kohya_state_dict(adapter, unet.config)
    names = {k.split(".", 1)[0] for k in sd}
    assert len(names) == len(plan.targets)
    named = dict(unet.named_modules())
    # The names are the kind's own tensors' prefixes; diffusers' converter reads them as LoRA layers (a
    # stand-in pair of the update's shape each) and must put every one on the module it came from.
    stand_in = {}
    for key, layer in adapter.layers.items():
        name = export.kohya.kohya_name("unet", key.removeprefix("unet."), unet_diffusers_to_sgm(unet.config))
        out, inp = layer.update_shape[0], layer.update_shape[1:]
        stand_in.update({f"{name}.lora_down.weight": torch.zeros(1, *inp), f"{name}.lora_up.weight":
                         torch.zeros(out, 1, *([1, 1] if len(inp) == 3 else [])), f"{name}.alpha": torch.tensor(1.0)})
    assert {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in stand_in} == names
    mapped = _maybe_map_sgm_blocks_to_diffusers(stand_in, unet.config)  # raises if anything is left over
    converted, _ = _convert_non_diffusers_lora_to_diffusers(mapped)
    peft_sd = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
    modules = {k.rsplit(".lora_", 1)[0] for k in peft_sd}
    assert modules == {k.removeprefix("unet.") for k in adapter.layers}
    convs = 0
    for key, layer in adapter.layers.items():
        weight = named[key.removeprefix("unet.")].get_base_layer().weight
        assert layer.delta().shape == weight.shape, key
        if weight.dim() == 4 and weight.shape[-1] == 3:
            convs += 1
            if kind == "loha":
                assert layer.w1_b.shape == (8, weight.shape[1] * 9)
            if kind == "dora":
                assert layer.magnitude.numel() == weight.shape[0]
    assert convs == sum(1 for s in plan.targets if s.conv and s.kernel == 9)
    if kind == "dora":
        assert all(sd[k].shape[1:] in ((1,), (1, 1, 1)) for k in sd if k.endswith(".dora_scale"))


@pytest.mark.parametrize("kind", KINDS)
def test_plans_count_each_kinds_parameters_and_a_budget_holds_them(tiny_dir, kind):
    """The plan's parameter count is what peft's layers of that kind hold, so a rank budget shares out ranks
    that fit it once applied (LoKr's factors follow peft's factorisation, not the rank alone)."""
    unet = _unet(tiny_dir)
    plan = unet_slots.make_plan(unet, AdapterConfig(kind=kind, preset="locon", rank=8))
    g = torch.Generator().manual_seed(0)
    sensitivity = {s.name: float(torch.rand(1, generator=g)) for s in plan.targets}
    budget = plan.trainable_params // 2
    fitted = inject.budget_plan(plan, sensitivity, budget, 1, 64)
    assert len(set(fitted.rank.values())) > 1 and fitted.trainable_params <= budget
    inject.apply_plan(unet, fitted)
    assert sum(p.numel() for p in inject.trainable_parameters(unet)) == fitted.trainable_params


def test_rslora_exports_the_alpha_that_gives_its_scale(tiny_dir, tmp_path):
    """rsLoRA trains with scale alpha / sqrt(r), every layer with the same alpha; the file's alpha is the one
    that gives loaders (alpha / r) that scale, and it imports back to the same output."""
    unet, plan = _trained(tiny_dir, "lora", rslora=True)
    assert len({plan.alpha[s.name] for s in plan.targets if not s.conv}) == 1
    path = export.save_kohya_lora(unet, tmp_path / "rs.safetensors", uniform_alpha=False)
    sd = load_file(path)
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    assert sd[f"{name}.alpha"].item() == pytest.approx(3.0 * 4 ** 0.5)
    x = _inputs(unet)
    fresh = _unet(tiny_dir)
    export.apply_adapter(fresh, export.load_adapter(path, tiny_dir))
    with torch.no_grad():
        torch.testing.assert_close(fresh(**x).sample, unet(**x).sample, rtol=0, atol=2e-5)


def test_loraplus_gives_b_its_multiple_of_a_learning_rate(tiny_dir):
    from sdxl_lora.core.optim import loraplus_groups

    unet, _ = _trained(tiny_dir, "dora")
    names = {id(p): n for n, p in unet.named_parameters()}
    groups = loraplus_groups([{"params": inject.trainable_parameters(unet), "lr": 1e-4, "name": "unet"}], unet, 16.0,
                             1e-3)
    by_name = {g["name"]: g for g in groups}
    assert by_name["unet A"]["lr"] == 1e-4 and by_name["unet B"]["lr"] == pytest.approx(1.6e-3)
    assert all("lora_A" in names[id(p)] for p in by_name["unet A"]["params"])
    assert all("lora_B" in names[id(p)] or "magnitude" in names[id(p)] for p in by_name["unet B"]["params"])
    assert sum(len(g["params"]) for g in groups) == len(inject.trainable_parameters(unet))


@pytest.mark.parametrize("settings, field", [
    ({"adapter.kind": "loha", "adapter.dropout": 0.1}, "adapter.dropout"),
    ({"adapter.kind": "lokr", "adapter.rslora": True}, "adapter.rslora"),
    ({"adapter.kind": "loha", "adapter.rank_schedule": {2: 4}}, "adapter.rank_schedule"),
    ({"adapter.kind": "lokr", "model.quantize": "nf4"}, "model.quantize"),
    ({"adapter.kind": "dora", "model.quantize": "fp8"}, "model.quantize"),
    ({"adapter.kind": "dora", "adapter.lora_bias": True}, "adapter.lora_bias"),
    ({"adapter.kind": "loha", "train.loraplus_ratio": 16}, "train.loraplus_ratio"),
    ({"adapter.kind": "lycoris"}, "adapter.kind"),
])
def test_combinations_peft_cannot_train_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.") if field != "adapter.kind" else "adapter.kind"):
        load_config(None, [], settings)


def test_locon_on_a_causal_lm_is_refused_with_what_to_use():
    from sdxl_lora.llm.slots import DecoderTopology

    with pytest.raises(ValueError, match="use 'full'"):
        DecoderTopology().weight(None, "locon", None)


# ---------------------------------------------------------------- runs of each kind

SAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "sample_data" / "images"


def _run_cfg(tmp, name, kind, **extra):
    import shutil

    data = tmp / "data"
    if not data.exists():
        data.mkdir()
        for f in sorted(SAMPLES.iterdir())[:8]:  # 4 images and their captions
            shutil.copy(f, data / f.name)
    settings = {"adapter.kind": kind, "data.dirs": [str(data)], "data.cache_dir": str(tmp / "cache"),
                "output.runs_dir": str(tmp), "output.name": name, "preview.prompts": "", "train.steps": 3,
                "train.batch_size": 2, "train.save_every": 0, "train.save_every_minutes": 0, "train.seed": 7,
                "adapter.rank": 4, "adapter.train_text_encoder": True, "train.ema": True, "train.ema_decay": 0.6,
                # the kinds' own options ride along: LoCon + DoRA + LoRA+, rsLoRA + LoRA+, and for both a rank
                # schedule cut at step 2, where the resumed run restarts
                **({"adapter.preset": "locon", "train.loraplus_ratio": 4.0} if kind == "dora" else {}),
                **({"adapter.rslora": True, "train.loraplus_ratio": 4.0} if kind == "lora" else {}),
                **({"adapter.rank_schedule": {2: 2}} if kind in ("lora", "dora") else {}),
                **extra}
    return load_config(extra=settings)


# Plain LoRA's runs with the text encoders and EMA, its NaN guard and its bit-identical resume have tests of
# their own (test_training_extras.py, test_training_options.py, test_durability.py); here the other kinds.
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "lora"])
def test_each_kind_trains_text_encoders_skips_a_nan_step_and_resumes_bit_identical(tmp_path, kind, monkeypatch):
    """A run of each kind with the text encoders, EMA and the NaN guard (a non-finite loss at the first step is
    skipped), stopped after step 2 and resumed, ends with the same files, bit for bit, as one without a stop;
    the kohya file holds the UNet's and both text encoders' layers of that kind."""
    import os
    import signal

    from sdxl_lora.sdxl.task import SDXLTask
    from sdxl_lora.training import fit, new_job, resume_job

    real = SDXLTask.loss
    calls = {"n": 0, "stop_at": None}

    def loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == calls["stop_at"]:
            os.kill(os.getpid(), signal.SIGTERM)  # during this step: the run finishes it, saves and stops
        out = real(self, model, batch)
        return out * float("nan") if calls["n"] == 1 else out

    monkeypatch.setattr(SDXLTask, "loss", loss)
    full = fit(new_job(_run_cfg(tmp_path, "full", kind))).result
    assert [e["step"] for e in full.run.events() if e["event"] == "nonfinite"] == [1]
    calls.update(n=0, stop_at=2)
    first = fit(new_job(_run_cfg(tmp_path, "halves", kind))).result
    assert first.interrupted == "SIGTERM" and first.steps == 2
    calls.update(n=10, stop_at=None)  # the resumed run starts past the NaN
    second = fit(resume_job(str(tmp_path / "halves"))).result
    assert set(second.adapter) == set(full.adapter) == ({"kohya"} if kind in ("loha", "lokr") else {"kohya", "diffusers"})
    for fmt in full.adapter:
        a, b = load_file(full.adapter[fmt]), load_file(second.adapter[fmt])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), fmt
    adapter = export.load_adapter(full.adapter["kohya"])
    assert adapter.components() == ["text_encoder", "text_encoder_2", "unet"] and adapter.kinds() == [kind]
    assert not adapter.unknown
    if kind == "dora":  # the export has the cut ranks: each planned rank halved (base rank 4 -> 2)
        planned = {g["rank"] for e in full.run.events() if e["event"] == "plan" for g in e["groups"]}
        assert {lay.rank for lay in adapter.component("unet").values()} == {max(1, round(r / 2)) for r in planned}


@pytest.fixture
def own_mixed_precision():
    """Accelerate keeps one mixed precision per process: a test that trains in bf16 starts from a fresh state
    (other tests in this worker trained in fp32) and leaves one for the next."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("own_mixed_precision")
@pytest.mark.parametrize("kind", ["lora", "loha"])  # peft's LoRA layer, and the LyCORIS layers' common forward
def test_a_16_bit_run_keeps_no_cast_copy_of_the_adapters_inputs_and_trains_the_same(tmp_path, kind, monkeypatch):
    """A bf16 run (a GPU's default; train.mixed_precision here) computes under autocast, where peft's cast of each
    adapter layer's input to the fp32 factors was a copy that autocast cast back and the layer kept for its
    backward. Without the cast the run trains bit for bit the same adapter, and its previews, evaluation and
    export run (every UNet call of the run is under autocast)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from sdxl_lora.sdxl.unet_call import UNetCall
    from sdxl_lora.training import fit, new_job

    flags = []
    setup = UNetCall.setup

    def recording(self, unet, run):  # each adapter layer's cast switch once the levers are set
        setup(self, unet, run)
        flags.append({m.cast_input_dtype_enabled for m in unet.modules() if isinstance(m, BaseTunerLayer)})

    monkeypatch.setattr(UNetCall, "setup", recording)
    common = {"adapter.kind": kind, "train.steps": 2, "train.mixed_precision": "bf16", "train.save_every": 0}
    if kind == "loha":
        common["adapter.preset"] = "attn"
    prompts = tmp_path / "prompts.txt"  # one preview, before and after: the previews' path under autocast
    prompts.write_text("sks, a red star on a white background --s 2\n")
    kept = fit(new_job(load_config(extra={**common, "output.runs_dir": str(tmp_path), "output.name": "kept",
                                          "preview.prompts": str(prompts)}))).result
    assert (tmp_path / "kept" / "samples").is_dir() and any((tmp_path / "kept" / "samples").glob("*.png"))
    monkeypatch.setattr(inject, "adapters_take_autocast_inputs", lambda model: 0)  # peft's own casts
    cast = fit(new_job(load_config(extra={**common, "output.runs_dir": str(tmp_path), "output.name": "cast",
                                          "preview.prompts": ""}))).result
    assert flags == [{False}, {True}]
    a, b = load_file(kept.adapter["kohya"]), load_file(cast.adapter["kohya"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "lora"])  # plain LoRA: the default job's tests
def test_the_demo_base_learns_with_each_kind(tmp_path, kind, shared_cache):
    """A shortened default job (the demo base, sample_data, its recommended settings) of each kind: the eval
    loss on the training images, at fixed timesteps and noise, falls."""
    from sdxl_lora.training import fit, new_job

    cfg = load_config(extra={"adapter.kind": kind, "train.steps": 8, "preview.prompts": "",
                             "output.runs_dir": str(tmp_path), "output.name": kind, "train.save_every": 0,
                             "train.save_every_minutes": 0, "data.cache_dir": str(shared_cache)})
    # The base's recommended settings for the kind apply (LoHa learns at a higher rate than the rest).
    assert cfg.train.lr == pytest.approx({"loha": 4e-3, "lokr": 1e-2}.get(kind, 2e-3))
    result = fit(new_job(cfg)).result
    assert result.eval_after < 0.97 * result.eval_before, (result.eval_before, result.eval_after)


# ---------------------------------------------------------------- the fast path

@pytest.mark.parametrize("way, compiled, quantize", [("merged", False, None), ("peft", False, None),
                                                     ("merged", True, None), ("merged", False, "nf4")],
                         ids=["merged", "peft", "merged-compiled", "merged-nf4"])
def test_dora_keeps_the_fused_projections_with_peft_loss_and_gradients(tiny_dir, monkeypatch, way, compiled, quantize):
    """DoRA on the fused q/k/v path (train.fuse_qkv, each train.lora_matmul way, compiled, over a QLoRA base):
    the loss and every adapter gradient, the magnitudes' included, are peft's own DoRA layers', and the
    attention projections no longer run peft's forward."""
    from diffusers.models.attention_processor import Attention
    from test_speed import assert_same, batch_for, loss_and_grads

    from sdxl_lora.core import speed
    from sdxl_lora.sdxl import lora_matmul
    from sdxl_lora.sdxl import speed as unet_speed

    unet, _ = _trained(tiny_dir, "dora", quantize=quantize)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    monkeypatch.setattr(lora_matmul, "LORA_WAY_MIN_ROWS_PER_COLUMN", 0.0)  # the tiny model's few tokens: every product
    attns = [m for m in unet.modules() if isinstance(m, Attention)]
    assert unet_speed.fuse_projections(unet, lora_matmul=way) == len(attns) > 0
    peft_calls = []
    for m in attns:
        for layer in (m.to_q, m.to_k, m.to_v, m.to_out[0]):
            layer.register_forward_hook(lambda *a, layer=layer: peft_calls.append(layer))
    if compiled:
        # One block compiled, where the fused projections are (each block compiles alike; one keeps it short).
        monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
        block = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
        assert speed.compile_regions(block, classes=("BasicTransformerBlock",)) == 1
    got = loss_and_grads(unet, batch)
    assert_same(ref, got, rtol=2e-4 if quantize else 1e-4)
    assert any("lora_magnitude_vector" in n for n in got[1])
    if way != "peft" and not compiled:  # (a compiled graph runs no module hooks)
        assert not peft_calls
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_each_kind_on_a_causal_lm_loads_in_peft_and_merges(tmp_path, kind):
    """The LLM task trains the same kinds through the same injector: its PEFT folder loads with peft itself,
    and the merged transformers folder, to the trained model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sdxl_lora.core.config import ModelConfig
    from sdxl_lora.llm.tiny import materialize_tiny_llm
    from sdxl_lora.training import fit, new_job

    cfg = load_config(extra={"task": "llm", "adapter.kind": kind, "output.runs_dir": str(tmp_path), "output.name": kind,
                             "train.steps": 3, "train.lr": 3e-3, "llm.merge": True, "llm.max_length": 40,
                             "llm.max_new_tokens": 4, "train.save_every": 0})
    run_dir = fit(new_job(cfg)).result.run.dir
    base = materialize_tiny_llm(ModelConfig().cache_dir)
    ids = torch.tensor([[3, 89, 482, 203, 339, 305, 283, 275]])

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits

    plain = logits(AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True))
    loaded = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True),
                                              str(run_dir / "adapter")))
    merged = logits(AutoModelForCausalLM.from_pretrained(str(run_dir / "merged"), local_files_only=True))
    assert not torch.allclose(plain, loaded, atol=1e-4)  # the adapter changed the model
    torch.testing.assert_close(merged, loaded, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind, rslora", [("lora", True), ("dora", False)])
def test_lora_and_dora_diffusers_files_load_in_diffusers_with_the_trained_output(tiny_dir, tmp_path, kind, rslora):
    """diffusers' load_lora_weights on the diffusers-format file (what a run writes beside the kohya one):
    the trained UNet's output, convolutions, DoRA magnitudes and rsLoRA's scale included. (diffusers' kohya
    loader drops dora_scale, with a warning: docs/export.md points DoRA users at this file.)"""
    from diffusers import StableDiffusionXLPipeline

    unet, _ = _trained(tiny_dir, kind, rslora=rslora)
    x = _inputs(unet)
    path = export.save_diffusers_lora(unet, tmp_path / "d.safetensors")
    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), local_files_only=True)
    pipe.load_lora_weights(str(path))
    with torch.no_grad():
        torch.testing.assert_close(pipe.unet(**x).sample, unet(**x).sample, rtol=0, atol=2e-5)


def test_dora_trains_over_a_4bit_base_and_its_file_reads_back(tmp_path):
    """QLoRA with DoRA (model.quantize=nf4): the run trains on the fused projections and writes a kohya file
    whose layers all carry their magnitude."""
    from sdxl_lora.training import fit, new_job

    result = fit(new_job(_run_cfg(tmp_path, "q", "dora", **{"model.quantize": "nf4", "train.steps": 2,
                                                           "adapter.train_text_encoder": False}))).result
    adapter = export.load_adapter(result.adapter["kohya"])
    assert adapter.kinds() == ["dora"] and not adapter.unknown
    assert all(torch.isfinite(layer.magnitude).all() for layer in adapter.layers.values())

