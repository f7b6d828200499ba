"""The record of a step's convolutions and attention (core/conv_search.py) replays the very calls the step made, so
a later run's first step finds cuDNN's choices made; a record that does not apply is left unused, with a reason,
and never stops a run. cuDNN's search itself needs a GPU: benchmarks/RESULTS.md#launch-to-first-step measures the
first step."""
import json
import logging
import threading

import pytest
import torch

from sdxl_lora.core import conv_search, speed
from sdxl_lora.core.config import load_config
from test_speed import batch_for, loss_and_grads, tiny_unet_with_lora

CPU = torch.device("cpu")


def _keys(recorder):
    return sorted(k for k in recorder.calls)


def _conv(**v):
    return {k: {"tensor": v[k], "stride": list(torch.empty(v[k]).stride()), "dtype": "float32", "device": "cpu"}
            for k in ("dy", "x", "w")}


def test_a_replayed_record_makes_the_calls_the_step_made(tiny_dir, tmp_path, caplog):
    unet = tiny_unet_with_lora(tiny_dir, preset="locon")  # the ResNets' LoRA convolutions train their weights
    speed.to_channels_last(unet)
    step = conv_search.Recorder()
    with step:
        loss_and_grads(unet, batch_for(unet))
    ops = {c["op"] for c in step.calls.values()}
    assert {"convolution.default", "convolution_backward.default"} <= ops  # the forward's and the backward's
    masks = {tuple(c["args"][-1]) for c in step.calls.values() if c["op"] == "convolution_backward.default"}
    assert (True, False, False) in masks  # a frozen convolution: its input's gradient only
    assert any(m[1] for m in masks)  # a LoRA convolution: its weight's gradient too
    x = next(c["args"][0] for c in step.calls.values() if c["op"] == "convolution.default"
             and c["args"][0]["tensor"][1] > 4)
    assert x["stride"][1] == 1  # channels_last, as the step ran it
    path = tmp_path / "record.json"
    conv_search.note_flops(123.0)
    step.save(path, CPU)

    calls = json.loads(path.read_text())["calls"]
    again = conv_search.Recorder()
    with again:
        assert len(list(conv_search.replay_calls(calls, CPU))) == len(calls) == len(step.calls)
    assert _keys(again) == _keys(step)

    # On its thread, as a run starts it: every call made, and said so once the main thread waits for it; the run's
    # FLOP count comes back; later work (the step's captures) runs on that same thread.
    caplog.set_level(logging.INFO, logger="sdxl_lora.core.conv_search")
    replay = conv_search.Replay(path, CPU)
    try:
        replay.wait()
        assert replay.calls == len(calls) and replay.error is None and replay.skipped is None
        assert replay.flops_per_image == 123.0
        assert f"attention graphs for {len(calls)} recorded calls chosen" in caplog.text
        first, again_ = replay.call(threading.get_ident), replay.call(threading.get_ident)
        assert first == again_ != threading.get_ident()
        with pytest.raises(ZeroDivisionError):  # its exception is the caller's
            replay.call(lambda: 1 / 0)
    finally:
        replay.close()
        conv_search.reset()


def test_a_record_that_does_not_apply_is_not_used_and_says_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="sdxl_lora.core.conv_search")
    call = {"op": "convolution_backward.default",
            "args": [*_conv(dy=[1, 4, 8, 8], x=[1, 4, 8, 8], w=[4, 4, 3, 3]).values(), None, [1, 1], [1, 1], [1, 1],
                     False, [0, 0], 1, [True, False, False]],
            "kwargs": {}, "backward": True, "allocated": 0}
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"version": conv_search.RECORD_VERSION, "gpu": "another GPU",
                                   "cudnn": torch.backends.cudnn.version(), "calls": [call]}))
    damaged = tmp_path / "damaged.json"
    damaged.write_text('{"version": 2, "gpu": "cpu", "calls": [')
    old = tmp_path / "old.json"  # an earlier version's record
    old.write_text(json.dumps({"version": 1, "gpu": "cpu", "cudnn": torch.backends.cudnn.version(), "calls": []}))
    for path, why in ((foreign, "another GPU"), (damaged, "unreadable record"), (old, "record version")):
        replay = conv_search.Replay(path, CPU)
        replay.wait()
        replay.close()
        assert replay.calls == 0 and why in replay.skipped
        assert f"the record {path} was not used: " in caplog.text
    wrong = tmp_path / "wrong.json"  # shapes no convolution has: the device refuses it, a warning, no exception
    bad = {**call, "args": [*_conv(dy=[1, 4, 8, 8], x=[1, 4, 8, 8], w=[4, 5, 3, 3]).values(), *call["args"][3:]]}
    wrong.write_text(json.dumps({"version": conv_search.RECORD_VERSION, "gpu": "cpu",
                                 "cudnn": torch.backends.cudnn.version(), "calls": [bad]}))
    replay = conv_search.Replay(wrong, CPU)
    replay.wait()
    replay.close()
    assert replay.error is not None
    assert "replaying the recorded calls stopped after 0 of them" in caplog.text


def test_the_record_is_named_by_what_the_convolutions_depend_on(tmp_path):
    def path(**extra):
        return conv_search.record_path(load_config(extra={"data.cache_dir": str(tmp_path), **extra}))

    base = path()
    assert base.parent == tmp_path / "conv-search"
    # What does not change a convolution's shape keeps the record: the length, the learning rate, the seed.
    assert path(**{"train.steps": 7, "train.lr": 3e-4, "train.seed": 9}) == base
    # What does, names another one.
    assert path(**{"train.batch_size": 3}) != base
    assert path(**{"data.resolution": 256}) != base
    assert path(**{"adapter.preset": "locon"}) != base
    # No record where it is off, or where set-up measures on the GPU beside it (a memory budget).
    assert path(**{"train.reuse_conv_search": False}) is None
    assert path(**{"train.vram_gb": 12}) is None


def test_a_replay_that_fails_unexpectedly_is_reported_and_its_thread_still_serves(tmp_path, monkeypatch, caplog):
    # The run's CUDA-graph captures are handed to the replay's thread (on_search_thread): whatever the replay met,
    # that thread must still run them, or the first step would wait forever.
    def fails(calls, device):
        raise ZeroDivisionError("nothing expected this")
        yield

    monkeypatch.setattr(conv_search, "replay_calls", fails)
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"version": conv_search.RECORD_VERSION, "gpu": "cpu",
                                "cudnn": torch.backends.cudnn.version(),
                                "calls": [{"op": "convolution.default", "args": [], "kwargs": {}, "backward": False,
                                           "allocated": 0}]}))
    caplog.set_level(logging.INFO, logger="sdxl_lora.core.conv_search")
    replay = conv_search.Replay(path, CPU)
    try:
        replay.wait()
        assert isinstance(replay.error, ZeroDivisionError)
        assert "replaying the recorded calls stopped after 0 of them (ZeroDivisionError" in caplog.text
        assert replay.call(lambda: "captured") == "captured"
    finally:
        replay.close()
