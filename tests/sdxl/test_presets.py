"""Presets (sdxl/presets.py): card presets are budgets the planner fits on SDXL base's real architecture (meta
device: no weights), goal presets set what docs/training.md says, and whatever the user sets wins."""
import json
import re
from pathlib import Path

import pytest

from sdxl_lora.cli import main
from sdxl_lora.sdxl import presets
from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.sdxl.plan import card_plans

GIB = 2**30
DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _docs_table(first_column: str) -> dict[str, list[str]]:
    """The rows of the Presets section's table whose header starts with `first_column`, by their first cell's
    name (in backticks)."""
    section = DOCS.read_text(encoding="utf-8").split("## Presets", 1)[1].split("\n## ", 1)[0]
    rows, inside = {}, False
    for line in section.splitlines():
        if line.startswith(f"| {first_column} |"):
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[re.search(r"`([^`]+)`", cells[0]).group(1)] = cells
        elif inside and not line.startswith("|"):
            break
    return rows


@pytest.fixture(scope="module")
def sdxl_cards():
    cfg = load_config(extra={"model.path": "arch:sdxl"})
    return cfg, {p.name: p for p in card_plans(cfg)}


def test_every_card_preset_fits_its_budget_and_the_docs_table_is_the_planners(sdxl_cards):
    cfg, plans = sdxl_cards
    documented = _docs_table("card")
    assert set(documented) == set(presets.CARDS) == set(plans)
    for name, plan in plans.items():
        assert plan.error is None, name
        if plan.budget is not None:
            assert plan.memory.peak <= plan.budget * GIB, name
            c = plan.fit.cfg
            assert c.train.batch_size * c.train.grad_accum == cfg.train.batch_size  # the same images per step
        # The table's peak and time are what `sdxl-lora presets` prints for this model and batch.
        peak, time = documented[name][3], documented[name][4]
        assert peak == f"{plan.memory.peak / GIB:.1f} GiB" and time == f"{plan.slowdown:.2f}x", name
    # Smaller cards trade time for memory; the planner, not a table, chose how.
    assert plans["8gb"].fit.cfg.model.quantize == plans["6gb"].fit.cfg.model.quantize == "nf4"
    assert plans["12gb"].fit.cfg.model.quantize == "none" and plans["6gb"].fit.cfg.model.tiled_vae_encode
    ladder = [plans[n].slowdown for n in ("48gb", "24gb", "16gb", "12gb", "8gb", "6gb")]
    assert ladder == sorted(ladder) and ladder[-1] > ladder[0]


def test_a_fast_card_compiles_and_keeps_more_activations_than_the_plain_card():
    # At batch 4 both 24 GiB cards recompute part of the step; the compiled blocks keep fewer activations, so
    # the fast card recomputes less and is planned faster.
    cfg = load_config(extra={"model.path": "arch:sdxl", "train.batch_size": 4})
    plans = {p.name: p for p in card_plans(cfg)}
    plain, fast = plans["24gb"].fit, plans["24gb-fast"].fit
    assert fast.cfg.train.compile == "regional" and fast.cfg.train.channels_last
    assert plain.cfg.train.compile == "none" and plain.cfg.train.batch_size * plain.cfg.train.grad_accum == 4
    assert fast.cfg.train.batch_size == 4
    assert fast.slowdown < plain.slowdown and fast.memory.peak <= 24 * GIB


def test_goal_presets_set_what_the_docs_say():
    documented = _docs_table("goal")
    assert set(documented) == set(presets.GOALS)
    for name, cells in documented.items():
        cfg = load_config(extra={"model.path": "arch:sdxl", "goal": name})
        layers, rank_alpha, lr, dropout, flip, snr = cells[1:]
        assert f"`{cfg.adapter.preset}`" in layers, name
        assert rank_alpha == f"{cfg.adapter.rank} / {cfg.adapter.alpha:g}", name
        assert float(lr) == cfg.train.lr and float(dropout) == cfg.data.caption_dropout, name
        assert flip == str(cfg.data.flip).lower() and float(snr) == cfg.train.min_snr_gamma, name
    assert load_config(extra={"goal": "style"}).adapter.conv_rank == 16


def test_what_you_set_wins_over_a_preset_and_plan_says_what_the_preset_set(capsys):
    cfg = load_config(overrides=["adapter.rank=8"], extra={"model.path": "arch:sdxl", "card": "8gb",
                                                          "goal": "style", "train.vram_gb": 10})
    assert cfg.adapter.rank == 8 and cfg.train.vram_gb == 10  # yours
    assert cfg.adapter.preset == "locon" and cfg.train.lr == 1e-4  # the preset's, where you set nothing
    assert main(["plan", "--model", "arch:sdxl", "--preset", "8gb,character", "--set", "train.lr=3e-5",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["card"] == "8gb" and data["goal"] == "character" and data["preset"] == "full"
    assert data["preset_settings"]["train.lr"].startswith("3e-05 (yours")
    assert data["preset_settings"]["train.vram_gb"] == "8.0"
    assert data["run_memory"]["peak_gib"] <= 8 and data["budget_choices"]["model.quantize"] == "'nf4' (was 'none')"
    assert data["slowdown"] > 1
    assert main(["plan", "--model", "arch:sdxl", "--preset", "12gb"]) == 0
    out = capsys.readouterr().out
    assert "preset card 12gb: train.vram_gb 12.0" in out and "x the time per image" in out


def test_an_unknown_preset_is_refused_naming_the_choices(capsys):
    assert main(["train", "--preset", "10gb", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "'10gb': no such preset" in err and "8gb" in err and "character" in err and "Traceback" not in err
    assert main(["plan", "--preset", "8gb,12gb"]) == 2
    assert "two card presets" in capsys.readouterr().err
    # A layer preset's name is adapter.preset's: the message says where it went.
    assert main(["plan", "--model", "arch:sdxl", "--preset", "attn"]) == 2
    assert "--layers attn" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"goal='portrait': no such goal preset; card presets: 6gb"):
        load_config(extra={"goal": "portrait"})
    with pytest.raises(ConfigError, match="card = '8gb': a setting of task='sdxl', which does nothing for task='llm'"):
        load_config(extra={"task": "llm", "card": "8gb"})


def test_the_presets_listing_gives_each_cards_peak_and_time_without_reading_weights(capsys):
    assert main(["presets", "--model", "arch:sdxl", "--batch-size", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cards = {c["preset"]: c for c in data["cards"]}
    assert set(cards) == set(presets.CARDS) and set(data["goals"]) == set(presets.GOALS)
    assert all(c["peak_gib"] <= c["vram_gb"] for c in cards.values() if c["vram_gb"])
    assert cards["none"]["slowdown"] == 1.0 and cards["6gb"]["slowdown"] > cards["12gb"]["slowdown"]
    assert main(["presets", "--model", "arch:sdxl"]) == 0
    out = capsys.readouterr().out
    assert "24gb-fast" in out and "time/image" in out and "goal presets" in out
