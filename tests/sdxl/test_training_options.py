"""Training options a kohya/OneTrainer user expects: each loss option changes the loss exactly as its
definition says (computed here independently, in float64), the schedules give the learning rates their
formulas give, every optimizer takes a step on CPU, and the NaN guard skips bad steps and stops a run
that only produces them, with a state it can resume from."""
import math
from types import SimpleNamespace

import pytest
import torch

from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.sdxl.task import SDXLTask

# ---------------------------------------------------------------- loss options

SCALE = 0.13025
BETA_START, BETA_END, N_T = 0.00085, 0.012, 1000


class StubUNet(torch.nn.Module):
    """A fixed, deterministic 'model': the prediction depends on the noisy latents and the timestep."""

    def forward(self, noisy, t, encoder_hidden_states=None, added_cond_kwargs=None):
        return SimpleNamespace(sample=0.7 * noisy + 0.3 * torch.sin(noisy) + (t.float() / N_T).view(-1, 1, 1, 1))


def make_task(**train):
    from diffusers import DDPMScheduler

    model = train.pop("prediction_type", "auto")
    extra = {f"train.{k}": v for k, v in train.items()}
    extra["model.prediction_type"] = model
    # The embedded random base: it recommends no training settings (the demo base's narrow the timesteps).
    extra["model.path"] = "tiny-sdxl"
    task = SDXLTask(load_config(extra=extra))
    base = DDPMScheduler(num_train_timesteps=N_T, beta_start=BETA_START, beta_end=BETA_END,
                         beta_schedule="scaled_linear", prediction_type="epsilon")
    task.pipe = SimpleNamespace(vae=SimpleNamespace(config=SimpleNamespace(scaling_factor=SCALE)), scheduler=base)
    task.noise_scheduler = task._noise_scheduler()
    return task


def fixed_batch():
    g = torch.Generator().manual_seed(3)
    return {"latent_mean": torch.randn(4, 4, 8, 8, generator=g), "latent_std": 0.1 * torch.rand(4, 4, 8, 8, generator=g),
            "prompt_embeds": torch.zeros(4, 7, 16), "pooled": torch.zeros(4, 16), "time_ids": torch.zeros(4, 6)}


def alphas_cumprod(zero_terminal_snr=False):
    betas = torch.linspace(BETA_START ** 0.5, BETA_END ** 0.5, N_T, dtype=torch.float64) ** 2
    ac = torch.cumprod(1 - betas, 0)
    if zero_terminal_snr:  # Lin et al. 2023, Algorithm 1: shift and scale sqrt(alpha_bar) so its last value is 0
        s = ac.sqrt()
        s = (s - s[-1]) * s[0] / (s[0] - s[-1])
        ac = s ** 2
    return ac


def pyramid(noise, iterations, discount):
    """Multi-resolution noise from its definition, in float64: level i is N(0, 1) at 1/r^i of the image's size
    (r uniform in [2, 4), drawn per level before the levels), upsampled bilinearly, weighted discount^i, until a
    side is 1; the sum rescaled to unit standard deviation. One image at a time, in the batch's order."""
    out = []
    for n in noise:
        c, h, w = n.shape
        total = n.double()
        for i, r in enumerate((2 + 2 * torch.rand(iterations)).tolist(), start=1):
            lh, lw = max(1, int(h / r ** i)), max(1, int(w / r ** i))
            level = torch.randn(c, lh, lw).double()
            total = total + torch.nn.functional.interpolate(level[None], size=(h, w), mode="bilinear")[0] * discount ** i
            if lh == 1 or lw == 1:
                break
        out.append(total / total.std())
    return torch.stack(out)


def expected_loss(batch, *, seed, noise_offset=0.0, t_range=(0, N_T - 1), prediction="epsilon", loss="l2",
                  huber_delta=1.0, gamma=0.0, zero_terminal_snr=False, multires=(0, 0.3), ip_gamma=0.0,
                  debiased=False):
    """The loss from its definition, drawing the same random numbers in the documented order."""
    torch.manual_seed(seed)
    mean, std = batch["latent_mean"], batch["latent_std"]
    x0 = (mean + std * torch.randn_like(mean)) * SCALE
    noise = torch.randn_like(x0)
    if noise_offset:
        noise = noise + noise_offset * torch.randn(x0.shape[0], x0.shape[1], 1, 1)
    if multires[0]:
        noise = pyramid(noise, *multires)
    t = torch.randint(t_range[0], t_range[1] + 1, (x0.shape[0],))
    perturb = torch.randn_like(x0).double() if ip_gamma else 0.0
    ac = alphas_cumprod(zero_terminal_snr)[t].view(-1, 1, 1, 1)
    x0, noise = x0.double(), noise.double()
    noisy = ac.sqrt() * x0 + (1 - ac).sqrt() * (noise + ip_gamma * perturb)
    target = noise if prediction == "epsilon" else ac.sqrt() * noise - (1 - ac).sqrt() * x0
    pred = StubUNet()(noisy, t).sample
    err = pred - target
    if loss == "l2":
        per = err ** 2
    else:
        per = torch.where(err.abs() <= huber_delta, 0.5 * err ** 2, huber_delta * (err.abs() - 0.5 * huber_delta))
    per_image = per.mean(dim=(1, 2, 3))
    if gamma:
        snr = (ac / (1 - ac)).view(-1)
        clipped = torch.minimum(snr, torch.full_like(snr, gamma))
        if prediction == "epsilon":  # min(snr, gamma) / snr, which tends to 1 as snr -> 0
            w = torch.where(snr > 0, clipped / snr, torch.ones_like(snr))
        else:
            w = clipped / (snr + 1)
        per_image = per_image * w
    if debiased:  # Yu et al. 2024 as kohya weights it: SNR capped at 1000 (and, for epsilon, at least 0.001)
        snr = (ac / (1 - ac)).view(-1).clamp(max=1000)
        per_image = per_image * (1 / snr.clamp(min=1e-3).sqrt() if prediction == "epsilon" else 1 / (snr + 1))
    return per_image.mean().item(), t


def task_loss(task, batch, seed):
    torch.manual_seed(seed)
    return task.loss(StubUNet(), batch).item()


OPTIONS = [
    ({}, {}),
    ({"noise_offset": 0.1}, {"noise_offset": 0.1}),
    ({"timestep_min": 200, "timestep_max": 300}, {"t_range": (200, 300)}),
    ({"loss": "huber", "huber_delta": 0.05}, {"loss": "huber", "huber_delta": 0.05}),
    ({"min_snr_gamma": 5.0}, {"gamma": 5.0}),
    ({"min_snr_gamma": 5.0, "prediction_type": "v_prediction"}, {"gamma": 5.0, "prediction": "v_prediction"}),
    ({"prediction_type": "v_prediction"}, {"prediction": "v_prediction"}),
    ({"zero_terminal_snr": True, "timestep_min": 990}, {"zero_terminal_snr": True, "t_range": (990, 999)}),
    ({"zero_terminal_snr": True, "timestep_min": 999, "min_snr_gamma": 5.0},
     {"zero_terminal_snr": True, "t_range": (999, 999), "gamma": 5.0}),
    ({"zero_terminal_snr": True, "timestep_min": 995, "min_snr_gamma": 5.0, "prediction_type": "v_prediction"},
     {"zero_terminal_snr": True, "t_range": (995, 999), "gamma": 5.0, "prediction": "v_prediction"}),
    ({"multires_noise_iterations": 6}, {"multires": (6, 0.3)}),
    ({"multires_noise_iterations": 2, "multires_noise_discount": 0.8, "noise_offset": 0.1},
     {"multires": (2, 0.8), "noise_offset": 0.1}),
    ({"ip_noise_gamma": 0.1}, {"ip_gamma": 0.1}),
    ({"ip_noise_gamma": 0.1, "prediction_type": "v_prediction"}, {"ip_gamma": 0.1, "prediction": "v_prediction"}),
    ({"debiased_estimation": True}, {"debiased": True}),
    ({"debiased_estimation": True, "min_snr_gamma": 5.0, "prediction_type": "v_prediction"},
     {"debiased": True, "gamma": 5.0, "prediction": "v_prediction"}),
    ({"debiased_estimation": True, "zero_terminal_snr": True, "timestep_min": 995},
     {"debiased": True, "zero_terminal_snr": True, "t_range": (995, 999)}),
]


@pytest.mark.parametrize("train, definition", OPTIONS, ids=[str(o[0]) or "default" for o in OPTIONS])
def test_each_loss_option_gives_the_loss_its_definition_gives(train, definition):
    batch = fixed_batch()
    got = task_loss(make_task(**train), batch, seed=11)
    want, t = expected_loss(batch, seed=11, **definition)
    assert math.isfinite(got)
    assert got == pytest.approx(want, rel=2e-5, abs=1e-7)
    lo, hi = definition.get("t_range", (0, N_T - 1))
    assert ((t >= lo) & (t <= hi)).all()
    if train:  # the option makes a difference on this batch, so the comparison above means something
        plain, _ = expected_loss(batch, seed=11)
        assert abs(got - plain) > 1e-4 * plain


def test_the_noise_options_draw_from_each_samples_key_whatever_its_batch():
    """In training every sample draws from its own key (so N processes draw what one does, and a resume what the
    run did): with the noise options on, a sample's loss alone is its share of the batch's, and again the same."""
    from sdxl_lora.sdxl.batches import sample_key

    opts = {"multires_noise_iterations": 4, "ip_noise_gamma": 0.1, "noise_offset": 0.05, "debiased_estimation": True}
    task, plain = make_task(**opts), make_task()
    batch = {**fixed_batch(), "sample_key": torch.tensor([sample_key(1, 0, i) for i in range(4)])}
    alone = [task.loss(StubUNet(), {k: v[i:i + 1] for k, v in batch.items()}).item() for i in range(4)]
    together = task.loss(StubUNet(), batch).item()
    assert together == pytest.approx(sum(alone) / 4, rel=1e-5)
    assert task.loss(StubUNet(), batch).item() == together
    assert abs(together - plain.loss(StubUNet(), batch).item()) > 1e-3 * together


def test_zero_terminal_snr_makes_the_last_timestep_pure_noise():
    sched = make_task(zero_terminal_snr=True).noise_scheduler
    assert sched.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-8)
    torch.testing.assert_close(sched.alphas_cumprod.double(), alphas_cumprod(True), rtol=1e-4, atol=1e-7)


def test_timestep_range_outside_the_schedule_is_refused():
    with pytest.raises(ConfigError, match="timestep_max=1000"):
        make_task(timestep_max=1000)
    with pytest.raises(ConfigError, match="timestep_max=10 is below timestep_min=20"):
        load_config(extra={"train.timestep_min": 20, "train.timestep_max": 10})


# ---------------------------------------------------------------- optimizers and schedules

from sdxl_lora.core.optim import build_optimizer, make_schedule  # noqa: E402

LR, STEPS, WARMUP = 0.01, 100, 10


def warm(step):
    return step / WARMUP


def lr_cosine(step):
    if step < WARMUP:
        return LR * warm(step)
    p = (step - WARMUP) / (STEPS - WARMUP)
    return LR * 0.5 * (1 + math.cos(math.pi * p))


def lr_restarts(step, cycles=3):
    if step < WARMUP:
        return LR * warm(step)
    p = (step - WARMUP) / (STEPS - WARMUP)
    return 0.0 if p >= 1 else LR * 0.5 * (1 + math.cos(math.pi * ((cycles * p) % 1.0)))


def lr_polynomial(step, power=2.0, lr_end=1e-7):
    if step < WARMUP:
        return LR * warm(step)
    remaining = 1 - (step - WARMUP) / (STEPS - WARMUP)
    return (LR - lr_end) * remaining ** power + lr_end


SCHEDULES = {
    "constant": ({}, lambda s: LR * min(1.0, warm(s))),
    "linear": ({}, lambda s: LR * (warm(s) if s < WARMUP else (STEPS - s) / (STEPS - WARMUP))),
    "cosine": ({}, lr_cosine),
    "cosine_with_restarts": ({"scheduler_cycles": 3}, lr_restarts),
    "polynomial": ({"scheduler_power": 2.0}, lr_polynomial),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_give_the_learning_rate_of_their_formula(name):
    extra, formula = SCHEDULES[name]
    cfg = load_config(extra={"train.scheduler": name, "train.lr": LR, "train.steps": STEPS,
                             "train.warmup_steps": WARMUP, **{f"train.{k}": v for k, v in extra.items()}})
    opt = build_optimizer(cfg, [{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    sched = make_schedule(cfg, opt)
    seen = {}
    for step in range(STEPS + 1):
        seen[step] = sched.get_last_lr()[0]
        opt.step()
        sched.step()
    for step in (0, 1, 5, 9, 10, 11, 25, 39, 40, 41, 50, 70, 99, 100):
        assert seen[step] == pytest.approx(formula(step), rel=1e-9, abs=1e-12), step


OPTIMIZERS = ["adamw", "adamw8bit", "adafactor", "lion", "adamw_schedulefree", "came"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_builds_and_takes_a_step_on_cpu(name, tmp_path):
    from sdxl_lora.core import checkpoint

    cfg = load_config(extra={"train.optimizer": name, "train.lr": 1e-3})
    torch.manual_seed(0)
    # 8-bit optimizers keep small tensors (< 4096 elements) in 32 bits: one large enough to be quantized.
    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(8))]
    opt = build_optimizer(cfg, [{"params": params}])
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        loss = sum((p ** 2).sum() for p in params)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for p, b in zip(params, before):
        assert torch.isfinite(p).all()
        assert (p - b).abs().max() > 1e-5
    # Its state survives the training-state format (tensors and numbers, loaded with weights_only).
    trainer = {"step": 1, "epoch": 0, "position": 1, "schedule": {}, "rng": {}}  # as the loop writes it
    checkpoint.save_state(tmp_path, 1, {"w": params[0]}, opt.state_dict(), trainer, keep=1)
    _, state, _ = checkpoint.load_state(checkpoint.newest_valid(tmp_path))
    opt.load_state_dict(state)


def test_prodigy_needs_its_package_and_says_so():
    import importlib.util

    cfg = load_config(extra={"train.optimizer": "prodigy", "train.lr": 1.0})
    params = [{"params": [torch.nn.Parameter(torch.randn(4))]}]
    if importlib.util.find_spec("prodigyopt") is None:
        with pytest.raises(ImportError, match="prodigyopt"):
            build_optimizer(cfg, params)
    else:
        build_optimizer(cfg, params).step()


def test_missing_bitsandbytes_names_the_qlora_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    cfg = load_config(extra={"train.optimizer": "lion"})
    with pytest.raises(ImportError, match=r"qlora"):
        build_optimizer(cfg, [{"params": [torch.nn.Parameter(torch.randn(4))]}])


# ---------------------------------------------------------------- NaN/Inf guard

from safetensors.torch import load_file  # noqa: E402

from sdxl_lora.cli import main  # noqa: E402
from sdxl_lora.core.runs import read_events  # noqa: E402


def inject_nan(monkeypatch, at):
    """Make SDXLTask.loss return NaN (and so NaN gradients) at the given optimizer steps (1-based)."""
    real = SDXLTask.loss
    calls = {"n": 0}

    def loss(self, model, batch):
        calls["n"] += 1
        out = real(self, model, batch)
        return out * float("nan") if at(calls["n"]) else out

    monkeypatch.setattr(SDXLTask, "loss", loss)


def guarded_run(out, name, cache, *extra):
    return main(["train", "--out", str(out), "--name", name, "--steps", "5", "--set", "preview.prompts=''",
                 "--set", f"data.cache_dir='{cache}'",
                 "--set", "train.log_every=1", "--set", "train.save_every=1", "--set", "train.keep_checkpoints=10",
                 "--set", "train.save_every_minutes=0", *extra])


def state_adapter(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step-{step:08d}" / "adapter.safetensors")


def test_a_nan_step_is_skipped_and_the_run_finishes(tmp_path, monkeypatch, shared_cache):
    inject_nan(monkeypatch, lambda n: n == 3)
    assert guarded_run(tmp_path, "n", shared_cache) == 0
    run = tmp_path / "n"
    events = read_events(run / "events.jsonl")
    assert [(e["step"], e["in_a_row"]) for e in events if e["event"] == "nonfinite"] == [(3, 1)]
    assert events[-1]["event"] == "done"
    s2, s3, s4 = (state_adapter(run, k) for k in (2, 3, 4))
    assert all(torch.equal(s2[k], s3[k]) for k in s2)  # the skipped step changed no weight
    assert any(not torch.equal(s3[k], s4[k]) for k in s3)  # and training went on after it
    final = load_file(run / "n.diffusers.safetensors")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert all(math.isfinite(e["loss"]) for e in events if e["event"] == "step" and e["step"] != 3)


def test_nans_in_a_row_stop_the_run_with_a_state_it_resumes_from(tmp_path, monkeypatch, caplog, shared_cache):
    inject_nan(monkeypatch, lambda n: n >= 3)
    assert guarded_run(tmp_path, "s", shared_cache, "--set", "train.max_nan_steps=2") == 130
    run = tmp_path / "s"
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "nonfinite"] == [3, 4]
    stop = events[-1]
    assert stop["event"] == "interrupted" and stop["signal"] == "nan_guard" and stop["step"] == 4
    assert "bf16" in stop["message"] and "learning rate" in stop["message"]
    assert "try train.mixed_precision='bf16'" in caplog.text
    assert not (run / "s.safetensors").exists()
    # The state at the stop holds the last good weights (step 2's).
    s2, s4 = state_adapter(run, 2), state_adapter(run, 4)
    assert all(torch.equal(s2[k], s4[k]) for k in s2)

    monkeypatch.undo()  # the cause is fixed: resume and finish
    assert main(["train", "--resume", str(run)]) == 0
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]
    assert events[-1]["event"] == "done" and (run / "s.safetensors").is_file()


def test_the_guard_reads_each_steps_verdict_a_step_later_and_the_optimizer_skips_on_the_device(
        tmp_path, monkeypatch, shared_cache):
    # Fused AdamW skips a step itself (found_inf), so the host need not wait for a step before queueing the
    # next one: the verdict on step k is read once step k+1 is queued (and at log, save and stop points).
    from sdxl_lora.core.nan_guard import NanGuard, PendingFlag

    inject_nan(monkeypatch, lambda n: n == 3)
    reads, steps_seen, now = [], {}, [0]
    real_bad = PendingFlag.bad
    real_verdict = NanGuard.verdict
    real_after_step = NanGuard.after_step

    def bad(self):
        reads.append(self.step)
        return real_bad(self)

    def after_step(self, step, skipped):
        now[0] = step  # the step the trainer has just taken
        return real_after_step(self, step, skipped)

    def verdict(self, step, was_bad):
        steps_seen[step] = now[0]  # the step counter when the verdict on `step` is known
        return real_verdict(self, step, was_bad)

    monkeypatch.setattr(PendingFlag, "bad", bad)
    monkeypatch.setattr(NanGuard, "after_step", after_step)
    monkeypatch.setattr(NanGuard, "verdict", verdict)
    assert main(["train", "--out", str(tmp_path), "--name", "d", "--steps", "7", "--set", "preview.prompts=''",
                 "--set", f"data.cache_dir='{shared_cache}'", "--set", "train.log_every=5",
                 "--set", "train.save_every=0", "--set", "train.save_every_minutes=0"]) == 0
    events = read_events(tmp_path / "d" / "events.jsonl")
    assert [(e["step"], e["in_a_row"]) for e in events if e["event"] == "nonfinite"] == [(3, 1)]
    assert sorted(reads) == list(range(1, 8))  # every step's verdict read once
    # Read a step late, except at the log points (the first step, step 5 and the last), where the host
    # waits anyway.
    assert steps_seen == {1: 1, 2: 3, 3: 4, 4: 5, 5: 5, 6: 7, 7: 7}
    assert events[-1]["event"] == "done"
    final = load_file(tmp_path / "d" / "d.diffusers.safetensors")
    assert all(torch.isfinite(v).all() for v in final.values())  # the NaN step changed nothing


def test_the_optimizer_skips_a_flagged_step_entirely_on_the_device():
    cfg = load_config()
    p = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer(cfg, [{"params": [p]}])
    p.grad = torch.ones(4)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.full((4,), float("nan"))
    opt.found_inf = torch.tensor(1.0)  # what the NaN guard sets
    opt.step()
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())  # moments and step count too
