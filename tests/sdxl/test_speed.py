"""Speed levers give the same training signal as the plain path: the same loss and the same adapter
gradients on the tiny UNet (channels_last, regional compilation, selective checkpointing), and the
profiler leaves a trace and a breakdown in the run folder. CUDA graphs need a GPU; their equality check
runs in benchmarks/sdxl_step.py (benchmarks/RESULTS.md#exactness)."""
import json
import pickle

import pytest
import torch

from sdxl_lora.cli import main
from sdxl_lora.core import inject, profile, speed
from sdxl_lora.sdxl import lora_matmul
from sdxl_lora.core.config import load_config
from sdxl_lora.sdxl.config import AdapterConfig
from sdxl_lora.core.runs import read_events
from sdxl_lora.sdxl import slots as unet_slots
from sdxl_lora.sdxl import speed as unet_speed


def tiny_unet_with_lora(tiny_dir, preset="full", quantize=None):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(tiny_dir / "unet"), local_files_only=True)
    plan = unet_slots.make_plan(unet, AdapterConfig(preset=preset, rank=4), resolution=128, native=128)
    if quantize:  # QLoRA's order: the base quantized, then the adapter
        from sdxl_lora.core.quantize import quantize_model
        from sdxl_lora.sdxl.quantize import unet_skip

        quantize_model(unet, quantize, compute_dtype=torch.float32, skip=unet_skip)
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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_transformer_stages_keep_channels_last_and_the_training_signal(tiny_dir, monkeypatch, compiled):
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    speed.to_channels_last(unet)
    stages = [m for m in unet.modules() if type(m).__name__ == "Transformer2DModel"]
    outs = []
    stages[0].register_forward_hook(lambda m, args, out: outs.append(out[0]))
    unet(**batch)
    assert not outs[-1].is_contiguous(memory_format=torch.channels_last)  # diffusers' own: NCHW, a copy
    assert unet_speed.transformer_io(unet, compile=compiled) == len(stages) > 0
    got = loss_and_grads(unet, batch)
    assert outs[-1].is_contiguous(memory_format=torch.channels_last)
    assert_same(ref, got)
    torch._dynamo.reset()


def test_regional_compile_same_loss_and_gradients(tiny_dir, monkeypatch):
    # aot_eager: dynamo's graph capture and AOTAutograd's forward/backward split, as with inductor,
    # without a C++ build per graph (minutes on 2 CPU cores).
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    # Inductor's options go to inductor only.
    assert speed.compile_options("inductor", unet_speed.UNET_INDUCTOR_OPTIONS)["options"] == unet_speed.UNET_INDUCTOR_OPTIONS
    assert "options" not in speed.compile_options("aot_eager", unet_speed.UNET_INDUCTOR_OPTIONS)
    n = speed.compile_regions(unet, classes=unet_speed.REGION_CLASSES, options=unet_speed.UNET_INDUCTOR_OPTIONS)
    n_expected = sum(type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D") for m in unet.modules())
    assert n == n_expected > 0
    assert_same(ref, loss_and_grads(unet, batch))
    torch._dynamo.reset()


def test_wide_persistent_rows_reach_1280_wide_norms_and_key_the_compile_cache(monkeypatch):
    """The UNet's compile options widen inductor's one-pass row reductions to SDXL's 1280-wide LayerNorms
    (they are generated only for GPUs: checked here on the rule itself) and carry the limit into the cache
    key, so graphs compiled under another limit are not reused; at 1024 it is inductor's own rule."""
    import sympy
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    class Rows:  # what inductor's rule reads of a reduction kernel
        def __init__(self, hint, n):
            self.hint, self.reduction_numel = hint, sympy.Integer(n)

        def get_reduction_hint(self):
            return self.hint

    class Graph:
        sizevars = SizeVarAllocator()

    def persistent(hint, n):
        with V.set_graph_handler(Graph()):
            return InductorChoices.should_use_persistent_reduction(Rows(hint, n), False)

    monkeypatch.setattr(unet_speed, "PERSISTENT_ROW_MAX", 2048)
    key = unet_speed.unet_inductor_options()["post_grad_custom_post_pass"]
    assert persistent(ReductionHint.INNER, 1280) and persistent(ReductionHint.INNER, 2048)
    assert not persistent(ReductionHint.INNER, 4096)
    assert not persistent(ReductionHint.OUTER, 1280)  # only rows: other reductions keep inductor's rule
    wide = key.uuid()
    monkeypatch.setattr(unet_speed, "PERSISTENT_ROW_MAX", 1024)
    assert key.uuid() != wide
    assert not persistent(ReductionHint.INNER, 1280) and persistent(ReductionHint.INNER, 1024)
    assert "post_grad_custom_post_pass" not in unet_speed.unet_inductor_options()


def saved_bytes(unet, batch):
    """Bytes saved for backward by one forward (compiled blocks save through autograd too)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t.detach()  # no backward here; the tensor itself would keep the graph alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        unet(**batch).sample
    return total


def test_compile_activation_budget_keeps_less_and_the_same_gradients(tiny_dir, monkeypatch):
    # aot_eager_decomp_partition: AOTAutograd with inductor's partitioner (the one that honours the
    # budget), without inductor's code generation.
    import torch._functorch.config

    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager_decomp_partition")
    # compile_regions sets torch's process-wide budget: put torch's default back after the test.
    monkeypatch.setattr(torch._functorch.config, "activation_memory_budget", 1.0)
    results = {}
    for budget in (None, 0.1):
        torch.manual_seed(0)  # the same adapter initialisation for both
        unet = tiny_unet_with_lora(tiny_dir)
        batch = batch_for(unet)
        ref = loss_and_grads(unet, batch)
        speed.compile_regions(unet, classes=("BasicTransformerBlock",), activation_budget=budget)
        got = loss_and_grads(unet, batch)
        assert_same(ref, got, rtol=1e-3, atol=1e-5)
        results[budget] = saved_bytes(unet, batch)
        torch._dynamo.reset()
    assert results[0.1] < 0.9 * results[None]


def test_sdpa_backend_choice_picks_the_kernel_and_keeps_the_training_signal(tiny_dir):
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    # A named backend alone: only cuDNN's kernels inside, torch's choice again after.
    with speed.sdpa_context("cudnn"):
        assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()
    with speed.sdpa_context("default"):
        assert_same(ref, loss_and_grads(unet, batch))
    # "math" is the reference kernel: the same numbers as the CPU's default (flash) kernel.
    with speed.sdpa_context("math"):
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert_same(ref, loss_and_grads(unet, batch))


def test_checkpointed_blocks_recompute_with_the_forwards_attention_kernel(tiny_dir):
    # The training forward runs inside the sdpa_backend context, the backward (where checkpointed blocks
    # are recomputed) after it: the recomputation must use the same kernel, or torch's checkpoint finds
    # other saved tensors than the forward's and refuses. On the CPU "math" against the default flash
    # kernel shows it, as cuDNN against flash does on a GPU.
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    with speed.sdpa_context("math"):
        unet.zero_grad(set_to_none=True)
        ref_loss = (unet(**batch).sample.float() ** 2).mean()
    ref_loss.backward()
    ref = ref_loss.item(), {n: p.grad.clone() for n, p in unet.named_parameters() if p.requires_grad}
    unet_speed.enable_checkpointing(unet, sdpa_backend="math")
    unet.train()
    unet.zero_grad(set_to_none=True)
    with speed.sdpa_context("math"):
        loss = (unet(**batch).sample.float() ** 2).mean()
    loss.backward()
    assert_same(ref, (loss.item(), {n: p.grad.clone() for n, p in unet.named_parameters() if p.requires_grad}))


def test_a_cuda_only_attention_backend_on_the_cpu_is_a_clear_error(tmp_path, capsys):
    from sdxl_lora.cli import main

    rc = main(["train", "--out", str(tmp_path), "--name", "a", "--steps", "1", "--resolution", "64",
               "--device", "cpu", "--set", "preview.prompts=''", "--set", "train.sdpa_backend=cudnn"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "train.sdpa_backend='cudnn' needs a CUDA GPU" in err and "'default'" in err


def test_selective_checkpointing_measures_chooses_and_keeps_gradients(tiny_dir):
    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    units = unet_speed.checkpoint_units(unet)
    speed.measure_units(unet, units, lambda: unet(**batch).sample)
    by_name = {u.name: u for u in units}
    # diffusers' switches: a block's checkpoints its ResNets, a Transformer2DModel's its layers.
    assert {"down_blocks.1.resnets", "down_blocks.1.attentions.0", "mid_block.attentions.0",
            "up_blocks.2.resnets"} <= set(by_name)
    # The first down block has no adapter and nothing before it trains: it saves nothing for backward,
    # so checkpointing it would buy nothing. Every unit after the first adapter saves activations, and
    # every unit costs FLOPs to recompute.
    assert by_name["down_blocks.0.resnets"].saved == 0
    assert all(u.saved > 0 for u in units if u.name != "down_blocks.0.resnets")
    assert all(u.flops > 0 for u in units)
    # The order frees the most memory per recomputed FLOP first: it differs from "largest first".
    order = speed.checkpoint_order(units)
    ratios = [u.bytes_per_flop for u in order]
    assert ratios == sorted(ratios, reverse=True) and len(order) == len(units) - 1
    assert order[0].name != max(units, key=lambda u: u.saved).name

    total = sum(u.saved for u in units)
    # A budget that fits everything checkpoints nothing; one just under the total takes the first unit.
    assert speed.choose_checkpointed(units, total + 10, 10) == []
    assert speed.choose_checkpointed(units, total - 1, 0) == [order[0].name]
    # An impossible budget takes every unit that saves something, in that order.
    assert speed.choose_checkpointed(units, 0, 0) == [u.name for u in order]

    chosen = speed.choose_checkpointed(units, total // 2, 0)
    unet_speed.apply_selective_checkpointing(unet, chosen)
    on = {u.name for u in unet_speed.checkpoint_units(unet) if u.switch.gradient_checkpointing}
    assert on == set(chosen) and 0 < len(on) < len(units)
    unet.train()
    assert_same(ref, loss_and_grads(unet, batch))
    with pytest.raises(ValueError, match="no checkpointable unit named"):
        unet_speed.apply_selective_checkpointing(unet, ["down_blocks.9.resnets"])


def test_measuring_the_units_leaves_no_activation_alive(tiny_dir):
    # The measuring pass runs once at set-up; its activations must be freed when it ends, or they sit in
    # memory beside the training steps (a forward's worth of activations) and keep stale gradient
    # accumulators that broke a later CUDA-graph capture on the GPU.
    import gc
    import weakref

    unet = tiny_unet_with_lora(tiny_dir)
    batch = batch_for(unet)
    outputs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out)))
             for n, m in unet.named_modules() if n.endswith("attn1.to_q")]
    units = unet_speed.checkpoint_units(unet)
    gc.collect()
    gc.disable()  # freed by reference counting, not by a later garbage collection
    try:
        speed.measure_units(unet, units, lambda: unet(**batch).sample)
        assert outputs and all(ref() is None for ref in outputs)
    finally:
        gc.enable()
        for h in hooks:
            h.remove()
    assert sum(u.saved for u in units) > 0


def test_the_profiles_memory_peak_is_told_by_the_code_that_allocated_it():
    # --profile on a GPU records every allocation of the profiled steps (torch's memory history) and names what
    # was live at their peak by the innermost frame outside torch: here the attention's scores, freed before
    # the MLP's larger but later buffer, and never counted twice for a reused address.
    from sdxl_lora.core.profile import peak_sites

    torch_frame = {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}
    attn = [{"filename": "/usr/lib/python3/site-packages/diffusers/models/attention.py", "line": 10, "name": "forward"}, torch_frame]
    mlp = [torch_frame, {"filename": "/work/sdxl_lora/sdxl/kernels.py", "line": 20, "name": "geglu"}]
    mib = 2**20
    trace = [{"action": "alloc", "addr": 1, "size": 100 * mib, "frames": attn},
             {"action": "alloc", "addr": 2, "size": 50 * mib, "frames": mlp},
             {"action": "free_requested", "addr": 1, "size": 100 * mib},
             {"action": "free_completed", "addr": 1, "size": 100 * mib},
             {"action": "alloc", "addr": 1, "size": 80 * mib, "frames": mlp},  # the address again: a new block
             {"action": "alloc", "addr": 3, "size": 10 * mib, "frames": [torch_frame]},
             {"action": "free_completed", "addr": 2, "size": 50 * mib},
             {"action": "free_completed", "addr": 1, "size": 80 * mib}]
    peak, sites = peak_sites(trace)
    assert peak == 150 * mib  # the first two blocks together; 50 + 80 + 10 = 140 later
    assert sites == [("diffusers/models/attention.py:10 forward", 100 * mib), ("sdxl_lora/sdxl/kernels.py:20 geglu", 50 * mib)]
    trace[4]["size"] = 95 * mib  # now the later moment is the peak: 50 + 95 + 10
    peak, sites = peak_sites(trace)
    assert peak == 155 * mib
    assert sites == [("sdxl_lora/sdxl/kernels.py:20 geglu", 145 * mib), ("(torch's own code, or no Python stack)", 10 * mib)]
    assert peak_sites([]) == (0, [])


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
    # A budget below the frozen weights alone: every unit that saves activations is checkpointed (with
    # the demo base's recommended LoRA on the ResNet convolutions, every ResNet and transformer unit), the
    # event says how much of the forward is recomputed, and the run still trains.
    assert ck and len(ck[0]["blocks"]) == 18 and ck[0]["recomputed_flops"] > 0.9
    assert {"down_blocks.0.resnets", "mid_block.attentions.0", "up_blocks.2.resnets"} <= set(ck[0]["blocks"])
    assert (run / "p.safetensors").is_file()


def test_gpu_time_is_split_by_kind_of_kernel_with_the_h200s_kernel_names():
    # Kernel names from a profile of the compiled + graphed SDXL step on an H200.
    from types import SimpleNamespace

    cuda = torch.autograd.DeviceType.CUDA
    names = {
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT": ("matmul", 3000.0),
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1": ("attention", 2000.0),
        "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x128x64": ("convolution", 1500.0),
        "triton_poi_fused_cat_gelu_gelu_backward_mul_split_view_0": ("fused (compiled)", 1000.0),
        "triton_poi_fused__to_copy_clone_convolution_native_group_norm_silu_3": ("fused (compiled)", 40.0),
        "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int": ("attention", 60.0),
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast": (
            "other (element-wise, copies, norms)", 500.0),
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam": ("optimizer", 100.0),
    }
    events = [SimpleNamespace(key=n, device_type=cuda, self_device_time_total=us) for n, (_, us) in names.items()]
    events.append(SimpleNamespace(key="aten::mm", device_type=torch.autograd.DeviceType.CPU, self_device_time_total=9e9))
    # A named range on the GPU's timeline spans kernels already counted.
    events.append(SimpleNamespace(key="Optimizer.step#AdamW.step", device_type=cuda, self_device_time_total=2385.0,
                                  is_user_annotation=True))
    for name, (kind, _) in names.items():
        assert profile.kernel_kind(name) == kind, name
    assert profile.kernel_kind("_geglu_backward_kernel") == "fused (compiled)"  # train.fused_geglu's own Triton kernel
    kinds = profile.kernel_kinds(events, steps=2)
    # Milliseconds per step, largest first; host-side operators are not counted as GPU time.
    assert list(kinds) == list(dict.fromkeys(kind for kind, _ in names.values()))
    assert kinds["matmul"] == pytest.approx(1.5) and sum(kinds.values()) == pytest.approx(4.1)
    assert kinds["attention"] == pytest.approx(1.03)  # the dQ conversion counts as attention, not convolution


def test_fused_qkv_projections_give_the_same_loss_and_gradients(tiny_dir, monkeypatch):
    from diffusers.models.attention_processor import Attention

    unet = tiny_unet_with_lora(tiny_dir)
    # Some projections without LoRA (their block in the fused B factor is empty) and one with dropout
    # (left to peft's own forward): the fused path must handle both.
    attn = next(m for m in unet.modules() if isinstance(m, Attention) and not m.is_cross_attention)
    attn.to_k = attn.to_k.base_layer
    cross = next(m for m in unet.modules() if isinstance(m, Attention) and m.is_cross_attention)
    cross.to_v.lora_dropout["default"] = torch.nn.Dropout(0.5).eval()  # eval: dropout off, but not an Identity
    for m in unet.modules():  # a LoRA scaling other than 1 (alpha != rank), different per projection
        if isinstance(m, Attention):
            for i, name in enumerate(("to_q", "to_k", "to_v")):
                if hasattr(getattr(m, name), "scaling"):
                    getattr(m, name).scaling["default"] = 0.5 + i
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    n = unet_speed.fuse_projections(unet)
    assert n == sum(isinstance(m, Attention) for m in unet.modules()) > 0
    # The base weights are views of the one fused buffer: no extra memory.
    assert attn.to_q.base_layer.weight.data_ptr() == attn.fused_qkv.weight.data_ptr()
    assert attn.to_k.weight.untyped_storage().data_ptr() == attn.fused_qkv.weight.untyped_storage().data_ptr()
    assert "fused_qkv.weight" not in unet.state_dict()
    calls = []
    real = unet_speed._fused_projections
    monkeypatch.setattr(unet_speed, "_fused_projections", lambda *a: calls.append(len(a[2])) or real(*a))
    assert_same(ref, loss_and_grads(unet, batch))
    assert len(calls) == n and 2 in calls and 3 in calls  # every attention took the fused path
    monkeypatch.setattr(unet_speed, "_fused_projections", real)
    # Compiled as train.compile does (dynamo + AOTAutograd), still the same.
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    speed.compile_regions(unet, classes=unet_speed.REGION_CLASSES)
    assert_same(ref, loss_and_grads(unet, batch))
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_merged_lora_matmul_gives_the_same_loss_and_gradients(tiny_dir, tmp_path, monkeypatch, compiled):
    from diffusers.models.attention_processor import Attention

    from sdxl_lora.core.config import load_config

    matmul = "merged"
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    unet = tiny_unet_with_lora(tiny_dir)
    attns = [m for m in unet.modules() if isinstance(m, Attention)]
    # A projection without LoRA, one with dropout (peft's own forward), scalings other than 1 (alpha != rank).
    attns[0].to_k = attns[0].to_k.base_layer
    cross = next(m for m in attns if m.is_cross_attention)
    cross.to_out[0].lora_dropout["default"] = torch.nn.Dropout(0.5).eval()
    for m in attns:
        for i, name in enumerate(("to_q", "to_k", "to_v")):
            if hasattr(getattr(m, name), "scaling"):
                getattr(m, name).scaling["default"] = 0.5 + i
        m.to_out[0].scaling["default"] = 3.0
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    # peft's own LoRA forward runs only where train.lora_matmul's way cannot take the projection.
    peft_calls = []
    for m in attns:
        for layer in (m.to_q, m.to_k, m.to_v, m.to_out[0]):
            if hasattr(layer, "lora_B"):
                layer.lora_B["default"].register_forward_hook(lambda *a, layer=layer: peft_calls.append(layer))
    monkeypatch.setattr(lora_matmul, "LORA_WAY_MIN_ROWS_PER_COLUMN", 0.0)  # the tiny model's few tokens: every product
    assert unet_speed.fuse_projections(unet, lora_matmul=matmul) == len(attns) > 0
    if compiled:
        speed.compile_regions(unet, classes=("BasicTransformerBlock",))
    got = loss_and_grads(unet, batch)
    assert_same(ref, got)
    assert peft_calls == [cross.to_out[0]]
    # At SDXL's sizes: peft's products where the weight would cost more than the activations (77 text tokens).
    monkeypatch.undo()
    text, image = torch.empty(2, 77, 2048), torch.empty(16, 1024, 1280)
    assert lora_matmul.lora_way(matmul, text, 2048) == "peft"
    assert lora_matmul.lora_way(matmul, image, 1280) == matmul
    # A base weight or bias being trained has no gradient on this path: refused, not silently frozen.
    w = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match="frozen"):
        lora_matmul.lora_linear(torch.randn(2, 4), w, None, torch.randn(2, 4), torch.randn(6, 2), matmul)
    # Turning fuse_qkv off is no error: the default way then has nothing to act on, and the run's saved
    # config (every field written out) loads again for --resume.
    unfused = load_config(extra={"train.fuse_qkv": False})
    assert unfused.train.lora_matmul == "merged"
    saved = tmp_path / "config.toml"
    saved.write_text(unfused.to_toml())
    assert load_config(saved).train == unfused.train
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_merged_lora_convolutions_and_linears_give_peft_loss_and_gradients(tiny_dir, monkeypatch, compiled):
    """LoCon with train.lora_matmul="merged": the ResNets' LoRA'd convolutions as one convolution with W + sBA
    each way, and the LoRA'd Linears outside the attentions (feed-forward, proj_in/out) merged too, give
    peft's loss and gradients (channels_last, the convolutions' own input gradient, compiled); the layers
    that cannot take it (dropout) or a feature map too small to pay run peft's."""
    from diffusers.models.attention_processor import Attention

    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    unet = tiny_unet_with_lora(tiny_dir, preset="locon")
    convs = [m for b in unet.modules() if type(b).__name__ == "ResnetBlock2D" for m in b.modules()
             if hasattr(m, "lora_A") and isinstance(m.base_layer, torch.nn.Conv2d)]
    assert convs and any(m.base_layer.kernel_size == (1, 1) for m in convs)  # the shortcuts' 1x1 too
    in_attention = {id(m) for a in unet.modules() if isinstance(a, Attention) for m in a.modules()}
    linears = [m for m in unet.modules() if hasattr(m, "lora_A") and isinstance(m.base_layer, torch.nn.Linear)
               and id(m) not in in_attention]
    names = [n for n, m in unet.named_modules() if any(m is x for x in linears)]
    assert any(".ff." in n for n in names) and any(n.endswith("proj_in") for n in names)
    for layer in (convs[0], linears[0]):  # eval dropout: the same numbers, through peft's forward
        layer.lora_dropout["default"] = torch.nn.Dropout(0.5).eval()
    for i, m in enumerate(convs + linears):
        m.scaling["default"] = 0.5 + i % 3
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    peft_calls = []
    for m in convs + linears:
        m.lora_B["default"].register_forward_hook(lambda *a, m=m: peft_calls.append(m))
    speed.to_channels_last(unet)
    assert unet_speed.conv_input_grad(unet) > 0
    monkeypatch.setattr(lora_matmul, "LORA_WAY_MIN_ROWS_PER_COLUMN", 0.0)  # the tiny model's small maps: every one
    assert unet_speed.merge_lora_convs(unet) == len(convs)
    assert unet_speed.merge_lora_linears(unet) == len(linears)
    if compiled:
        speed.compile_regions(unet, classes=unet_speed.REGION_CLASSES)
    assert_same(ref, loss_and_grads(unet, batch))
    assert sorted(map(id, peft_calls)) == sorted(map(id, [convs[0], linears[0]]))
    # At SDXL's sizes: the 32x32 stage (1280 channels, 3x3) pays at batch 16, not at batch 4.
    monkeypatch.setattr(lora_matmul, "LORA_WAY_MIN_ROWS_PER_COLUMN", 1.0)
    w = torch.empty(1280, 1280, 3, 3)
    assert lora_matmul.lora_conv_pays(torch.empty(16, 1280, 32, 32), w, (1, 1))
    assert not lora_matmul.lora_conv_pays(torch.empty(4, 1280, 32, 32), w, (1, 1))
    torch._dynamo.reset()


def test_blocks_whose_lora_scalings_differ_share_compiled_graphs_and_follow_peft_when_rescaled(tiny_dir, monkeypatch):
    """rsLoRA, per-layer ranks and conv_alpha give LoRA layers different scalings. The fast paths (fused projections,
    merged Linears and convolutions, and peft's products where those do not pay) read each as a tensor, so the
    blocks compiled at one scaling serve every other (a float is guarded by its value: a compilation per distinct
    scaling), and a scaling changed after set-up through peft (set_scale; scale_layer, diffusers' LoRA scale)
    changes the loss and gradients as it does peft's own forward."""
    import copy

    from diffusers.utils.peft_utils import scale_lora_layers
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(speed, "COMPILE_BACKEND", counting)
    unet = tiny_unet_with_lora(tiny_dir, preset="locon")
    reference = copy.deepcopy(unet)  # peft's own layers, eager
    batch = batch_for(unet)
    # At the tiny model's sizes some products pay for the merged way and some take peft's: both are covered.
    ways = set()

    def way(layer, args):
        x, base = args[0], layer.base_layer
        ways.add(("conv", lora_matmul.lora_conv_pays(x, base.weight, base.stride)) if x.ndim == 4
                 else ("linear", lora_matmul.lora_way("merged", x, base.in_features)))

    hooks = [m.register_forward_pre_hook(way) for m in reference.modules() if hasattr(m, "lora_A")]
    ref = loss_and_grads(reference, batch)
    for hook in hooks:
        hook.remove()
    assert ways == {("conv", True), ("conv", False), ("linear", "merged"), ("linear", "peft")}
    speed.to_channels_last(unet)
    unet_speed.conv_input_grad(unet)
    assert unet_speed.fuse_projections(unet, lora_matmul="merged") > 0
    assert unet_speed.merge_lora_linears(unet) > 0 and unet_speed.merge_lora_convs(unet) > 0
    speed.compile_regions(unet, classes=unet_speed.REGION_CLASSES)
    assert_same(ref, loss_and_grads(unet, batch))
    compiled = len(graphs)
    assert compiled > 0
    peft_layers = dict(reference.named_modules())
    pairs = [(m, peft_layers[n]) for n, m in unet.named_modules() if hasattr(m, "lora_A")]
    for i, pair in enumerate(pairs):  # each layer its own scaling, as rsLoRA with per-layer ranks gives
        for layer in pair:
            layer.set_scale("default", 0.5 + 0.25 * (i % 7))
    assert_same(loss_and_grads(reference, batch), loss_and_grads(unet, batch))
    for model in (reference, unet):
        scale_lora_layers(model, 0.5)
    assert_same(loss_and_grads(reference, batch), loss_and_grads(unet, batch))
    assert len(graphs) == compiled  # the new scalings compiled nothing
    torch._dynamo.reset()


def test_the_scaling_tensor_follows_peft_through_moves_copies_and_new_adapters():
    """The tensor the fast paths read is never a stale copy of peft's float: written by every change of the float,
    found by name after model.to() replaced it, bound to its own layer in a copy, made for an adapter added later;
    peft's code and the saved adapter see the floats alone."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=6, target_modules=["0"]),
                                    torch.nn.Sequential(torch.nn.Linear(8, 8)))
    layer = model[0]
    lora_matmul.use_tensor_scaling(layer)

    def tensor(layer, adapter="default"):
        return lora_matmul._scaling(layer, adapter)

    assert layer.scaling == {"default": 1.5} and tensor(layer).item() == 1.5
    assert not any("scaling" in k for k in model.state_dict())
    model.to(torch.float64)
    layer.set_scale("default", 2.0)
    assert layer.scaling["default"] == tensor(layer).item() == 3.0 and tensor(layer).dtype == torch.float64
    layer.scaling.update(default=2.5)  # dict's own update, too
    assert tensor(layer).item() == 2.5
    copied = copy.deepcopy(model)[0]
    copied.scale_layer(2.0)
    assert tensor(copied).item() == 5.0 and tensor(layer).item() == 2.5
    loaded = pickle.loads(pickle.dumps(model))[0]  # a pickled model (a whole-module save) binds to its own layer
    loaded.unscale_layer()
    assert tensor(loaded).item() == 1.5 and tensor(layer).item() == 2.5
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=6, target_modules=["0"], use_rslora=True), model, "other")
    assert tensor(layer, "other").item() == pytest.approx(3.0) and tensor(layer, "other").device == layer.weight.device
    layer.delete_adapter("other")
    assert set(layer.scaling) == {"default"} and not hasattr(layer, lora_matmul.TensorScaling.buffer_name("other"))


@pytest.mark.parametrize("stride,padding,size", [((1, 1), (1, 1), 9), ((2, 2), (1, 1), 9), ((2, 2), (0, 0), 8)])
def test_merged_lora_convolution_matches_peft_in_fp32_and_bf16(stride, padding, size):
    """lora_conv2d against peft's three convolutions, strided too (the input's gradient keeps the input's size):
    the same output and gradients in fp32, and in bf16 autocast as close to fp32 as peft's own products."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    cin, cout, r = 24, 32, 4
    x = torch.randn(2, cin, size, size, generator=g)
    w = 0.05 * torch.randn(cout, cin, 3, 3, generator=g)
    bias = torch.randn(cout, generator=g)
    a = torch.randn(r, cin, 3, 3, generator=g) / (cin * 9) ** 0.5
    b = 0.02 * torch.randn(cout, r, 1, 1, generator=g)

    def peft(x, w, a, b):
        return F.conv2d(x, w, bias, stride, padding) + F.conv2d(F.conv2d(x, a, None, stride, padding), b)

    def merged(x, w, a, b):
        return lora_matmul.lora_conv2d(x, w, bias, a, b, stride, padding)

    def run(fn, bf16, w=w):
        xs, a_, b_ = x.clone().requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = fn(xs, w, a_, b_)
        y.backward(torch.ones_like(y) + torch.arange(y.numel()).reshape(y.shape).to(y.dtype) % 3)
        return [t.float() for t in (y, xs.grad, a_.grad, b_.grad)]

    exact = run(peft, bf16=False)
    for got, want in zip(run(merged, bf16=False), exact):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    err = {fn.__name__: [((u - v).norm() / v.norm()).item() for u, v in zip(run(fn, True, w.bfloat16()), exact)]
           for fn in (peft, merged)}
    for name, got, ref in zip(("output", "x.grad", "A.grad", "B.grad"), err["merged"], err["peft"]):
        assert got <= 1.5 * ref + 1e-3, (name, got, ref)
    with torch.no_grad():  # previews: the output alone, the same
        torch.testing.assert_close(merged(x, w, a, b), exact[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="frozen"):
        lora_matmul.lora_conv2d(x, torch.nn.Parameter(w), None, a, b, stride, padding)


@pytest.mark.parametrize("method", ["nf4", "fp8"])
def test_merged_lora_over_a_quantized_base_gives_peft_loss_and_gradients(tiny_dir, monkeypatch, method):
    """QLoRA with train.lora_matmul="merged": the quantized q/k/v weights dequantized into one buffer, the LoRA
    delta added, one GEMM each way; the same loss and gradients as peft's layers over bitsandbytes' (or our
    fp8) matmuls, and no dequantized weight kept for the backward."""
    from diffusers.models.attention_processor import Attention

    unet = tiny_unet_with_lora(tiny_dir, preset="attn", quantize=method)
    attns = [m for m in unet.modules() if isinstance(m, Attention)]
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    keys = set(unet.state_dict())
    assert unet_speed.fuse_projections(unet, lora_matmul="peft") == 0  # peft's layers dequantize one by one anyway
    monkeypatch.setattr(lora_matmul, "LORA_WAY_MIN_ROWS_PER_COLUMN", 0.0)  # the tiny model's few tokens: every product
    assert unet_speed.fuse_projections(unet, lora_matmul="merged") == len(attns) > 0
    assert isinstance(attns[0].fused_qkv, unet_speed._QuantizedProjections) and set(unet.state_dict()) == keys
    peft_calls = []
    for m in attns:
        for layer in (m.to_q, m.to_k, m.to_v, m.to_out[0]):
            layer.lora_B["default"].register_forward_hook(lambda *a, layer=layer: peft_calls.append(layer))
    assert_same(ref, loss_and_grads(unet, batch))
    assert not peft_calls  # every projection took the merged way
    # What the backward keeps: the input, the rank-r activation and the factors, no weight-sized tensor.
    attn = attns[0]
    x = torch.randn(2, 64, attn.to_q.in_features, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        q, k, v = unet_speed._fused_projections(x, attn.fused_qkv, (attn.to_q, attn.to_k, attn.to_v), "merged")
    weight = sum(m.base_layer.out_features for m in (attn.to_q, attn.to_k, attn.to_v)) * x.shape[-1]
    assert saved and max(s.numel() for s in saved) < weight
    torch._dynamo.reset()


def test_merged_lora_is_as_close_to_fp32_as_peft_in_bf16():
    """train.lora_matmul="merged" rounds W + sBA to bf16 once per call: its output and gradients stay as close
    to the fp32 result as peft's separate bf16 products, for LoRA deltas from 10% to 0.1% of the weight."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    m, k, n, r = 512, 256, 384, 8
    x = torch.randn(m, k, generator=g)
    w = (0.02 * torch.randn(n, k, generator=g)).bfloat16()
    a = torch.randn(r, k, generator=g) / k ** 0.5
    dy = torch.randn(m, n, generator=g)

    def peft(x, w, a, b):
        return F.linear(x, w) + F.linear(F.linear(x, a), b)

    def merged(x, w, a, b):
        return lora_matmul.lora_linear(x, w, None, a, b, "merged")

    def run(fn, b, bf16):
        xs, a_, b_ = x.detach().requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = fn(xs, w if bf16 else w.float(), a_, b_)
        y.backward(dy.to(y.dtype))
        return [t.float() for t in (y, xs.grad, a_.grad, b_.grad)]

    for size in (1e-1, 1e-2, 1e-3):
        b = torch.randn(n, r, generator=g)
        b *= size * w.float().norm() / (b @ a).norm()
        exact = run(peft, b, bf16=False)
        err = {fn.__name__: [((u - v).norm() / v.norm()).item() for u, v in zip(run(fn, b, bf16=True), exact)]
               for fn in (peft, merged)}
        assert all(e < 1e-2 for e in err["peft"])  # bf16's own rounding
        for name, got, ref in zip(("output", "x.grad", "A.grad", "B.grad"), err["merged"], err["peft"]):
            assert got <= 1.05 * ref, (size, name, got, ref)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_geglu_gives_the_same_loss_and_gradients(tiny_dir, monkeypatch, compiled):
    from sdxl_lora.sdxl import kernels as unet_kernels

    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    unet = tiny_unet_with_lora(tiny_dir)  # the "full" preset: the feed-forward projections have LoRA too
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    n = unet_kernels.use_fused_geglu(unet)
    assert n == sum(type(m).__name__ == "GEGLU" for m in unet.modules()) > 0
    if compiled:
        speed.compile_regions(unet, classes=("BasicTransformerBlock",))
    assert_same(ref, loss_and_grads(unet, batch))
    torch._dynamo.reset()


def test_geglu_backward_matches_autograd_in_bf16():
    from sdxl_lora.sdxl.kernels import geglu

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 6, 2 * 40, generator=g)).to(torch.bfloat16)
    grad = torch.randn(4, 6, 40, generator=g).to(torch.bfloat16)
    ref_x = x.float().requires_grad_()
    h, gate = ref_x.chunk(2, dim=-1)
    (h * torch.nn.functional.gelu(gate)).backward(grad.float())
    got_x = x.clone().requires_grad_()
    out = geglu(got_x)
    out.backward(grad)
    assert out.dtype == got_x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got_x.grad.float(), ref_x.grad, rtol=1e-2, atol=1e-2)
    # The gradient reaches both halves: a backward that dropped the gate's part would fail here.
    assert got_x.grad[..., 40:].abs().sum() > 0 and got_x.grad[..., :40].abs().sum() > 0


def test_regional_compile_with_channels_last_keeps_the_resnets_backward_graphs_in_layout(tiny_dir, monkeypatch):
    """The trainer's set-up (UNetCall.setup) with train.compile="regional" and channels_last: the
    convolutions' input gradients go the compiled, channels_last way, and the training signal is the same."""
    import types

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.task import SDXLTask

    # AOTAutograd's forward/backward split as inductor receives it, the backward graphs kept for a look.
    backward_graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           bw_compiler=lambda gm, _: backward_graphs.append(gm) or make_boxed_func(gm.forward))
    monkeypatch.setattr(speed, "COMPILE_BACKEND", backend)
    unet = tiny_unet_with_lora(tiny_dir)  # "full": LoRA convolutions inside the ResNets too
    batch = batch_for(unet)
    ref = loss_and_grads(unet, batch)
    task = SDXLTask(load_config(extra={"train.compile": "regional", "train.channels_last": True}))
    task.device = torch.device("cpu")
    task.dataset = types.SimpleNamespace(bucket_histogram=lambda: {(128, 128): 4})  # one bucket: static shapes
    task.unet_call.setup(unet, types.SimpleNamespace(event=lambda *a, **k: None))
    convs = [m for b in unet.modules() if type(b).__name__ in ("ResnetBlock2D", "Upsample2D") for m in b.modules()
             if type(m) is torch.nn.Conv2d]
    assert convs and all(m.forward.__func__ is unet_speed._conv_forward for m in convs)
    assert_same(ref, loss_and_grads(unet, batch))
    # The compiled ResNets' backward graphs compute the input gradients as (transposed) convolutions, which
    # inductor keeps channels_last, none with convolution_backward (each one of those a copy on the GPU).
    calls = [n for g in backward_graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any(n.target is torch.ops.aten.convolution.default and n.args[6] for n in calls)
    assert not [n for n in calls if n.target is torch.ops.aten.convolution_backward.default and n.args[10][0]]
    torch._dynamo.reset()


def test_transposed_convolution_gradient_under_autocast_with_trained_fp32_weights():
    # A LoRA factor's convolution keeps fp32 weights while autocast runs it in bf16 (as on the GPU): the
    # gradients of the input, the weight and the bias are torch's own, in each tensor's dtype.
    import types

    g = torch.Generator().manual_seed(0)
    ref_conv = torch.nn.Conv2d(8, 6, 3, padding=1, stride=2)
    x = torch.randn(2, 8, 9, 9, generator=g, requires_grad=True)

    def run(patched):
        conv = torch.nn.Conv2d(8, 6, 3, padding=1, stride=2)
        conv.load_state_dict(ref_conv.state_dict())
        if patched:
            conv.forward = types.MethodType(unet_speed._conv_forward, conv)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = conv(x)
        y.float().pow(2).sum().backward()
        return [y, x.grad, conv.weight.grad, conv.bias.grad]

    for got, ref in zip(run(True), run(False)):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref)


def test_a_compiler_failure_says_what_to_do_and_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    # torch.compile's backend failing in the first step (as inductor did over a warm cache on the H200, round
    # 8): the CLI says what to do first, then the error propagates with its traceback (not bad input).
    import torch._dynamo.exc

    from sdxl_lora.cli import main
    from sdxl_lora.sdxl.task import SDXLTask

    def failing_loss(self, model, batch):
        raise torch._dynamo.exc.BackendCompilerFailed(
            lambda: None, TypeError("'NoneType' object does not support the context manager protocol"), None)

    monkeypatch.setattr(SDXLTask, "loss", failing_loss)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        main(["train", "--out", str(tmp_path), "--name", "a", "--steps", "2", "--resolution", "64",
              "--device", "cpu", "--set", "preview.prompts=''", "--set", "preview.before=false"])
    err = capsys.readouterr().err
    assert "torch's compiler failed" in err and "context manager protocol" in err
    assert "train.compile=none" in err and "TORCHINDUCTOR_CACHE_DIR" in err and "--resume" in err


# ---- train.speed="auto", several buckets, check-ins without compilation (the product path) ----

def test_auto_speed_picks_the_levers_for_the_device_and_the_run_and_explicit_settings_win(tmp_path, monkeypatch):
    from sdxl_lora.sdxl.speed import auto_levers, compile_min_images, mark_compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile cache
    short = load_config(extra={"train.steps": 100, "train.batch_size": 4})
    assert auto_levers(short, "cpu", 1) == (short, {})  # off a GPU nothing changes
    cfg, why = auto_levers(short, "cuda", 1)
    assert (cfg.train.cuda_graphs, cfg.train.compile, cfg.train.channels_last) == (True, "none", False)
    assert "400 images" in why["compile"]  # says why it did not compile
    steps = compile_min_images(4, warm=False) // 4
    long = load_config(extra={"train.steps": steps, "train.batch_size": 4})
    cfg, why = auto_levers(long, "cuda", 1)
    assert (cfg.train.cuda_graphs, cfg.train.compile, cfg.train.channels_last) == (True, "regional", True)
    # Between the warm and the cold cache's thresholds a run compiles only where a run like it compiled here
    # before (the same model, adapter, data and batch): then compiling costs about a minute, not minutes.
    middle = load_config(extra={"train.steps": compile_min_images(4, warm=True) // 4 + 1, "train.batch_size": 4})
    cfg, why = auto_levers(middle, "cuda", 1)
    assert cfg.train.compile == "none" and "cold" in why["compile"]
    mark_compiled(auto_levers(middle, "cuda", 1)[0])  # as such a run does once its blocks have compiled
    cfg, why = auto_levers(middle, "cuda", 1)
    assert cfg.train.compile == "regional" and "warm" in why["compile"]
    other = load_config(extra={"train.steps": middle.train.steps, "train.batch_size": 4, "adapter.rank": 32})
    assert auto_levers(other, "cuda", 1)[0].train.compile == "none"  # another adapter: its own compilation
    # Small batches gain more from compiling: a batch-1 run compiles sooner.
    assert compile_min_images(1, warm=False) < compile_min_images(4, warm=False)
    assert compile_min_images(2, warm=True) == compile_min_images(1, warm=True)
    # A lever the user set is kept, and the others follow from it.
    mine = load_config(extra={"train.steps": steps, "train.batch_size": 4, "train.compile": "none"})
    cfg, why = auto_levers(mine, "cuda", 1)
    assert (cfg.train.compile, cfg.train.channels_last) == ("none", False) and "as set" in why["compile"]
    off = load_config(extra={"train.steps": steps, "train.speed": "off"})
    assert auto_levers(off, "cuda", 1)[0].train.cuda_graphs is False
    # What graphs cannot replay, and a base the compiled path has not been measured with.
    dropout = load_config(extra={"adapter.dropout": 0.1, "train.gradient_checkpointing": True})
    assert auto_levers(dropout, "cuda", 1)[0].train.cuda_graphs is False
    ddp = load_config(extra={"train.gradient_sync": "ddp"})
    assert auto_levers(ddp, "cuda", 2)[0].train.cuda_graphs is False
    nf4 = load_config(extra={"train.steps": steps, "train.batch_size": 4, "model.quantize": "nf4"})
    cfg, why = auto_levers(nf4, "cuda", 1)
    assert cfg.train.cuda_graphs and cfg.train.compile == "none" and "quantized" in why["compile"]


def test_graphs_of_every_bucket_share_one_memory_pool(monkeypatch):
    # CUDA graphs need a GPU; on the CPU the bookkeeping is what can be checked: one capture per input
    # shape, every capture into the same pool (so several buckets hold the largest one's memory, not the sum).
    pools, captured = [], []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pools.append(object()) or pools[-1])

    def make_graphed_callables(fn, sample_args, num_warmup_iters, allow_unused_input, pool):
        captured.append((tuple(a.shape for a in sample_args), pool))
        return fn

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    module = torch.nn.Linear(4, 4)
    graphed = speed.GraphedCall(module, lambda x: module(x))
    for rows in (2, 3, 2, 5, 3):  # three buckets, visited in turn
        graphed(torch.randn(rows, 4))
    assert [c[0] for c in captured] == [((2, 4),), ((3, 4),), ((5, 4),)]
    assert len(pools) == 1 and all(c[1] is pools[0] for c in captured)


def _bucketed_dataset(folder, sizes, n=4):
    from PIL import Image

    folder.mkdir()
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        Image.new("RGB", (w, h), (30 * i % 255, 120, 200)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"sks, a shape number {i}\n")
    return folder


def test_several_buckets_compile_once_and_previews_and_eval_compile_nothing(tmp_path, monkeypatch, caplog):
    # Counting compilations (a backend that counts the graphs it is given, then runs aot_eager) at each event
    # of a run over three aspect buckets with the step-0 and final previews and the eval loss on: nothing
    # compiles before training (the step-0 previews and eval), the first step compiles, and nothing after it
    # (the other buckets, the final eval and previews) compiles again. A shape per bucket, or the check-ins'
    # own shapes and no-grad graphs, would each add compilations. The log says it compiles before the compiler
    # starts, once: a user is never left with a silent first step.
    import logging

    from torch._dynamo.backends.debugging import aot_eager

    from sdxl_lora.core.runs import Run

    graphs, at, said = [], [], []

    class Said(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("compiling the UNet's blocks for this shape"):
                said.append(len(graphs))

    caplog.set_level(logging.INFO, logger="sdxl_lora.sdxl.unet_call")
    handler = Said()
    logging.getLogger("sdxl_lora.sdxl.unet_call").addHandler(handler)

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    event = Run.event

    def counted(self, kind, **fields):
        at.append((kind, fields.get("step"), len(graphs)))
        return event(self, kind, **fields)

    monkeypatch.setattr(speed, "COMPILE_BACKEND", counting)
    monkeypatch.setattr(Run, "event", counted)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    three = _bucketed_dataset(tmp_path / "data-three", [(128, 128), (160, 96), (96, 160)], n=6)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("sks, a shape --s 2\n")
    torch._dynamo.reset()
    assert main(["train", "--model", "tiny-sdxl", "--data", str(three), "--out", str(tmp_path), "--name", "three",
                 "--steps", "4", "--batch-size", "1", "--device", "cpu",
                 "--set", "train.compile='regional'", "--set", "train.channels_last=true", "--set", "data.resolution=128",
                 "--set", "data.bucket_step=32", "--set", "train.save_every=0", "--set", "adapter.preset='attn'",
                 "--set", "train.log_every=1", "--set", f"preview.prompts='{prompts}'"]) == 0
    torch._dynamo.reset()
    logging.getLogger("sdxl_lora.sdxl.unet_call").removeHandler(handler)
    assert said == [0]
    events = read_events(tmp_path / "three" / "events.jsonl")
    assert len(next(e for e in events if e["event"] == "dataset")["buckets"]) == 3
    assert {e["step"] for e in events if e["event"] == "samples"} == {0, 4}
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]  # 4 of 6 images in 3 buckets: at least two buckets
    counts = {(kind, step): n for kind, step, n in at}
    assert counts[("samples", 0)] == 0 and counts[("eval", 0)] == 0 and counts[("start", 0)] == 0
    first = counts[("step", 1)]
    assert first > 0 and len(graphs) == first, [(k, s, n) for k, s, n in at]
    # The run that compiled left its mark in the compile cache: the next run like it counts on a warm cache.
    from sdxl_lora.sdxl.speed import compile_cache_warm

    assert compile_cache_warm(load_config(tmp_path / "three" / "config.toml"))
    assert not compile_cache_warm(load_config(tmp_path / "three" / "config.toml", extra={"train.batch_size": 2}))

def _two_bucket_run(tmp_path) -> list[str]:
    """`sdxl-lora train` arguments (but the name and the levers) for 4 steps of the tiny model on the CPU over two
    buckets, every step logged, no previews."""
    two = _bucketed_dataset(tmp_path / "data", [(128, 128), (160, 96)], n=4)
    return ["--model", "tiny-sdxl", "--data", str(two), "--out", str(tmp_path), "--steps", "4", "--batch-size", "1",
            "--device", "cpu", "--set", "data.resolution=128", "--set", "data.bucket_step=32",
            "--set", "train.save_every=0", "--set", "adapter.preset='attn'", "--set", "train.log_every=1",
            "--set", "preview.prompts=''"]


def _graphs_as_on_cuda(monkeypatch, stand_in) -> None:
    """The SDXL task's training calls go through `stand_in` (in place of speed.GraphedCall), as set-up decides on
    a CUDA GPU with train.cuda_graphs: CUDA graphs cannot run on a CPU."""
    from sdxl_lora.sdxl.unet_call import CallState, UNetCall

    monkeypatch.setattr(speed, "GraphedCall", stand_in)
    speed_setup = UNetCall.setup

    def on_cuda(self, unet, run):
        speed_setup(self, unet, run)
        self.state = CallState.CAPTURE

    monkeypatch.setattr(UNetCall, "setup", on_cuda)


def test_the_steps_graphs_are_released_before_the_final_evaluation_and_previews(tmp_path, monkeypatch):
    # With train.cuda_graphs the steps replay from a pool holding a batch's activations, which no other work can
    # use. The final evaluation and previews come after the last step: the graphs must be gone by then, or the
    # previews' render adds to the training peak (the run's estimate counts them without it). CUDA graphs cannot
    # run on a CPU: a stand-in records its replays and its release beside the task's evaluations and previews.
    from sdxl_lora.sdxl.task import SDXLTask

    timeline = []

    class Graphs:
        def __init__(self, module, fn, **kw):
            self.module, self.fn = module, fn

        def __call__(self, *args):
            timeline.append("step")
            return self.fn(*args)

        def release(self):
            timeline.append("release")

    _graphs_as_on_cuda(monkeypatch, Graphs)
    for name in ("evaluate", "preview"):
        def recording(self, *args, _orig=getattr(SDXLTask, name), _name=name, **kwargs):
            timeline.append(_name)
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(SDXLTask, name, recording)
    common = _two_bucket_run(tmp_path)
    (tmp_path / "prompts.txt").write_text("a red star\n")
    assert main(["train", *common, "--name", "g", "--set", f"preview.prompts='{tmp_path / 'prompts.txt'}'",
                 "--set", "preview.steps=2", "--set", "preview.before=false"]) == 0
    assert timeline.count("step") == 4, timeline
    last = len(timeline) - 1 - timeline[::-1].index("step")
    # Released once, right after the last step; the final evaluation and previews run after it, with no replay.
    assert timeline[last + 1:] == ["release", "evaluate", "preview"], timeline
    assert (tmp_path / "g" / "samples" / "step-000004-00.png").is_file()


def test_evaluation_and_previews_run_without_cudnns_search_and_training_keeps_it(tmp_path, monkeypatch):
    # On a GPU training sets cuDNN's algorithm search on: each convolution shape is timed once and the choice
    # repays itself over the run's steps. Evaluation (several timesteps an image) and previews (the pipeline's
    # sizes) call the UNet a few times at shapes of their own, where the search would cost more than its choice
    # saves; they run on cuDNN's heuristic choice and leave the search on for training.
    from diffusers import UNet2DConditionModel

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # as speed.configure_backends sets it on CUDA
    calls = []
    forward = UNet2DConditionModel.forward

    def recording(self, *args, **kwargs):
        calls.append(("grad" if torch.is_grad_enabled() else "no grad", torch.backends.cudnn.benchmark))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(UNet2DConditionModel, "forward", recording)
    (tmp_path / "prompts.txt").write_text("a red star\n")
    common = _two_bucket_run(tmp_path)
    assert main(["train", *common, "--name", "r", "--set", f"preview.prompts='{tmp_path / 'prompts.txt'}'",
                 "--set", "preview.steps=2", "--set", "train.cuda_graphs=false"]) == 0
    searched = {c for c in calls if c[0] == "grad"}
    assert searched == {("grad", True)}  # the training steps
    assert {c for c in calls if c[0] == "no grad"} == {("no grad", False)}  # evaluation and previews
    assert calls.count(("no grad", False)) >= 3  # eval before and after, previews before and after
    assert torch.backends.cudnn.benchmark is True


def test_graphs_warm_every_bucket_up_before_capturing_any(tmp_path, monkeypatch):
    # A bucket warmed up (ordinary memory) after another was captured (the graphs' pool) would need its
    # activations twice: batch 16 at 1024 ran out of memory that way. The first training call warms up every
    # (bucket, batch size) the sampler will give, then captures each without further warm-up; the shapes
    # named are exactly those the epoch's batches come in (a bucket's last, partial batch included).
    from types import SimpleNamespace

    from sdxl_lora.sdxl import data as sdxl_data
    from sdxl_lora.sdxl.buckets import BucketBatchSampler
    from sdxl_lora.sdxl.task import SDXLTask

    events = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def make_graphed_callables(fn, sample_args, num_warmup_iters, allow_unused_input, pool):
        events.append(("capture", tuple(sample_args[0].shape), num_warmup_iters))
        return fn

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    monkeypatch.setattr(speed.GraphedCall, "_warm_up",
                        lambda self, samples: events.extend(("warm", tuple(s[0].shape)) for s in samples))
    data = _bucketed_dataset(tmp_path / "data", [(64, 64), (80, 48), (48, 80)], n=7)
    cfg = load_config(overrides=[f"data.dirs=[{str(data)!r}]", "train.batch_size=2"])
    task = SDXLTask(cfg)
    task.accelerator = SimpleNamespace(num_processes=1, process_index=0)
    task.pipe = SimpleNamespace(vae_scale_factor=8)
    task.dataset = sdxl_data.scan(cfg.data, 64)
    sampler = BucketBatchSampler(task.dataset, 2, cfg.train.seed)
    order = task.dataset.expanded()
    seen = {(task.dataset.items[order[b[0]]].bucket, len(b)) for b in sampler}
    assert sorted(seen) == sampler.batch_shapes()
    assert len(seen) > len(task.dataset.bucket_histogram())  # a partial batch among them

    first = (torch.randn(2, 4, 8, 8), torch.zeros(2), torch.randn(2, 77, 32), torch.randn(2, 32), torch.randn(2, 6))
    graphed = speed.GraphedCall(torch.nn.Linear(1, 1), lambda *a: a[0], others=task.unet_call.graph_inputs)
    graphed(*first)
    expected = {(b, 4, h // 8, w // 8) for (w, h), b in seen}
    warmed = [e[1] for e in events if e[0] == "warm"]
    captures = [e for e in events if e[0] == "capture"]
    assert set(warmed) == expected and len(warmed) == len(expected)
    assert events.index(captures[0]) == len(warmed)  # every warm-up before the first capture
    assert {c[1] for c in captures} == expected and all(c[2] == 0 for c in captures)
    last = sorted(expected)[-1]
    graphed(torch.randn(*last), *(a[:1].expand(last[0], *a.shape[1:]) for a in first[1:]))
    assert len([e for e in events if e[0] == "capture"]) == len(expected)  # replayed, not captured again



def test_graphs_that_do_not_fit_in_memory_leave_the_run_training_without_them(monkeypatch, caplog):
    # Under a memory cap the graphs' own pool can need more than an eager step; the capture's out-of-memory
    # error must not end the run: the call, and every later one, runs the function itself.
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    freed = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(True))
    tries = []

    def make_graphed_callables(fn, sample_args, **kw):
        tries.append(tuple(sample_args[0].shape))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 240.00 MiB")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    lin = torch.nn.Linear(3, 2)
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1)
    x = torch.randn(4, 3, requires_grad=True)
    with caplog.at_level("WARNING"):
        y = graphed(x)
    assert torch.equal(y, lin(x)) and y.requires_grad
    y.sum().backward()  # an ordinary autograd graph: the step trains
    assert lin.weight.grad is not None
    assert "CUDA graphs did not fit in memory" in caplog.text and freed and graphed.pool is None
    assert torch.equal(graphed(torch.ones(2, 3)), lin(torch.ones(2, 3)))
    assert tries == [(4, 3)]  # no second capture tried


def test_a_capture_cuda_refuses_leaves_the_run_training_without_graphs(monkeypatch, caplog):
    # CUDA can abandon a capture for other reasons than memory (an operation the capture cannot hold): the
    # run trains on without graphs and says why. A device error that is not about capturing still ends it.
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    error = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
    tries = []

    def make_graphed_callables(fn, sample_args, **kw):
        tries.append(tuple(sample_args[0].shape))
        raise torch.AcceleratorError(error)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    lin = torch.nn.Linear(3, 2)
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1, on_out_of_memory=lambda: pytest.fail("not memory"))
    x = torch.randn(4, 3)
    with caplog.at_level("WARNING"):
        assert torch.equal(graphed(x), lin(x))
    assert graphed.eager and "CUDA graphs could not be captured" in caplog.text and "legacy stream" in caplog.text
    assert torch.equal(graphed(x[:2]), lin(x[:2])) and tries == [(4, 3)]

    error = "CUDA error: an illegal memory access was encountered"
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        speed.GraphedCall(lin, lambda x: lin(x), warmup=1)(x)


@pytest.mark.parametrize("inside", ["out of memory", "out of memory a kernel caught", "an operation CUDA refused"])
def test_a_capture_abandoned_at_its_end_hands_its_memory_back_and_memory_runs_go_the_out_of_memory_way(
        monkeypatch, caplog, inside):
    # Memory running out inside a capture can leave CUDA abandoning it: torch.cuda.graph's exit then raises
    # "operation failed due to a previous error during capture" from capture_end (C++), which fails before it
    # marks the capture ended and before the exit leaves the capture's stream. The graphs' pool (every shape
    # captured so far) then stayed held for the rest of the run and the eager step beside it failed (H100, a
    # 16 GB card, batch 16): the pool is handed back and the stream put back. Out of memory inside (raised
    # through, or caught by a kernel's fallback and seen in the allocator's count): the task's on_out_of_memory
    # (checkpoint more) and a capture again; anything else CUDA refused: training on without graphs.
    calls = []
    current = ["the run's stream"]
    stats = {"num_ooms": 3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: dict(stats))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: calls.append(("set_stream", s)) or current.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: calls.append(("end", d, p)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: calls.append(("release", d, p)), raising=False)
    pools = iter(["pool 1", "pool 2"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    first = [True]

    def make_graphed_callables(fn, sample_args, **kw):
        if first.pop() if first else False:
            current[0] = "the capture's stream"  # torch.cuda.graph's enter
            try:
                if inside == "out of memory":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 320.00 MiB")
                if inside == "out of memory a kernel caught":
                    stats["num_ooms"] += 1
                    raise torch.AcceleratorError("CUDA error: operation not permitted when stream is capturing")
                raise RuntimeError("an operation that cannot be captured")
            except (torch.OutOfMemoryError, RuntimeError):
                # its exit: capture_end raises, and the capture's stream stays current
                raise torch.AcceleratorError("CUDA error: operation failed due to a previous error during capture")
        return lambda *a: fn(*a) * 1  # "replayed"

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    lin = torch.nn.Linear(3, 2)
    asked = []
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1, on_out_of_memory=lambda: asked.append(1) or True)
    x = torch.randn(4, 3)
    with caplog.at_level("WARNING"):
        assert torch.allclose(graphed(x), lin(x))
    assert calls == [("set_stream", "the run's stream"), ("end", 0, "pool 1"), ("release", 0, "pool 1")]
    assert current == ["the run's stream"]
    if inside == "an operation CUDA refused":
        assert not asked and graphed.eager and "CUDA graphs could not be captured" in caplog.text
        assert "inside it: an operation that cannot be captured" in caplog.text  # what CUDA said first
    else:
        assert asked == [1] and not graphed.eager and graphed.pool == "pool 2" and len(graphed.graphs) == 1
        assert "could not be captured" not in caplog.text


def test_a_capture_refused_before_its_end_leaves_the_pool_to_its_graph(monkeypatch):
    # A capture that ended (torch.cuda.graph's exit back on the run's stream) gives its pool back through its
    # graph: handing it back here as well would release it twice.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_ooms": 0})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "the run's stream")
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: pytest.fail("released twice"), raising=False)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def make_graphed_callables(fn, sample_args, **kw):
        raise torch.AcceleratorError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    lin = torch.nn.Linear(3, 2)
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1, on_out_of_memory=lambda: pytest.fail("not memory"))
    x = torch.randn(4, 3)
    assert torch.equal(graphed(x), lin(x)) and graphed.eager


def _task_whose_graphs_do_not_fit(tiny_dir, monkeypatch, checkpointed: int | None = None):
    """An SDXL task under a checkpoint budget whose tiny UNet's units have made-up sizes, `checkpointed` of
    them (default all) checkpointed, its events collected; CUDA graphs' pool handle and cache faked."""
    from types import SimpleNamespace

    from sdxl_lora.sdxl.task import SDXLTask

    unet = tiny_unet_with_lora(tiny_dir)
    units = unet_speed.checkpoint_units(unet)
    for i, u in enumerate(units):
        u.saved, u.flops = 1000 * (i + 1), 10
    order = [u.name for u in speed.checkpoint_order(units)]
    task = SDXLTask(load_config(None, ["train.checkpoint_budget_gb=1", "train.cuda_graphs=true"]))
    task.accelerator = SimpleNamespace(unwrap_model=lambda m: m)
    events = []
    task._run = SimpleNamespace(event=lambda kind, **kw: events.append((kind, kw)))
    task.unet_call.checkpointing = {"units": units, "chosen": order[:checkpointed], "graph_safe": True, "budget_gb": 1.0}
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return unet, units, order, task, events


def test_graphs_that_do_not_fit_beside_a_checkpoint_budget_checkpoint_more_and_capture_again(tiny_dir, monkeypatch,
                                                                                            caplog):
    # A budget's trial passes cannot see the graphs' pool: when the capture runs out of memory the task
    # checkpoints half the units it had left out and the capture is tried again; with every unit
    # checkpointed and still no room, the run trains on without graphs.
    unet, units, order, task, events = _task_whose_graphs_do_not_fit(tiny_dir, monkeypatch, checkpointed=1)
    unet_speed.apply_selective_checkpointing(unet, order[:1], True)
    fits_with = len(order) - 1  # the capture fits once all but one unit are checkpointed
    tries = []

    def make_graphed_callables(fn, sample_args, **kw):
        on = sum(bool(u.switch.gradient_checkpointing) for u in units)
        tries.append(on)
        if on < fits_with:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 240.00 MiB")
        return lambda *a: fn(*a) * 1  # "replayed"

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    lin = torch.nn.Linear(3, 2)
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1, on_out_of_memory=lambda: task.unet_call.checkpoint_more(unet))
    with caplog.at_level("WARNING"):
        graphed(torch.randn(4, 3))
    # Each retry checkpoints half of what was left (at least one), in checkpoint order, until it fits.
    expect, on = [1], 1
    while on < fits_with:
        on += max(1, (len(order) - on) // 2)
        expect.append(on)
    assert tries == expect and not graphed.eager and len(graphed.graphs) == 1
    assert task.unet_call.checkpointing["chosen"] == order[:expect[-1]]
    assert "capturing again" in caplog.text and "training on without them" not in caplog.text
    assert [kw["reason"] for kind, kw in events if kind == "checkpointing"] == ["cuda_graphs_out_of_memory"] * \
        (len(expect) - 1)

    # Nothing fits: every unit gets checkpointed, then the run goes on without graphs.
    fits_with = len(order) + 1
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1, on_out_of_memory=lambda: task.unet_call.checkpoint_more(unet))
    x = torch.randn(2, 3)
    with caplog.at_level("WARNING"):
        assert torch.equal(graphed(x), lin(x))
    assert graphed.eager and task.unet_call.checkpointing["chosen"] == order
    assert all(u.switch.gradient_checkpointing for u in units if u.name in order)
    assert "training on without them" in caplog.text


def test_graphs_that_do_not_fit_with_every_unit_checkpointed_split_the_batch_and_capture_smaller(tiny_dir,
                                                                                                   monkeypatch, caplog):
    # Every unit checkpointed and still no room for the graphs' pool: the task halves its micro-batches
    # (the loop then trains each batch in parts) and the graphs are captured at the smaller size; the call
    # that found it out, and any later call at the old size, runs without graphs. Single images that do not
    # fit leave the run without graphs.
    from types import SimpleNamespace

    unet, units, order, task, events = _task_whose_graphs_do_not_fit(tiny_dir, monkeypatch)
    task._sampler = lambda: SimpleNamespace(batch_shapes=lambda: [((64, 64), 4), ((64, 48), 3)])
    fits = 2  # rows the capture fits
    tries = []

    def make_graphed_callables(fn, sample_args, **kw):
        tries.append(sample_args[0].shape[0])
        if sample_args[0].shape[0] > fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 240.00 MiB")
        return lambda *a: fn(*a) * 1  # "replayed"

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    lin = torch.nn.Linear(3, 2)
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1,
                                on_out_of_memory=lambda: task.unet_call.checkpoint_more(unet) or task.unet_call.split_batches())
    x = torch.randn(4, 3)
    with caplog.at_level("WARNING"):
        assert torch.equal(graphed(x), lin(x))  # this call without graphs
    assert task.micro_batches == 2 and not graphed.eager and tries == [4]
    assert "4 now trains as 2 micro-batches of up to 2 images" in caplog.text
    assert [kw for kind, kw in events if kind == "micro_batches"] == [
        {"parts": 2, "images": 2, "reason": "cuda_graphs_out_of_memory"}]
    graphed(x)  # the rest of that step, at the old size: no capture tried
    assert tries == [4]
    halves = task.split({"latent_mean": x, "sample_key": torch.arange(4), "shared": "caption"})
    assert [(b["latent_mean"].shape[0], b["sample_key"].tolist(), b["shared"], share) for b, share in halves] == [
        (2, [0, 1], "caption", 0.5), (2, [2, 3], "caption", 0.5)]
    graphed(halves[0][0]["latent_mean"])
    assert tries == [4, 2] and len(graphed.graphs) == 1  # captured at the micro-batch's size
    # A bucket of 3 splits 2 + 1: the sizes its micro-batches come in.
    assert [b["latent_mean"].shape[0] for b, _ in task.split({"latent_mean": x[:3]})] == [2, 1]

    # Single images do not fit either: halving stops there and the run trains without graphs.
    fits = 0
    graphed = speed.GraphedCall(lin, lambda x: lin(x), warmup=1,
                                on_out_of_memory=lambda: task.unet_call.checkpoint_more(unet) or task.unet_call.split_batches())
    for rows in (2, 1):
        graphed(torch.randn(rows, 3))
    assert task.micro_batches == 4 and graphed.eager
    assert "training on without them" in caplog.text


def test_a_large_batch_is_measured_on_a_centre_crop_that_scales_to_the_same_activations(tiny_dir):
    # Selective checkpointing measures one sample's activations with every one kept; at 1024 on SDXL that
    # alone is more than an 8 GiB budget holds, so large latents are measured on a crop and scaled up.
    from sdxl_lora.sdxl.unet_call import measuring_sample

    unet = tiny_unet_with_lora(tiny_dir)
    side = 4 * unet.config.sample_size
    g = torch.Generator().manual_seed(0)
    batch = {"latent_mean": torch.randn(3, 4, side, side, generator=g), "latent_std": torch.ones(3, 4, side, side),
             "mask": torch.ones(3, 1, side, side), "time_ids": torch.zeros(3, 6)}
    one, scale = measuring_sample(batch, 3, limit=(side // 2) ** 2)
    assert one["latent_mean"].shape[-2:] == (side // 2, side // 2) and one["mask"].shape[-2:] == (side // 2, side // 2)
    assert one["time_ids"].shape == (1, 6) and scale == 3 * 4
    # Small latents are measured whole.
    whole, s1 = measuring_sample(batch, 3, limit=side * side)
    assert whole["latent_mean"].shape[-2:] == (side, side) and s1 == 3

    def measured(latents):
        b = batch_for(unet, b=1)
        b["sample"] = latents
        units = unet_speed.checkpoint_units(unet)
        speed.measure_units(unet, units, lambda: unet(**b).sample)
        return {u.name: u.saved for u in units}

    full = measured(batch["latent_mean"][:1])
    crop = measured(one["latent_mean"])
    for name, saved in full.items():
        assert saved == 0 and crop[name] == 0 or abs(crop[name] * 4 - saved) <= 0.1 * saved, name


def test_the_memory_cap_leaves_the_cuda_context_room_inside_the_budget(monkeypatch):
    # train.vram_gb on a larger card: torch's allocator gets the budget less what the CUDA context takes
    # outside it, so the whole process (as nvidia-smi counts it) stays within the budget; a card no larger
    # than the budget is left uncapped.
    from types import SimpleNamespace

    from sdxl_lora.core import memory

    capped = []
    total = 140 * memory.GiB
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: capped.append((f, i)))
    assert memory.cap_process_memory(torch.device("cuda"), 8)
    (fraction, index), = capped
    assert index == 0 and fraction * total + memory.CAP_CONTEXT == pytest.approx(8 * memory.GiB)
    assert memory.CAP_CONTEXT >= memory.CONTEXT  # the cap's room is no smaller than the estimate's
    assert not memory.cap_process_memory(torch.device("cuda:0"), 200) and len(capped) == 1


def test_a_launch_lets_the_cuda_allocator_grow_its_segments_unless_the_user_chose(monkeypatch, capsys):
    # Fixed-size segments leave reserved memory the run cannot use; every sdxl-lora command asks torch for
    # expandable ones before its first CUDA allocation, and an allocator setting of the user's own wins.
    import os

    from sdxl_lora import training

    names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in names})
    assert main(["llm", "plan", "--json"]) == 0
    capsys.readouterr()
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    key = "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 10) else "PYTORCH_CUDA_ALLOC_CONF"
    assert os.environ[key] == "expandable_segments:True"

    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert training.prefer_expandable_segments(mine) is None
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    # WSL's driver fails the virtual-memory calls expandable segments need.
    wsl = os.uname_result(("Linux", "pc", "5.15.167.4-microsoft-standard-WSL2", "#1", "x86_64"))
    monkeypatch.setattr(os, "uname", lambda: wsl)
    assert training.prefer_expandable_segments({}) is None
