"""What a run says while it does something other than a training step, without a browser: it records each phase
(previews, evaluation) as it starts and how far a preview set is; the run view shows "rendering previews 2 of 8"
and an ETA that counts the preview sets and the evaluation still due; the CLI prints the plan's summary, the layer
table going to the run's log (and to the terminal with -v)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from sdxl_lora.core.runs import Run
from sdxl_lora.ui.jobs import eta_with_phases, run_status

REPO = Path(__file__).resolve().parents[2]


def _events(times: list[tuple[float, str, dict]]) -> list[dict]:
    return [{"event": kind, "time": t, **fields} for t, kind, fields in times]


def test_the_eta_counts_the_preview_sets_and_the_evaluation_still_due():
    # Step-0 previews (4 s) and evaluation (2 s) before the start; one step a second; a preview set at step 5 (3 s).
    events = _events([(90, "phase", {"phase": "rendering previews", "step": 0, "of": 8}),
                      (94, "samples", {"step": 0}), (95, "phase", {"phase": "evaluating", "step": 0}),
                      (97, "eval", {"step": 0}), (100, "start", {"step": 0, "total_steps": 20}),
                      (105, "step", {"step": 5}), (105, "phase", {"phase": "rendering previews", "step": 5, "of": 8}),
                      (108, "samples", {"step": 5}), (113, "step", {"step": 10})])
    # 10 steps at 1 s, the set at step 15 (3 s), the final evaluation (2 s) and previews (3 s); the step pace with
    # the set's time spread over it would say 13 s.
    assert eta_with_phases(events, 10, 20, 113, 113.5, (5, True), {}) == 18
    assert eta_with_phases(events, 10, 20, 113, 113.5, (0, False), {}) == 10 + 2
    # During the set at step 15, 2 of 8 images done in 1 s: 3 s of it left, then 5 steps and the end's 5 s.
    during = events + _events([(118, "step", {"step": 15}),
                               (118, "phase", {"phase": "rendering previews", "step": 15, "of": 8})])
    now = {"phase": "rendering previews", "step": 15, "done": 2, "of": 8}
    assert eta_with_phases(during, 15, 20, 118, 119, (5, True), now) == 3 + 5 + 2 + 3
    # Before the session's first step there is no pace: the caller keeps the trainer's own figure.
    assert eta_with_phases(events[:5], 0, 20, 0, 101, (5, True), {}) is None


def test_the_run_view_shows_the_phase_between_steps_and_not_after_it(tmp_path):
    from sdxl_lora.ui.tab_train import _loss_cell, _progress_html

    run = Run(tmp_path / "r")
    run.dir.mkdir()
    (run.dir / "config.toml").write_text("[preview]\nevery = 5\nafter = true\n")
    (run.dir / "train.pid").write_text(f"{os.getpid()}\n")  # alive: this process
    run.event("start", step=0, total_steps=20)
    run.event("step", step=10, total_steps=20, loss=0.1, lr=1e-4, images_per_s=2.0, eta_s=10.0)
    run.phase("rendering previews", 10, 0, 8)
    run.phase("rendering previews", 10, 2, 8)
    st = run_status(run.dir)
    assert st.state == "training" and st.phase == "rendering previews 2 of 8 (step 10)"
    assert "rendering previews 2 of 8 (step 10)" in _progress_html(st)
    run.event("samples", step=10, paths=[])  # the set ended: the phase is no longer shown
    assert run_status(run.dir).phase == ""


def test_a_run_records_its_phases_and_the_cli_prints_the_plans_summary(tmp_path, cli):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --d 1\na green star --d 2\n", encoding="utf-8")
    r = cli("train", "--out", str(tmp_path / "runs"), "--name", "p", "--steps", "4", "--batch-size", "1",
            "--set", "train.device='cpu'", "--set", "data.resolution=64", "--set", f"preview.prompts='{prompts}'",
            "--set", "preview.steps=2", "--set", "preview.every=2", "--set", f"data.cache_dir='{tmp_path / 'cache'}'")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "runs" / "p"
    phases = [(e["phase"], e["step"], e.get("of")) for e in map(json.loads, (run / "events.jsonl").read_text()
              .splitlines()) if e["event"] == "phase"]
    assert phases == [("rendering previews", 0, 2), ("evaluating", 0, None), ("rendering previews", 2, 2),
                      ("evaluating", 4, None), ("rendering previews", 4, 2)]
    last = json.loads((run / "phase.json").read_text())
    assert last["phase"] == "rendering previews" and last["done"] == last["of"] == 2
    # The plan in one line in the terminal; its layer table in the run's log.
    assert "adapter plan: " in r.stderr and "trainable parameters" in r.stderr
    assert "adapter plan, by layer group" not in r.stderr
    assert "adapter plan, by layer group" in (run / "train.log").read_text()


def test_sample_now_and_save_now_act_at_the_step_the_run_is_at(tmp_path):
    import subprocess
    import sys
    import time

    import pytest

    from sdxl_lora.core.runs import read_events
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs

    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --d 1\n", encoding="utf-8")
    # A run started in a terminal, far longer than it is watched; no previews of its own before the end.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdxl_lora.cli", "train", "--out", str(f.runs), "--name", "r", "--steps", "5000",
         "--batch-size", "1", "--set", "train.device='cpu'", "--set", "data.resolution=64", "--set",
         f"preview.prompts='{prompts}'", "--set", "preview.steps=2", "--set", "preview.before=false",
         "--set", "train.log_every=10000", "--set", f"data.cache_dir='{tmp_path / 'cache'}'"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    jobs = Jobs(f)
    run = f.runs / "r"

    def wait(cond, what):
        deadline = time.monotonic() + 150
        while not cond():
            assert proc.poll() is None, f"{what}: the run ended:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    try:
        wait(lambda: (run / "config.toml").is_file() and run_status(run).state == "training"
             and run_status(run).step >= 2, "training")
        assert "asked for previews" in jobs.ask("r", "sample")
        assert "asked for its training state saved" in jobs.ask("r", "save")
        events = lambda: read_events(run / "events.jsonl")  # noqa: E731
        wait(lambda: any(e["event"] == "checkpoint" for e in events()), "the state saved")
        wait(lambda: any(e["event"] == "samples" for e in events()), "the previews")
        shot = next(e for e in events() if e["event"] == "samples")
        saved = next(e for e in events() if e["event"] == "checkpoint")
        assert shot["step"] >= 3 and all(Path(p).is_file() and f"step-{shot['step']:06d}" in p for p in shot["paths"])
        assert saved["step"] >= 3 and Path(saved["path"]).is_dir()
        assert not (run / "sample-now").exists() and not (run / "save-now").exists()  # each taken once
        jobs.stop("r")
        assert proc.wait(150) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(ValueError, match="Sample now: run 'r' is stopped; it works on a run that is training"):
        jobs.ask("r", "sample")


def test_the_progress_line_says_which_step_its_loss_and_speed_are_from(tmp_path):
    # The run writes its loss and images/s at its log points only ("Log every N steps"), its step each step: between
    # log points the line shows the step it is at and the figures with the step they are from; at a log point (every
    # step with "Log every" 1) the figures are that step's own.
    import time

    from sdxl_lora.ui.tab_train import _loss_cell, _progress_html

    run = Run(tmp_path / "r")
    run.dir.mkdir()
    (run.dir / "config.toml").write_text("[preview]\nevery = 0\n")
    (run.dir / "train.pid").write_text(f"{os.getpid()}\n")
    run.event("start", step=0, total_steps=20)
    run.event("step", step=10, total_steps=20, loss=0.1, lr=1e-4, images_per_s=2.0, eta_s=10.0)
    time.sleep(0.01)  # a later record than the event's (their times are in milliseconds)
    run.progress(14, 20, 6.0)
    text = _progress_html(run_status(run.dir))
    assert "step 14/20" in text and "loss 0.1000 · 2.00 img/s (at step 10)" in text
    assert _loss_cell(run_status(run.dir)) == "0.1000 (at step 10)"  # the Runs table's column
    run.event("step", step=15, total_steps=20, loss=0.2, lr=1e-4, images_per_s=3.0, eta_s=5.0)
    text = _progress_html(run_status(run.dir))
    assert "step 15/20" in text and "loss 0.2000 · 3.00 img/s" in text and "(at step" not in text
    assert _loss_cell(run_status(run.dir)) == "0.2000"
    # Between log points the run writes a recent step's loss and the pace so far (one step late on a GPU, where it
    # is read without waiting): shown as the step's own.
    time.sleep(0.01)
    run.progress(17, 20, 3.0, loss=0.3, loss_step=16, images_per_s=4.0)
    text = _progress_html(run_status(run.dir))
    assert "step 17/20" in text and "loss 0.3000 · 4.00 img/s" in text and "(at step" not in text
