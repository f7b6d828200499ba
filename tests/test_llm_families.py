"""The LLM path beyond the tiny Llama: throughput in the LLM's own units (tokens/s, examples/s), the
decoder families people fine-tune (each a tiny random config built in-process), peft's adapter
initialisations, and `llm plan`'s activation estimate."""

import torch

from sdxl_lora.core.config import load_config
from sdxl_lora.core.loop import Trainer, throughput_postfix
from sdxl_lora.core.runs import create_run, read_events
from sdxl_lora.llm.task import LLMTask

torch.set_num_threads(1)


def test_llm_run_reports_tokens_and_examples_per_second(tmp_path, capsys):
    cfg = load_config(extra={"task": "llm", "output.runs_dir": str(tmp_path), "output.name": "tps",
                             "train.steps": 2, "train.log_every": 1, "llm.max_length": 64,
                             "llm.preview_prompts": [], "train.batch_size": 2})
    run = create_run(cfg)
    trainer = Trainer(cfg, LLMTask(cfg), run)
    trainer.setup()
    trainer.fit()
    steps = [e for e in read_events(run.dir / "events.jsonl") if e["event"] == "step"]
    assert steps and all("images_per_s" not in e for e in steps)
    for e in steps:
        # Packed rows of up to 64 tokens, 2 a batch: more tokens than examples, and more examples than rows.
        assert e["tokens_per_s"] > e["examples_per_s"] > 0
    bar = capsys.readouterr().err
    assert "tok_s=" in bar and "ex_s=" in bar and "img_s" not in bar


def test_sdxl_progress_bar_still_counts_images():
    from sdxl_lora.sdxl.task import SDXLTask

    task = SDXLTask(load_config())
    units = task.units({"latent_mean": torch.zeros(3, 4, 8, 8)})
    assert units == {"images": 3}
    assert throughput_postfix({"images": 12.34}, task.unit_labels) == {"img_s": "12.3"}
