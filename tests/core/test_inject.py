"""The injector: slots read from the model's structure, presets, resolution-scaled ranks, overrides."""
import json

import pytest
import torch

from sdxl_lora.core import inject
from sdxl_lora.llm import slots as llm_slots
from sdxl_lora.sdxl import slots as unet_slots
from sdxl_lora.cli import main
from sdxl_lora.sdxl.config import AdapterConfig, ModelConfig
from sdxl_lora.sdxl.model import unet_skeleton


@pytest.fixture(scope="module")
def sdxl_unet():
    unet, native = unet_skeleton(ModelConfig(path="arch:sdxl"))
    assert native == 1024
    return unet


def expected_attn_plan(config: dict, rank: int) -> tuple[int, int]:
    """Modules and parameters of LoRA on every attention's q/k/v/out, from the UNet config alone."""
    chans = config["block_out_channels"]
    layers = config["transformer_layers_per_block"]
    layers = layers if isinstance(layers, list) else [layers] * len(chans)
    cross = config["cross_attention_dim"]
    per_level = []
    for level, (c, kind) in enumerate(zip(chans, config["down_block_types"])):
        if "CrossAttn" in kind:
            blocks = config["layers_per_block"] + (config["layers_per_block"] + 1)  # down + up
            per_level.append((c, blocks * layers[level]))
    per_level.append((chans[-1], layers[-1]))  # mid block
    modules = params = 0
    for c, transformer_blocks in per_level:
        modules += transformer_blocks * 8
        self_attn = 4 * rank * (c + c)
        cross_attn = rank * (c + c) * 2 + rank * (cross + c) * 2  # q, out from c; k, v from the text
        params += transformer_blocks * (self_attn + cross_attn)
    return modules, params


def test_attn_preset_on_full_sdxl_matches_the_config(sdxl_unet):
    plan = unet_slots.make_plan(sdxl_unet, AdapterConfig(preset="attn", rank=16), resolution=1024, native=1024)
    modules, params = expected_attn_plan(dict(sdxl_unet.config), 16)
    assert len(plan.targets) == modules == 560
    assert plan.trainable_params == params == 23_224_320


def test_slots_carry_level_block_kind_and_projection(sdxl_unet):
    by_name = {s.name: s for s in unet_slots.slots(sdxl_unet)}
    s = by_name["down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"]
    assert (s.part, s.level, s.block, s.kind, s.proj) == ("down", 1, "IN04", "attn1", "to_q")
    s = by_name["up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_k"]
    assert (s.part, s.level, s.block, s.kind, s.proj, s.in_features) == ("up", 2, "OUT02", "attn2", "to_k", 2048)
    s = by_name["mid_block.attentions.0.transformer_blocks.0.attn2.to_v"]
    assert (s.part, s.block) == ("mid", "MID")
    assert by_name["down_blocks.0.resnets.0.conv1"].kind == "resnet"
    assert by_name["down_blocks.0.resnets.0.conv1"].conv
    assert by_name["up_blocks.1.attentions.0.transformer_blocks.0.ff.net.2"].kind == "ff"
    assert by_name["add_embedding.linear_1"].kind == "embed"


def test_topology_weights_cross_attention_q_v_above_outputs_and_deep_levels_above_shallow(sdxl_unet):
    plan = unet_slots.make_plan(sdxl_unet, AdapterConfig(preset="topology", rank=16), resolution=1024, native=1024)
    r = plan.rank
    deep = "down_blocks.2.attentions.0.transformer_blocks.0"
    shallow = "down_blocks.1.attentions.0.transformer_blocks.0"
    assert r[f"{deep}.attn2.to_v"] == r[f"{deep}.attn2.to_q"] == 16
    assert r[f"{deep}.attn2.to_out.0"] < r[f"{deep}.attn2.to_v"]
    assert r[f"{shallow}.attn2.to_v"] < r[f"{deep}.attn2.to_v"]
    assert all(plan.alpha[n] == r[n] for n in r)  # alpha/rank the same everywhere
    attn = unet_slots.make_plan(sdxl_unet, AdapterConfig(preset="attn", rank=16), resolution=1024, native=1024)
    assert set(r) == {s.name for s in attn.targets}
    assert plan.trainable_params < attn.trainable_params


def test_rank_scales_with_resolution(sdxl_unet):
    cfg = AdapterConfig(preset="attn", rank=16)
    assert unet_slots.make_plan(sdxl_unet, cfg, resolution=512, native=1024).base_rank == round(16 * 0.5 ** 0.5)
    assert unet_slots.make_plan(sdxl_unet, cfg, resolution=2048, native=1024).base_rank == round(16 * 2 ** 0.5)
    clamped = AdapterConfig(preset="attn", rank=16, max_rank=20)
    assert unet_slots.make_plan(sdxl_unet, clamped, resolution=2048, native=1024).base_rank == 20
    off = AdapterConfig(preset="attn", rank=16, scale_rank_with_resolution=False)
    assert unet_slots.make_plan(sdxl_unet, off, resolution=512, native=1024).base_rank == 16


def test_glob_and_kohya_block_overrides(sdxl_unet):
    cfg = AdapterConfig(preset="attn", rank=8, overrides={"*.attn2.to_v": 32, "OUT0[0-2]": 0})
    plan = unet_slots.make_plan(sdxl_unet, cfg, resolution=1024, native=1024)
    assert all(s.block not in ("OUT00", "OUT01", "OUT02") for s in plan.targets)
    assert {plan.rank[s.name] for s in plan.targets if s.kind == "attn2" and s.proj == "to_v"} == {32}
    assert {plan.rank[s.name] for s in plan.targets if s.proj == "to_q"} == {8}
    lcfg = plan.lora_config()
    assert lcfg.r == 8 and all(v == 32 for v in lcfg.rank_pattern.values())


def test_sdxl_default_plan_gives_every_layer_its_rank_and_scale_through_few_patterns():
    # The default plan at 1024 mixes ranks over SDXL's 560 layers. Each must get its own rank and alpha/rank in
    # peft, and the config carries one pattern per distinct value: peft tries every pattern on every layer.
    unet, _ = unet_skeleton(ModelConfig(path="arch:sdxl"))
    plan = unet_slots.make_plan(unet, AdapterConfig(), resolution=1024, native=1024)
    assert len(set(plan.rank.values())) > 1
    lcfg = plan.lora_config()
    assert len(lcfg.rank_pattern) < len(set(plan.rank.values()))
    assert len(lcfg.alpha_pattern) < len(set(plan.alpha.values()))
    inject.apply_plan(unet, plan)
    modules = dict(unet.named_modules())
    for s in plan.targets:
        layer = modules[s.name]
        assert layer.r["default"] == plan.rank[s.name], s.name
        assert layer.scaling["default"] == pytest.approx(plan.alpha[s.name] / plan.rank[s.name]), s.name


def test_mixed_rank_plan_and_lora_bias_reach_peft(tiny_dir):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_dir, subfolder="unet")
    plan = unet_slots.make_plan(unet, AdapterConfig(preset="topology", rank=8, lora_bias=True), resolution=128, native=128)
    inject.apply_plan(unet, plan)
    trainable = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == plan.trainable_params
    for s in plan.targets:
        a = trainable[f"{s.name}.lora_A.default.weight"]
        assert a.shape[0] == plan.rank[s.name]
        assert f"{s.name}.lora_B.default.bias" in trainable


def test_llm_slots_by_layer_and_projection():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    slots = [s for s in llm_slots.slots(model) if s.part == "layer"]
    assert {(s.index, s.proj) for s in slots} == {(i, p) for i in range(2)
                                                 for p in ("q", "k", "v", "o", "gate", "up", "down")}
    from sdxl_lora.llm.config import AdapterConfig as LLMAdapterConfig

    plan = llm_slots.make_plan(model, LLMAdapterConfig(preset="attn", rank=4))
    assert {s.proj for s in plan.targets} == {"q", "k", "v", "o"}


def test_plan_command_json_on_the_sdxl_architecture(capsys):
    assert main(["plan", "--model", "arch:sdxl", "--layers", "attn", "--rank", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["modules"] == 560 and out["trainable_params"] == 23_224_320
    assert abs(out["adapter_mb"] - 23_224_320 * 4 / 2**20) < 0.01
    assert sum(g["modules"] for g in out["groups"]) == 560


def test_rank_budget_redistributes_by_measured_sensitivity_and_trains(tmp_path):
    from safetensors.torch import load_file

    from sdxl_lora.core.runs import read_events

    budget = 150_000  # the demo base's plan has 181 modules (its recommended conv LoRA included): 63,168 at rank 1
    args = ["train", "--out", str(tmp_path), "--steps", "3", "--set", "preview.prompts=''",
            "--set", f"adapter.rank_budget={budget}", "--set", "train.save_every=0"]
    assert main([*args, "--name", "a"]) == 0
    assert main([*args, "--name", "b"]) == 0
    ev = {e["event"]: e for e in read_events(tmp_path / "a" / "events.jsonl")}
    chosen = ev["budget"]["trainable_params"]
    assert 0.85 * budget <= chosen <= budget
    assert ev["plan"]["trainable_params"] == chosen
    ranks = {g["rank"] for g in ev["plan"]["groups"]}
    assert len(ranks) > 2  # spread by sensitivity, not one rank
    # Deterministic: the same data and seed give the same ranks and the same adapter.
    evb = {e["event"]: e for e in read_events(tmp_path / "b" / "events.jsonl")}
    assert evb["plan"]["groups"] == ev["plan"]["groups"]
    a = load_file(tmp_path / "a" / "a.diffusers.safetensors")
    b = load_file(tmp_path / "b" / "b.diffusers.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The most sensitive slot gets at least the rank of the least sensitive one of the same kind.
    sens = ev["budget"]["sensitivity"]
    shapes = {k: v.shape[0] for k, v in a.items() if k.endswith("lora_A.weight")}
    rank_of = {k.removeprefix("unet.").removesuffix(".lora_A.weight"): r for k, r in shapes.items()}
    q = sorted((n for n in sens if n.endswith("attn2.to_q")), key=sens.get)
    assert rank_of[q[-1]] >= rank_of[q[0]]


def test_rank_budget_below_the_minimum_is_refused(sdxl_unet):
    plan = unet_slots.make_plan(sdxl_unet, AdapterConfig(preset="attn", rank=16), resolution=1024, native=1024)
    with pytest.raises(ValueError, match="rank_budget=1,000 parameters is below"):
        inject.budget_plan(plan, {s.name: 1.0 for s in plan.targets}, 1000, 1, 64)
