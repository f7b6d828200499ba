"""Every card by default: a run with no train.vram_gb plans its whole run for the GPU it finds (core/card.py,
sdxl/plan.py: plan_run), changes only what must change to fit, keeps what the user set, and is refused before
the model loads where that cannot fit; a step that runs out of memory anyway saves and stops. On SDXL base's
real architecture (meta device: no weights) and pretend cards, as `sdxl-lora plan --card N` shows them."""
import json

import pytest

from sdxl_lora.cli import main
from sdxl_lora.core.card import CARD_MARGIN_GIB, Card, pretend_card
from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.core.memory import GiB
from sdxl_lora.sdxl.plan import plan_run


def sdxl(**fields):
    return load_config(extra={"model.path": "arch:sdxl", **fields})


def test_a_run_that_fits_the_card_is_left_as_set_and_one_that_does_not_gets_only_what_it_needs():
    cfg = sdxl(**{"train.batch_size": 2})
    for gb in (80, 24):
        big = plan_run(cfg, pretend_card(gb))
        assert big.changes == {} and big.cfg == cfg and big.budget_gib is None  # nothing capped, nothing changed
        assert f"fits a {gb} GB card" in big.verdict()
    for gb in (16, 12, 8):
        run = plan_run(cfg, pretend_card(gb))
        assert run.memory.peak <= gb * GiB, gb
        assert run.changes, gb  # the default batch-2 run does not fit these cards as set
        # The run caps itself at the card's budget: the config it trains with carries it.
        assert run.cfg.train.vram_gb == pretend_card(gb).budget_gib
        assert run.slowdown > 1.0 and f"a {gb} GB card" in run.verdict()
    # A bigger card never asks for more than a smaller one: slower levers only where memory is short.
    slowdowns = [plan_run(cfg, pretend_card(gb)).slowdown for gb in (80, 24, 16, 12, 8)]
    assert slowdowns == sorted(slowdowns)


def test_the_card_budget_is_its_free_memory_less_a_margin_in_steps_so_relaunches_plan_alike():
    a = Card("GPU", 24 * GiB, int(21.73 * GiB))
    b = Card("GPU", 24 * GiB, int(21.81 * GiB))  # a few MiB more free at the next launch
    assert a.budget_gib == b.budget_gib == 21.0
    assert a.budget_gib <= 21.73 - CARD_MARGIN_GIB
    assert "24 GB card" in a.describe() and "21.7 GiB free" in a.describe()
    with pytest.raises(ValueError, match="--card 0"):
        pretend_card(0)


def test_settings_the_user_set_are_kept_and_a_card_they_cannot_fit_is_refused_with_settings_that_do():
    # Unset, an 8 GB card gets a compressed base; set to none, the base stays as it is where that fits.
    assert plan_run(sdxl(**{"train.batch_size": 1}), pretend_card(8)).cfg.model.quantize != "none"
    kept = plan_run(sdxl(**{"train.batch_size": 1, "model.quantize": "none"}), pretend_card(12))
    assert kept.cfg.model.quantize == "none" and kept.memory.peak <= 12 * GiB
    # A 16-bit base with nothing recomputed cannot fit 8 GB: refused, naming what was set and what fits.
    asked = sdxl(**{"train.batch_size": 2, "model.quantize": "none", "train.gradient_checkpointing": False})
    with pytest.raises(ConfigError) as e:
        plan_run(asked, pretend_card(8))
    msg = str(e.value)
    assert "8 GB card" in msg and "model.quantize='none'" in msg and "train.gradient_checkpointing=False" in msg
    assert "Settings that fit: " in msg
    # The settings it names do fit that card.
    named = msg.split("Settings that fit: ")[1].split(" (whole run")[0]
    fixed = {k: eval(v) for k, v in (kv.split("=", 1) for kv in named.split("; "))}  # noqa: S307 (reprs it wrote)
    again = plan_run(sdxl(**{"train.batch_size": 2, **fixed}), pretend_card(8))
    assert again.memory.peak <= 8 * GiB
    # Nothing fits at all: what to change instead.
    with pytest.raises(ConfigError, match="even with the least memory.*data.resolution"):
        plan_run(sdxl(**{"data.resolution": 2048, "adapter.preset": "locon"}), pretend_card(4))


def test_plan_names_the_card_and_what_the_run_will_do_on_it(capsys):
    assert main(["plan", "--model", "arch:sdxl", "--card", "24", "--batch-size", "2"]) == 0
    assert "card: fits a 24 GB card" in capsys.readouterr().out
    assert main(["plan", "--model", "arch:sdxl", "--card", "12", "--batch-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"]["gib"] == 12 and out["budget_choices"] and out["slowdown"] > 1
    assert out["run_memory"]["peak_gib"] <= 12 and "a 12 GB card" in out["verdict"]
    # No GPU on this machine and no --card: it says so rather than pretending.
    assert main(["plan", "--model", "arch:sdxl"]) == 0
    assert "no GPU here: give --card N" in capsys.readouterr().out
    # Settings the card cannot hold: exit 2, one paragraph, before any weight is read.
    assert main(["plan", "--model", "arch:sdxl", "--card", "8", "--set", "model.quantize='none'",
                 "--set", "train.gradient_checkpointing=false"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold this run" in err and "Traceback" not in err


def test_a_run_on_a_card_too_small_for_what_was_set_is_refused_before_the_model_loads(monkeypatch):
    # The task plans in configure(), before set-up reads any weight: a card found too small refuses there.
    import sdxl_lora.sdxl.task as task_module

    monkeypatch.setattr(task_module, "this_card", lambda index, free=True: pretend_card(8))
    loaded = []
    monkeypatch.setattr(task_module, "load_pipeline", lambda *a, **k: loaded.append(a))
    cfg = sdxl(**{"train.batch_size": 2, "model.quantize": "none", "train.gradient_checkpointing": False})
    task = task_module.SDXLTask(cfg)
    with pytest.raises(ConfigError, match="8 GB card"):
        task.configure(cfg, "cuda", 1)
    assert not loaded
    # Left to the planner, the same run fits, capped at the card's budget.
    cfg = sdxl(**{"train.batch_size": 2})
    fitted = task_module.SDXLTask(cfg).configure(cfg, "cuda", 1)
    assert fitted.train.vram_gb == pretend_card(8).budget_gib and fitted.model.quantize != "none"


def test_a_causal_lm_fits_the_card_the_same_way(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False).save_pretrained(tmp_path)
    base = ["llm", "plan", "--json", "--model", str(tmp_path), "--max-length", "2048", "--batch-size", "4"]
    assert main([*base, "--card", "80"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_choices"] is None  # fits as set
    assert main([*base, "--card", "12"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["budget_choices"] and got["process_peak_gib"] <= 12 and "12 GB card" in got["verdict"]
    assert main([*base, "--card", "8", "--set", "model.quantize='none'"]) == 2
    err = capsys.readouterr().err
    assert "model.quantize='none' as you set" in err and "Settings that fit: model.quantize='nf4'" in err


def test_a_step_that_runs_out_of_memory_saves_the_state_and_stops_with_the_resume_command(
        tiny_dir, tmp_path, monkeypatch, capsys):
    from sdxl_lora.core import checkpoint
    from sdxl_lora.core.runs import read_events

    monkeypatch.setattr(checkpoint, "_OOM_AT", "3")  # step 3's allocation fails, as a GPU's allocator does
    args = ["train", "--model", str(tiny_dir), "--data", "sample_data/images", "--steps", "4", "--out",
            str(tmp_path), "--name", "r", "--set", "train.save_every=0", "--set", "preview.prompts=''"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "stopped at step 2: the GPU ran out of memory" in out and "train.gradient_checkpointing=true" in out
    assert "resume with: sdxl-lora train --resume" in out
    assert (tmp_path / "r" / "checkpoints" / "step-00000002").is_dir()
    assert read_events(tmp_path / "r" / "events.jsonl")[-1]["event"] == "interrupted"
    # The resume the message names finishes the run.
    monkeypatch.setattr(checkpoint, "_OOM_AT", None)
    assert main(["train", "--resume", str(tmp_path / "r"), "--set", "train.gradient_checkpointing=true"]) == 0
    assert read_events(tmp_path / "r" / "events.jsonl")[-1]["event"] == "done"


@pytest.mark.parametrize("fails", [1, 2])
def test_a_preview_set_that_runs_out_of_memory_renders_again_lean_or_is_skipped_and_training_goes_on(
        tiny_dir, tmp_path, monkeypatch, capsys, fails):
    # The step-0 set's allocation fails as a GPU's allocator does: once, and the set renders again without
    # copies, one image a call; twice, and the set is skipped. Either way the run trains on and finishes.
    import torch

    from sdxl_lora.core.runs import read_events
    from sdxl_lora.sdxl import preview

    real, batches = preview.render, []

    def render(pipe, prompts, **kw):
        batches.append(kw["batch"])
        if len(batches) <= fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return real(pipe, prompts, **kw)

    monkeypatch.setattr(preview, "render", render)
    assert main(["train", "--model", str(tiny_dir), "--data", "sample_data/images", "--steps", "2", "--out",
                 str(tmp_path), "--name", "r", "--set", "train.save_every=0"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    events = read_events(tmp_path / "r" / "events.jsonl")
    told = [(e["step"], e["then"]) for e in events if e["event"] == "previews_out_of_memory"]
    assert told == [(0, "rendering again without copies, one image at a time"), (0, "skipped")][:fails]
    assert batches[1] == 1  # the set again: one prompt a call
    step0 = sorted(p.name for p in (tmp_path / "r" / "samples").glob("step-000000-*.png"))
    assert bool(step0) == (fails == 1)
    assert (tmp_path / "r" / "samples" / "step-000002-grid.png").is_file()  # the final set as usual
    assert events[-1]["event"] == "done" and (tmp_path / "r" / "r.safetensors").is_file()


def test_the_forms_summary_line_names_the_card_and_what_the_run_will_do_on_it(monkeypatch):
    from sdxl_lora.ui import summary

    monkeypatch.setattr(summary, "_card", lambda: pretend_card(12))
    line = summary.run_summary(sdxl(**{"train.batch_size": 2}))
    assert "this 12 GB card: chose" in line and "recomputing (partial)" in line and "x the time per image" in line
    monkeypatch.setattr(summary, "_card", lambda: pretend_card(48))
    assert "fits this 48 GB card as set" in summary.run_summary(sdxl(**{"train.batch_size": 2}))


def test_plan_and_the_forms_summary_say_the_same_for_the_same_config_and_card(monkeypatch, capsys):
    # One plan entry (sdxl/plan.py: plan_run) behind both: the same card gives the same peak and the same levers.
    from sdxl_lora.ui import summary

    monkeypatch.setattr(summary, "_card", lambda: pretend_card(12))
    line = summary.run_summary(sdxl(**{"train.batch_size": 2}))
    assert main(["plan", "--model", "arch:sdxl", "--batch-size", "2", "--card", "12", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert f"~{shown['run_memory']['peak_gib']:.1f} GiB" in line
    assert shown["budget_choices"] and "this 12 GB card: chose" in line
    assert f"~{shown['slowdown']:.2f}x the time per image" in line
