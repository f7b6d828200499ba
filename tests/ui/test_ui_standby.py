"""The UI's queue keeps a run process ready (ui/jobs.py: Jobs(standby=True), ui/worker.py: standby): a queued run
is handed to it and trains there, its output in the run's log as from a worker started for it; the next one is
made ready once no run is running; a worker that died is replaced by a fresh process for the run; the UI's end
ends the idle one."""
import os
import shutil
import signal
import time
from pathlib import Path

from sdxl_lora.core.config import ModelConfig, load_config
from sdxl_lora.core.runs import read_events
from sdxl_lora.ui.folders import Folders
from sdxl_lora.ui.jobs import Jobs, run_status

REPO = Path(__file__).resolve().parents[2]
WAIT = 240  # seconds a tiny run may take on a busy 2-core machine


def _config(f: Folders, name: str):
    data = f.datasets / "two"
    if not data.is_dir():
        data.mkdir(parents=True)
        for img in sorted((REPO / "sample_data" / "images").glob("*.png"))[:2]:
            shutil.copy(img, data / img.name)
            shutil.copy(img.with_suffix(".txt"), data / img.with_suffix(".txt").name)
    return load_config(extra={"model.path": "tiny-sdxl", "model.cache_dir": ModelConfig().cache_dir,
                              "data.dirs": [str(data)], "train.steps": 2,
                              "train.batch_size": 1, "train.device": "cpu", "preview.prompts": "",
                              "output.runs_dir": str(f.runs), "output.name": name})


def _finish(jobs: Jobs, name: str) -> None:
    deadline = time.monotonic() + WAIT
    while run_status(jobs.run_dir(name)).state != "finished":
        assert run_status(jobs.run_dir(name)).state not in ("failed", "stopped"), jobs.log_tail(name)
        assert time.monotonic() < deadline, jobs.log_tail(name)
        time.sleep(0.5)
    jobs._children[name].wait(WAIT)  # its process ends just after it writes its end


def test_a_queued_run_trains_in_the_worker_kept_ready_and_another_is_made_ready(tmp_path):
    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", ModelConfig().cache_dir, tmp_path / "runs")
    jobs = Jobs(f, standby=True)
    jobs._ready_spare()  # as start_background does, without its ticking thread: the test ticks
    spare = jobs._spare
    try:
        jobs.enqueue_train(_config(f, "first"))
        assert jobs.tick() == "first"
        assert jobs._launched()["first"] == spare.pid  # the ready worker took the run
        assert jobs.tick() is None and jobs._spare is None  # none is made ready beside a run setting up
        _finish(jobs, "first")
        run = jobs.run_dir("first")
        assert any(e["event"] == "step" for e in read_events(run / "events.jsonl"))
        assert (run / "train.exit").read_text().strip() == "0"
        log = (f.ui / "logs" / "first.log").read_text()
        assert "run folder" in log and "adapter" in log  # what it printed reached the run's log
        # Once no run is running, the next run's worker is made ready.
        assert jobs.tick() is None
        assert jobs._spare is not None and jobs._spare.pid != spare.pid and jobs._spare.poll() is None
        # One that died meanwhile: the run starts in a fresh process instead (here a run refused for its
        # empty data folder, which ends as soon as it has read its config).
        os.kill(jobs._spare.pid, signal.SIGKILL)
        jobs._spare.wait()
        dead = jobs._spare
        (tmp_path / "empty").mkdir()
        cfg = _config(f, "second").model_copy(deep=True)
        cfg.data.dirs = [str(tmp_path / "empty")]
        jobs.enqueue_train(cfg)
        assert jobs.tick() == "second"
        fresh = jobs._launched()["second"]
        assert fresh != dead.pid
        jobs._children["second"].wait(WAIT)
        assert "no images" in jobs.log_tail("second"), jobs.log_tail("second")
        assert jobs.tick() is None and jobs._spare.poll() is None  # ready again for the next run
    finally:
        idle = jobs._spare
        jobs.shutdown()
    # The UI's end: the idle worker ends with it.
    assert idle is not None and idle.poll() is not None
    assert sorted(p.name for p in f.runs.iterdir() if not p.name.startswith(".")) == ["first", "second"]


def test_a_worker_kept_ready_that_fails_on_its_own_is_not_started_again(tmp_path, caplog):
    # An environment whose imports fail would fail each time: the queue says so once and starts runs as before.
    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named torch' >&2\nexit 1\n")
    fake.chmod(0o755)
    jobs = Jobs(f, python=str(fake), standby=True)
    jobs._ready_spare()
    failed = jobs._spare
    failed.wait(WAIT)
    assert jobs.tick() is None
    assert jobs._spare is None and not jobs.standby
    assert "exited with code 1" in caplog.text and "standby.log" in caplog.text
    assert "no module named torch" in (f.ui / "logs" / "standby.log").read_text()
    assert jobs.tick() is None and jobs._spare is None  # not started again
