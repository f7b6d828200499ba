"""Many processes through `accelerate launch` (docs/multigpu.md), proven with two CPU processes over gloo:
the same launcher, config file and code path as N GPUs over NCCL.

- Two processes with batch b train the adapter (DoRA + LoCon) one process trains with batch 2b and the same seed: the
  global batch holds the same images at every step, and each sample's noise and timestep are keyed by
  (seed, epoch, sample), not drawn from a per-process RNG stream.
- The two processes build the latent cache together (half each) and the main process alone writes
  the events and the adapter.
- The same with the loop's own flat all-reduce instead of DDP (train.gradient_sync="allreduce").
- A two-process run killed mid-step resumes on one process and ends with that same adapter.
- NaNs in one process's loss stop both processes at the same step (the NaN guard's deferred verdict is
  read where the processes agree), with a state one process resumes from.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdxl_lora.core import checkpoint
from sdxl_lora.core.runs import read_events

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
# The 64 sample images (16 stars, 48 prior shapes) are square: at resolution 64 they share one bucket, so
# every global batch of 4 is full and one process with batch 4 and two with batch 2 see the same batches.
# The adapter: DoRA with LoCon's convolutions (magnitudes, convolution adapters and the fused projections
# besides plain LoRA's factors), so every kind of trainable tensor goes through DDP and the flat all-reduce.
COMMON = ["--steps", str(STEPS), "--seed", "7", "--set", "data.resolution=64", "--set", "data.bucket_step=16",
          "--set", "preview.prompts=''", "--set", "train.log_every=1", "--set", "train.save_every=2",
          "--set", "train.save_every_minutes=0", "--kind", "dora", "--set", "adapter.preset='locon'"]
# One thread per process: two processes on two cores, and the same thread count in every run.
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ENV.pop("SDXL_LORA_TEST_KILL", None)
ENV.pop("SDXL_LORA_TEST_NAN", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out: Path, *args: str, processes: int = 1, kill: str | None = None, check: bool = True,
          nan: str | None = None, timeout: int = 600):
    """`pipelines/train.py` as a user launches it: plain python for one process, `accelerate launch`
    with the N-GPU config file for several (on this GPU-less machine: CPU processes over gloo)."""
    env = dict(ENV, **({"SDXL_LORA_TEST_KILL": kill} if kill else {}), **({"SDXL_LORA_TEST_NAN": nan} if nan else {}))
    launcher = [sys.executable]
    if processes > 1:
        launcher = [sys.executable, "-m", "accelerate.commands.launch",
                    "--config_file", str(REPO / "pipelines/accelerate/multi-gpu.yaml"),
                    "--num_processes", str(processes), "--main_process_port", str(free_port())]
    proc = subprocess.run([*launcher, str(REPO / "pipelines/train.py"), "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"{run_dir.name}.safetensors")


def assert_same_training(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The tolerance: DDP averages two half-batch gradients where one process averages the whole batch,
    and the UNet runs batches of 2 instead of 4, so sums are taken in another order (~1e-7 relative).
    Adam divides each update by its gradient's running RMS, which magnifies that for entries whose
    gradient is near zero, so a single entry may move by ~1e-4 of the weights' scale; each tensor as a
    whole agrees to better than 1e-2 relative (measured ~1e-3 at worst), all of them to better than 1e-3.
    Training with another seed or batch changes them by ~100%."""
    assert a.keys() == b.keys()
    for k in a:
        rel = ((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item()
        assert rel < 1e-2, (k, rel)
    up = [k for k in a if "lora_up" in k]
    da, db = torch.cat([a[k].flatten() for k in up]), torch.cat([b[k].flatten() for k in up])
    assert da.norm() > 0  # the up weights start at zero: all of their value is training
    assert ((da - db).norm() / da.norm()).item() < 1e-3


def train_here(as_process, out: Path, *args: str) -> None:
    """One process's run, in this one (conftest.py: as_process): the same code path as pipelines/train.py
    without a process's seconds of imports."""
    from sdxl_lora.cli import main

    with as_process():
        assert main(["train", "--out", str(out), *args]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, as_process):
    """Two processes with batch 2 (building the cache), then one process with batch 4 (reusing it)."""
    out = tmp_path_factory.mktemp("mp")
    cache = ["--set", f"data.cache_dir='{out / 'cache'}'"]
    train(out, "--name", "two", "--batch-size", "2", *COMMON, *cache, processes=2)
    train_here(as_process, out, "--name", "one", "--batch-size", "4", *COMMON, *cache)
    return out, cache


def test_two_processes_with_batch_b_train_what_one_process_trains_with_batch_2b(runs):
    out, _ = runs
    two, one = read_events(out / "two" / "events.jsonl"), read_events(out / "one" / "events.jsonl")
    # The cache was built half by each process, and the one-process run found it complete and valid.
    cache_two = next(e for e in two if e["event"] == "cache")
    assert cache_two["latents_by_process"] == [32, 32] and cache_two["latents_total"] == 64
    assert next(e for e in one if e["event"] == "cache")["latents_computed"] == 0
    # The main process alone writes events: each happens once, each step once.
    kinds = [e["event"] for e in two]
    for kind in ("dataset", "cache", "plan", "start", "adapter", "done"):
        assert kinds.count(kind) == 1, kind
    loss_two = {e["step"]: e["loss"] for e in two if e["event"] == "step"}
    loss_one = {e["step"]: e["loss"] for e in one if e["event"] == "step"}
    assert list(loss_two) == list(range(1, STEPS + 1))
    for step in loss_one:  # the same images and draws at every step: the same loss
        assert loss_two[step] == pytest.approx(loss_one[step], rel=1e-5)
    assert_same_training(adapter(out / "two"), adapter(out / "one"))
    assert any(k.endswith(".dora_scale") for k in adapter(out / "two"))
    # The run's adapter and its diffusers twin, written once, by the main process.
    assert sorted(p.name for p in (out / "two").glob("*.safetensors")) == ["two.diffusers.safetensors",
                                                                            "two.safetensors"]


def test_the_loops_flat_all_reduce_trains_what_ddp_trains(runs, tmp_path):
    # train.gradient_sync="allreduce" (what CUDA graphs use on several GPUs): no DDP wrapper; the loop
    # averages every adapter gradient in one flat all-reduce after the backward.
    out, cache = runs
    train(tmp_path, "--name", "flat", "--batch-size", "2", *COMMON, *cache, "--set", "train.gradient_sync='allreduce'",
          processes=2)
    flat, one = read_events(tmp_path / "flat" / "events.jsonl"), read_events(out / "one" / "events.jsonl")
    start = next(e for e in flat if e["event"] == "start")
    assert start["processes"] == 2 and start["gradient_sync"] == "allreduce"
    assert next(e for e in read_events(out / "two" / "events.jsonl") if e["event"] == "start")["gradient_sync"] == "ddp"
    loss_flat = {e["step"]: e["loss"] for e in flat if e["event"] == "step"}
    for step, loss in ((e["step"], e["loss"]) for e in one if e["event"] == "step"):
        assert loss_flat[step] == pytest.approx(loss, rel=1e-5)
    assert_same_training(adapter(tmp_path / "flat"), adapter(out / "one"))


def test_a_two_process_run_killed_mid_step_resumes_on_one_process(runs, tmp_path, as_process):
    out, cache = runs
    run = tmp_path / "k"
    # SIGKILL in the middle of step 3 (after the backward, before the optimizer step), in both processes.
    p = train(tmp_path, "--name", "k", "--batch-size", "2", *COMMON, *cache, processes=2, kill="step:3",
              check=False)
    assert p.returncode != 0
    assert checkpoint.newest_valid(run / "checkpoints").name == "step-00000002"
    assert not (run / "k.safetensors").exists()
    # One process takes the same global batch (4 = 2 processes x 2) and continues exactly.
    train_here(as_process, tmp_path, "--resume", str(run), "--set", "train.batch_size=4")
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [2]
    assert events[-1]["event"] == "done" and events[-1]["step"] == STEPS
    assert_same_training(adapter(run), adapter(out / "one"))


def test_nans_in_one_process_stop_both_at_the_same_step_with_a_state_to_resume(runs, tmp_path, as_process):
    out, cache = runs
    run = tmp_path / "nan"
    # From step 3 on process 1's loss is NaN; the all-reduced gradients make every process's step bad.
    # A process that stopped alone would leave the other waiting in a collective until the timeout.
    p = train(tmp_path, "--name", "nan", "--batch-size", "2", *COMMON, *cache, "--steps", "6",
              "--set", "train.max_nan_steps=2", "--set", "train.log_every=3", processes=2, nan="1:3", check=False,
              timeout=300)
    assert p.returncode != 0, p.stderr[-3000:]
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "nonfinite"] == [3, 4]
    stop = events[-1]
    assert stop["event"] == "interrupted" and stop["signal"] == "nan_guard" and stop["step"] == 4, stop
    assert not (run / "nan.safetensors").exists()
    # The state at the stop holds step 2's weights; one process (the cause gone) resumes and finishes.
    state = checkpoint.newest_valid(run / "checkpoints")
    assert state.name == "step-00000004"
    s2, s4 = (load_file(run / "checkpoints" / f"step-0000000{k}" / "adapter.safetensors") for k in (2, 4))
    assert s2.keys() == s4.keys() and all(torch.equal(s2[k], s4[k]) for k in s2)
    train_here(as_process, tmp_path, "--resume", str(run), "--set", "train.batch_size=4")
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]
    assert events[-1]["event"] == "done" and events[-1]["step"] == 6
