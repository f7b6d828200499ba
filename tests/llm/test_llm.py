"""The causal-LM path: the tiny Llama trains (loss falls, answers change), its PEFT adapter loads in peft
and gives the trained model's logits, the loss is on answers only, packing keeps examples apart, and
truncation is reported."""
import json

import pytest
import torch

from sdxl_lora.cli import main
from sdxl_lora.core.config import ModelConfig, load_config
from sdxl_lora.llm import data as llm_data
from sdxl_lora.llm.loss import example_losses, token_losses
from sdxl_lora.llm.tiny import materialize_tiny_llm

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_llm():
    return materialize_tiny_llm(ModelConfig().cache_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_llm):
    from sdxl_lora.llm.model import load_tokenizer

    return load_tokenizer(tiny_llm)


def _base(tiny_llm, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llm), local_files_only=True, attn_implementation=attn).eval()


IDS = torch.tensor([[3, 89, 482, 203, 339, 305, 283, 275, 358, 450, 35, 4, 203]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short training run of the tiny LLM, and the trained model's logits on IDS."""
    from sdxl_lora.llm.task import LLMTask
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.core.loop import Trainer

    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(extra={"task": "llm", "output.runs_dir": str(out), "output.name": "tiny", "train.steps": 40,
                             "train.lr": 3e-3, "train.log_every": 10, "llm.merge": True, "llm.max_length": 40,
                             "llm.max_new_tokens": 12})
    run = create_run(cfg)
    trainer = Trainer(cfg, LLMTask(cfg), run)
    trainer.setup()
    trainer.fit()
    model = trainer.task.lm.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return run.dir, logits


def test_tiny_llm_trains_and_reports(trained):
    run_dir, _ = trained
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    evals = [e["loss"] for e in events if e["event"] == "eval"]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.3, evals
    steps = [e["loss"] for e in events if e["event"] == "step"]
    assert steps[-1] < steps[0]
    # Previews before and after: greedy answers to the fixed prompts.
    before = json.loads((run_dir / "samples" / "answers-step000000.json").read_text())
    after = json.loads((run_dir / "samples" / "answers-step000040.json").read_text())
    assert [a["prompt"] for a in before] == load_config(extra={"task": "llm"}).llm.preview_prompts
    assert [a["answer"] for a in before] != [a["answer"] for a in after]
    # The longest examples do not fit 40 tokens: the run says how many were cut and by how much.
    ds = next(e for e in events if e["event"] == "dataset")
    assert ds["truncated"] > 0 and ds["truncated_tokens"] > 0
    cfg = load_config(run_dir / "config.toml")
    assert cfg.task == "llm" and cfg.model.path == "tiny-llm"
    # The run states the step's expected peak at start, as `llm plan` does for its config.
    est = next(e for e in events if e["event"] == "memory_estimate")
    assert est["parts_gib"]["activations"] > 0 and est["total_gib"] == pytest.approx(sum(est["parts_gib"].values()),
                                                                                     abs=0.01)


def test_adapter_loads_in_peft_with_the_same_logits(trained, tiny_llm, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, want = trained
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    peft_model = PeftModel.from_pretrained(_base(tiny_llm), str(adapter)).eval()
    with torch.no_grad():
        got = peft_model(input_ids=IDS).logits
        plain = _base(tiny_llm)(input_ids=IDS).logits
    assert not torch.allclose(plain, want, atol=1e-3)  # the adapter changed the model
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The merged model (llm.merge=true) is a plain transformers folder with the same logits.
    merged = AutoModelForCausalLM.from_pretrained(str(run_dir / "merged"), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, want, atol=1e-4, rtol=1e-4)
    # `llm merge` and `llm generate` from the command line, on the run folder.
    assert main(["llm", "merge", "--adapter", str(run_dir), "--out", str(tmp_path / "m"), "--dtype", "fp32"]) == 0
    # Even with --overwrite, an --out that holds what the merge reads (the run folder holds the adapter) is refused:
    # the folder would be replaced whole.
    assert main(["llm", "merge", "--adapter", str(run_dir), "--out", str(run_dir), "--overwrite"]) != 0
    assert "is the folder of run" in capsys.readouterr().err and (adapter / "adapter_model.safetensors").is_file()
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, want, atol=1e-4, rtol=1e-4)
    capsys.readouterr()
    prompt = load_config(extra={"task": "llm"}).llm.preview_prompts[0]
    assert main(["llm", "generate", "--adapter", str(run_dir), "--max-new-tokens", "12", prompt]) == 0
    after = json.loads((run_dir / "samples" / "answers-step000040.json").read_text())[0]["answer"]
    assert capsys.readouterr().out.strip() == after


def test_preview_answers_come_from_the_adapter_merged_and_its_layers_out(tmp_path, monkeypatch):
    # Generation calls the model once a token: the previews answer with the adapter merged into copies of the
    # weights it adapts and its layers out of the model (no adapter code runs), then training goes on with them.
    from peft.tuners.tuners_utils import BaseTunerLayer

    from sdxl_lora.core.loop import Trainer
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.llm import task as llm_task

    seen = []

    def answer(model, *args, **kwargs):
        seen.append(sum(isinstance(m, BaseTunerLayer) for m in model.modules()))
        return real(model, *args, **kwargs)

    real = llm_task.answer
    monkeypatch.setattr(llm_task, "answer", answer)
    cfg = load_config(extra={"task": "llm", "output.runs_dir": str(tmp_path), "train.steps": 2,
                             "llm.max_length": 40, "llm.max_new_tokens": 4})
    trainer = Trainer(cfg, llm_task.LLMTask(cfg), create_run(cfg))
    trainer.setup()
    layers = sum(isinstance(m, BaseTunerLayer) for m in trainer.task.lm.modules())
    trainer.fit()
    assert layers > 0 and seen == [0, 0]  # before and after training
    assert sum(isinstance(m, BaseTunerLayer) for m in trainer.task.lm.modules()) == layers


def test_loss_is_on_answers_only(tokenizer):
    template = llm_data.chat_template(load_config(extra={"task": "llm"}).llm, tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat backwards."},
            {"role": "assistant", "content": "tac"}, {"role": "user", "content": "And dog?"},
            {"role": "assistant", "content": "god"}]
    ids, labels = llm_data.encode(tokenizer, template, msgs, "test")
    learned = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != llm_data.IGNORE])
    assert learned == "tac<|im_end|>\ngod<|im_end|>\n"
    prompt = tokenizer.decode([t for t, lab in zip(ids, labels) if lab == llm_data.IGNORE])
    assert "Spell cat backwards." in prompt and "And dog?" in prompt and "tac" not in prompt

    # And the loss itself: positions predicting prompt tokens contribute exactly nothing.
    model = _base(materialize_tiny_llm(ModelConfig().cache_dir))
    ex = llm_data.Example("t", ids, labels)
    batch = llm_data.collate([llm_data.RowDataset([ex], 512, False)[0]], tokenizer.pad_token_id)
    with torch.no_grad():
        losses = token_losses(model, model, batch)
    labelled = batch["labels"][:, 1:] != llm_data.IGNORE
    assert (losses[~labelled] == 0).all() and (losses[labelled] > 0).all()


@pytest.mark.parametrize("head", ["frozen", "trained"])
def test_the_chunked_loss_gives_transformers_loss_and_gradients(tiny_llm, tokenizer, head):
    # The loss training uses (llm/loss.py): the head and cross-entropy a chunk at a time, the frozen head's
    # gradient taken in the forward pass, a trained head's chunks checkpointed. Against transformers' own loss
    # on full logits: the same loss and the same gradient on every weight, with a chunk that does not divide
    # the tokens and prompt tokens that carry no label.
    from sdxl_lora.llm.loss import response_loss

    examples, _ = llm_data.read_examples(load_config(extra={"task": "llm"}).llm, tokenizer)
    rows = llm_data.RowDataset(examples[:6], 96, packing=True)
    batch = llm_data.collate([rows[0], rows[1]], tokenizer.pad_token_id)
    assert (batch["labels"] == llm_data.IGNORE).any() and batch["input_ids"][:, 1:].numel() % 7

    def grads(ours: bool):
        model = _base(tiny_llm).train()
        model.lm_head.requires_grad_(head == "trained")
        if ours:
            loss = response_loss(model, model, batch, chunk=7)
        else:
            loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         labels=batch["labels"], use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (loss, got), (want_loss, want) = grads(True), grads(False)
    assert loss == pytest.approx(float(want_loss), rel=1e-5)
    assert got.keys() == want.keys() and ("lm_head.weight" in got) == (head == "trained")
    for n, g in want.items():
        assert torch.allclose(got[n], g, rtol=1e-4, atol=1e-7), n


@pytest.mark.parametrize("cap", [None, 30.0], ids=["plain", "soft-capped"])
def test_the_frozen_heads_loss_holds_one_chunk_of_logits_as_llm_plan_counts(cap):
    # The memory `llm plan` counts for the loss (llm/memory.py), against the tensors the loss really holds
    # (torch's MemTracker, on this CPU): a bf16 head, 128-token chunks of a 4096-word vocabulary; the logits
    # soft-capped or not (Gemma 2).
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaConfig

    from sdxl_lora.llm.loss import _chunk_ce, head_cross_entropy
    from sdxl_lora.llm.memory import activation_bytes

    tokens, hidden, vocab, chunk = 512, 32, 4096, 128
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16).requires_grad_(False)
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    config.final_logit_softcapping = cap

    def peak(loss_fn) -> int:
        tracker = MemTracker()
        with tracker:
            loss_fn().sum().backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    def planned(trained: bool) -> int:
        return activation_bytes(config, 1, tokens, True, torch.bfloat16, chunk, head_trained=trained).loss

    fused = peak(lambda: head_cross_entropy(h, head, y, chunk, cap))
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def checkpointed():  # the head as a function: MemTracker follows a module's calls, one per chunk here
        def linear(x):
            return F.linear(x, head.weight)

        return torch.cat([checkpoint(_chunk_ce, linear, h[s:s + chunk], y[s:s + chunk], cap, use_reentrant=False)
                          for s in range(0, tokens, chunk)])

    head.requires_grad_(True)  # what a trained head runs
    ckpt = peak(checkpointed)
    assert fused < 0.7 * ckpt
    assert 0.85 * fused <= planned(False) and 0.85 * ckpt <= planned(True)
    assert planned(False) <= 1.15 * fused and planned(True) <= 1.15 * ckpt, (fused, ckpt)


def test_under_autocast_the_adapters_keep_each_input_once_with_the_same_gradients(tiny_llm, tmp_path):
    # A bf16 run (a GPU's, or train.mixed_precision='bf16' here) trains the fp32 adapter under autocast. peft's
    # own cast of each adapter's input to fp32 made a copy per layer that autocast cast back, and each layer
    # kept its copy for the backward (q, k and v three of one input). The run turns it off: the step keeps less,
    # the gradients are the same bit for bit (the bf16 -> fp32 -> bf16 round trip is exact).
    from sdxl_lora.core import inject
    from sdxl_lora.llm.config import AdapterConfig
    from sdxl_lora.llm import slots as llm_slots

    ids = torch.randint(3, 400, (2, 45), generator=torch.Generator().manual_seed(0))

    def step(take: bool):
        model = _base(tiny_llm).to(torch.bfloat16).train()
        torch.manual_seed(0)
        inject.apply_plan(model, llm_slots.make_plan(model, AdapterConfig(preset="full", rank=4)))
        if take:
            assert inject.adapters_take_autocast_inputs(model) > 0
        kept: dict[int, int] = {}

        def pack(t):
            if ids.shape[1] in t.shape or ids.numel() in t.shape:  # activations (a token dim), not weights
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return sum(kept.values()), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (before, want), (after, got) = step(False), step(True)
    assert after < 0.9 * before, (before, after)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

    # A bf16 run sets it up so; its previews, evaluation and export run as before. (Its own process: the
    # accelerator's precision is fixed for a process at its first use.)
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from sdxl_lora.core.config import load_config
        from sdxl_lora.core.loop import Trainer
        from sdxl_lora.core.runs import create_run
        from sdxl_lora.llm.task import LLMTask

        cfg = load_config(extra={{"task": "llm", "output.runs_dir": {str(tmp_path)!r}, "output.name": "bf16",
                                  "train.steps": 2, "train.mixed_precision": "bf16", "llm.max_length": 64,
                                  "llm.max_new_tokens": 4}})
        trainer = Trainer(cfg, LLMTask(cfg), create_run(cfg))
        trainer.setup()
        layers = [m for m in trainer.task.lm.modules() if isinstance(m, BaseTunerLayer)]
        print("layers", len(layers), "casting", sum(m.cast_input_dtype_enabled for m in layers))
        trainer.fit()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    counts = next(line for line in done.stdout.splitlines() if line.startswith("layers")).split()
    assert int(counts[1]) > 0 and counts[3] == "0"
    assert (tmp_path / "bf16" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_keep_examples_apart(tiny_llm, tokenizer, attn):
    cfg = load_config(extra={"task": "llm"}).llm
    examples, _ = llm_data.read_examples(cfg, tokenizer)
    examples = examples[:12]
    model = _base(tiny_llm, attn)
    packed = llm_data.RowDataset(examples, 256, packing=True)
    single = llm_data.RowDataset(examples, 256, packing=False)
    assert len(packed) < len(single)

    def per_example(rows, batch_rows):
        out = {}
        for start in range(0, len(rows), batch_rows):
            batch = llm_data.collate([rows[r] for r in range(start, min(len(rows), start + batch_rows))],
                                     tokenizer.pad_token_id)
            with torch.no_grad():
                out.update(example_losses(token_losses(model, model, batch, chunk=64), batch))
        return out

    a, b = per_example(packed, 2), per_example(single, 3)
    assert sorted(a) == sorted(b) == list(range(len(examples)))
    for i in a:
        assert a[i] == pytest.approx(b[i], abs=1e-4), (i, a[i], b[i])
    # Without the position ids the rows would be one long sequence: examples would see each other.
    row = packed[0]
    batch = llm_data.collate([row], tokenizer.pad_token_id)
    leaky = dict(batch, position_ids=torch.arange(len(row["input_ids"]))[None])
    with torch.no_grad():
        leaked = example_losses(token_losses(model, model, leaky), leaky)
    later = [i for i in leaked if i != int(row["example"][0])]
    assert any(abs(leaked[i] - b[i]) > 1e-3 for i in later)


def test_truncation_is_reported(tokenizer, tmp_path):
    long = {"instruction": "Say ok many times.", "output": "ok " * 40}
    short = {"instruction": "Say hi.", "output": "hi"}
    prompt_only = {"instruction": "x " * 80, "output": "never seen"}
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (long, short, prompt_only)))
    cfg = load_config(extra={"task": "llm", "llm.data": [str(f)], "llm.max_length": 48}).llm
    full_lengths = [len(llm_data.encode(tokenizer, llm_data.chat_template(cfg, tokenizer),
                                        llm_data.to_messages(r, "auto", "t", None), "t")[0])
                    for r in (long, short, prompt_only)]
    examples, report = llm_data.read_examples(cfg, tokenizer)
    assert report.truncated == 2
    assert report.truncated_tokens == sum(n - 48 for n in full_lengths if n > 48)
    assert report.dropped == ["d.jsonl:3"] and len(examples) == 2
    assert all(len(e.input_ids) <= 48 for e in examples)
    text = report.text()
    assert "truncated: 2 example(s)" in text and "dropped: 1 example(s)" in text


def test_bad_lines_are_refused_naming_the_file_and_line(tokenizer, tmp_path):
    good = json.dumps({"instruction": "Say hi.", "output": "hi"}) + "\n"
    cases = {
        "latin1.jsonl": (good + '{"instruction": "caf\xe9?", "output": "yes"}\n').encode("latin-1"),
        "role.jsonl": (good + json.dumps({"messages": [{"role": "human", "content": "hi"},
                                                        {"role": "assistant", "content": "hello"}]}) + "\n").encode(),
        "empty.jsonl": (good + json.dumps({"instruction": "Say nothing.", "output": "  "}) + "\n").encode(),
    }
    expected = {"latin1.jsonl": "latin1.jsonl:2 is not UTF-8", "role.jsonl": r"role.jsonl:2: unknown role\(s\) 'human'",
                "empty.jsonl": "empty.jsonl:2: an empty answer"}
    for name, content in cases.items():
        f = tmp_path / name
        f.write_bytes(content)
        cfg = load_config(extra={"task": "llm", "llm.data": [str(f)]}).llm
        with pytest.raises(llm_data.DataError, match=expected[name]):
            llm_data.read_examples(cfg, tokenizer)


def test_bad_model_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    rc = main(["llm", "train", "--model", str(folder), "--out", str(tmp_path / "runs"), "--steps", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "not a causal LM" in err and "vit" in err
    rc = main(["llm", "train", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "runs"), "--name", "b",
               "--steps", "1"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_qlora_trains_and_merges_into_the_dequantized_base(tmp_path, tiny_llm):
    """model.quantize=nf4: the frozen base is 4-bit (lm_head kept), the loss falls, and the merged model
    (base quantized and dequantized again, adapter baked in) answers as the trained model does."""
    from transformers import AutoModelForCausalLM

    from sdxl_lora.llm.task import LLMTask
    from sdxl_lora.core.quantize import is_quantized
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.core.loop import Trainer

    cfg = load_config(extra={"task": "llm", "model.quantize": "nf4", "output.runs_dir": str(tmp_path),
                             "output.name": "q", "train.steps": 15, "train.lr": 3e-3, "llm.merge": True,
                             "preview.before": False, "llm.max_new_tokens": 4})
    trainer = Trainer(cfg, LLMTask(cfg), create_run(cfg))
    trainer.setup()
    model = trainer.task.lm
    assert is_quantized(model) and type(model.lm_head) is torch.nn.Linear
    result = trainer.fit()
    assert result.eval_after < result.eval_before - 0.3
    with torch.no_grad():
        want = model.eval()(input_ids=IDS).logits
    merged = AutoModelForCausalLM.from_pretrained(str(result.adapter["merged"]), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, want, atol=2e-3, rtol=2e-3)


def test_resumed_run_gives_the_same_adapter(tmp_path):
    """Killed after its step-4 state, a run resumed from it ends with the adapter of the run that went on."""
    from safetensors.torch import load_file

    from sdxl_lora.core.checkpoint import newest_valid
    from sdxl_lora.llm.task import LLMTask
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.core.loop import Trainer

    cfg = load_config(extra={"task": "llm", "output.runs_dir": str(tmp_path), "output.name": "r", "train.steps": 8,
                             "train.save_every": 4, "train.lr": 3e-3, "llm.max_length": 64, "llm.packing": False,
                             "preview.before": False, "preview.after": False})
    run = create_run(cfg)
    trainer = Trainer(cfg, LLMTask(cfg), run)
    trainer.setup()
    straight = load_file(str(trainer.fit().adapter["peft"] / "adapter_model.safetensors"))
    state = newest_valid(run.checkpoints_dir)
    assert state.name == "step-00000004"
    trainer = Trainer(cfg, LLMTask(cfg), run, resume=state)
    trainer.setup()
    resumed = load_file(str(trainer.fit().adapter["peft"] / "adapter_model.safetensors"))
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_presets_and_rank_budget_on_a_causal_lm(tiny_llm, tmp_path, caplog):
    from sdxl_lora.llm import slots as llm_slots
    from sdxl_lora.llm.config import AdapterConfig
    from sdxl_lora.llm.task import LLMTask
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.core.loop import Trainer

    model = _base(tiny_llm)
    attn = llm_slots.make_plan(model, AdapterConfig(preset="attn", rank=8))
    assert sorted({s.proj for s in attn.targets}) == ["k", "o", "q", "v"]
    full = llm_slots.make_plan(model, AdapterConfig(preset="full", rank=8))
    assert len(full.targets) == 7 * model.config.num_hidden_layers and set(full.rank.values()) == {8}
    assert all(s.name != "lm_head" for s in full.targets)

    # A budget: ranks redistributed by measured sensitivity, the adapter trains at that size.
    budget = 30_000
    cfg = load_config(extra={"task": "llm", "output.runs_dir": str(tmp_path), "adapter.rank_budget": budget,
                             "adapter.calibration_batches": 2, "train.steps": 2, "preview.before": False,
                             "preview.after": False})
    trainer = Trainer(cfg, LLMTask(cfg), create_run(cfg))
    trainer.setup()
    # SDXL-only speed switches that are on by default say nothing on the LLM path unless the user set them.
    assert "fuse_qkv" not in caplog.text and "fused_geglu" not in caplog.text
    plan = trainer.task.plan
    assert plan.trainable_params <= budget and len(set(plan.rank.values())) > 1
    trainable = [(n, p) for n, p in trainer.task.lm.named_parameters() if p.requires_grad]
    assert sum(p.numel() for _, p in trainable) == plan.trainable_params
    assert all(".default." in n for n, _ in trainable)
    result = trainer.fit()
    assert result.adapter["peft"].is_dir()


def test_llm_speed_auto_compiles_the_decoder_layers_of_a_long_run_on_a_gpu_and_keeps_what_the_user_set():
    # train.speed is no longer SDXL-only: for a causal LM "auto" decides the compilation of its decoder layers.
    from sdxl_lora.llm.task import COMPILE_MIN_TOKENS, auto_levers

    def cfg(**extra):
        return load_config(extra={"task": "llm", "llm.max_length": 2048, "train.batch_size": 4, **extra})

    rows = 4 * 2048
    long = cfg(**{"train.steps": COMPILE_MIN_TOKENS // rows + 1})
    got, why = auto_levers(long, "cuda", 1)
    assert got.train.compile == "regional" and why["compile"].startswith("'regional': the run trains up to")
    short, why = auto_levers(cfg(**{"train.steps": COMPILE_MIN_TOKENS // rows - 1}), "cuda", 1)
    assert short.train.compile == "none" and "fewer than compiling pays for" in why["compile"]
    # Two processes train twice the tokens in the same steps.
    assert auto_levers(cfg(**{"train.steps": COMPILE_MIN_TOKENS // rows // 2 + 1}), "cuda", 2)[0].train.compile == \
        "regional"
    # The user's setting wins; a CPU run, or speed="off", changes nothing.
    kept, why = auto_levers(cfg(**{"train.steps": 10**6, "train.compile": "none"}), "cuda", 1)
    assert kept.train.compile == "none" and why == {"compile": "'none', as set"}
    assert auto_levers(long, "cpu", 1) == (long, {})
    off = cfg(**{"train.steps": 10**6, "train.speed": "off"})
    assert auto_levers(off, "cuda", 1) == (off, {})


def test_llm_speed_auto_replays_small_steps_from_cuda_graphs_where_they_fit(monkeypatch):
    # A step of a few thousand tokens is paced by the host's kernel launches: auto replays the compiled layers from
    # CUDA graphs there, and not where they were not measured to pay or cannot run: larger steps, checkpointing, a
    # memory budget, several processes, another adapter kind, or the user's own setting; nor where the step and the
    # graphs' memory would not fit the GPU.
    from sdxl_lora.core.memory import GiB
    from sdxl_lora.llm.task import COMPILE_MIN_TOKENS, GRAPHS_MAX_TOKENS, LLMTask, auto_levers

    def cfg(batch=1, **extra):
        return load_config(extra={"task": "llm", "llm.max_length": 2048, "train.batch_size": batch,
                                  "train.steps": COMPILE_MIN_TOKENS // (batch * 2048) + 1, **extra})

    got, why = auto_levers(cfg(), "cuda", 1)
    assert got.train.compile == "regional" and got.train.cuda_graphs
    assert why["cuda_graphs"].startswith(f"True: a step of 2,048 tokens (at most {GRAPHS_MAX_TOKENS:,})")
    for c, processes in [(cfg(batch=4), 1), (cfg(**{"train.gradient_checkpointing": True}), 1),
                         (cfg(**{"train.vram_gb": 24}), 1), (cfg(), 2), (cfg(**{"adapter.kind": "dora"}), 1),
                         (cfg(**{"train.cuda_graphs": False}), 1)]:
        got, why = auto_levers(c, "cuda", processes)
        assert not got.train.cuda_graphs and "cuda_graphs" not in why
    assert not auto_levers(cfg(), "cpu", 1)[0].train.cuda_graphs
    # A compilation the user set gets the graphs too; a short run compiles nothing, so it gets none.
    assert auto_levers(cfg(**{"train.compile": "regional", "train.steps": 5}), "cuda", 1)[0].train.cuda_graphs
    assert not auto_levers(cfg(**{"train.steps": 5}), "cuda", 1)[0].train.cuda_graphs

    # Before any weight is read, llm plan's whole process for the config plus the graphs' reserve must fit in 95%
    # of the GPU (a stand-in for its properties: this machine has none).
    from sdxl_lora.llm.memory import config_memory
    from sdxl_lora.llm.model import check_causal_lm_folder, resolve_llm_path
    from sdxl_lora.llm.task import GRAPHS_RESERVE

    c = cfg()
    need = config_memory(c, check_causal_lm_folder(resolve_llm_path(c.model), weights=False))[1].peak + GRAPHS_RESERVE
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for total, kept in ((int(need / 0.95) + 2**20, True), (int(need / 0.95) - 2**20, False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": total}))
        task = LLMTask(c)
        assert task.configure(c, "cuda", 1).train.cuda_graphs is kept and task.cfg.train.cuda_graphs is kept
        assert task._speed_choices["cuda_graphs"].startswith("True" if kept else "False: the step and the graphs'")
        if not kept:
            assert f"would not fit in 95% of this GPU's {total / GiB:.1f} GiB" in task._speed_choices["cuda_graphs"]


def test_llm_cuda_graphs_compile_the_layers_and_refuse_checkpointing_unless_a_budget_chose_it(tmp_path, caplog):
    # train.cuda_graphs for a causal LM: inductor's CUDA graphs replay the compiled decoder layers, so auto
    # compiles them whatever the run's length; graphs cannot replay checkpointed layers, so asking for both is
    # refused before any weight is read, while a memory budget that needs checkpointing wins with a warning.
    from transformers import LlamaConfig

    from sdxl_lora.core.config import ConfigError
    from sdxl_lora.core.loop import Trainer
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.llm.task import LLMTask, auto_levers

    def cfg(**extra):
        return load_config(extra={"task": "llm", "train.steps": 2, "train.cuda_graphs": True,
                                  "output.runs_dir": str(tmp_path), **extra})

    short = cfg()
    got, why = auto_levers(short, "cuda", 1)
    assert got.train.compile == "regional" and "cuda_graphs" in why["compile"]
    with pytest.raises(ConfigError, match="it needs train.compile = 'regional'"):
        LLMTask(c := cfg(**{"train.compile": "none"})).configure(c, "cuda", 1)
    for device in ("cuda", "cpu"):
        with pytest.raises(ConfigError, match="train.cuda_graphs with train.gradient_checkpointing"):
            LLMTask(c := cfg(**{"train.gradient_checkpointing": True})).configure(c, device, 1)
    # Llama-3-8B's config, no weights: 24 GiB needs its layers checkpointed at 4 x 2048 tokens.
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8,
                tie_word_embeddings=False).save_pretrained(tmp_path / "8b")
    budget = cfg(**{"model.path": str(tmp_path / "8b"), "train.vram_gb": 24, "train.batch_size": 4,
                    "llm.max_length": 2048})
    with caplog.at_level("WARNING"):
        fitted = LLMTask(budget).configure(budget, "cuda", 1)
    assert fitted.train.gradient_checkpointing and not fitted.train.cuda_graphs
    assert "train.cuda_graphs is off for this run" in caplog.text
    # On a CPU the run trains without them, saying so.
    caplog.clear()
    on_cpu = cfg()
    with caplog.at_level("WARNING"):
        Trainer(on_cpu, LLMTask(on_cpu), create_run(on_cpu)).setup()
    assert "train.cuda_graphs needs a CUDA device; running without" in caplog.text


def test_llm_plan_reads_only_the_config_and_matches_the_8b_figures(tmp_path, capsys):
    # A Llama-3-8B folder with its config and no real weights: `llm plan` builds the model on the meta
    # device. Rank 16 on every linear of the 8B is the 41.9 M trainable parameters issue 10 states, and its
    # bf16 weights are 14.96 GiB (8.03 B parameters).
    import json

    from transformers import LlamaConfig

    from sdxl_lora.cli import main

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False).save_pretrained(tmp_path)
    base = ["llm", "plan", "--json", "--model", str(tmp_path), "--set", "adapter.preset='full'"]  # no weights
    assert main(base) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["modules"] == 32 * 7 and bf16["trainable_params"] == 41_943_040
    assert bf16["weights_gib"] == {"bf16": pytest.approx(14.96, abs=0.01)}
    assert main([*base, "--set", "model.quantize='nf4'"]) == 0
    nf4 = json.loads(capsys.readouterr().out)
    assert nf4["trainable_params"] == bf16["trainable_params"]
    # the 7 B parameters of the decoder's Linears at ~0.52 bytes; embeddings, norms and the head stay bf16
    assert 4.5 < sum(nf4["weights_gib"].values()) < 5.5
    assert main(["llm", "plan", "--model", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # The whole step's peak, activations included, against the peaks measured on the H200 for this model at
    # sequence 2048 with checkpointing (benchmarks/llm_step.py,
    # benchmarks/RESULTS.md#llm-step-against-a-plain-transformers-and-peft-loop): within 15%. They were
    # measured with the checkpointed loss chunks, before the frozen head's loss held less.
    measured = {("none", 1): 17.5, ("none", 4): 20.1, ("nf4", 1): 7.9, ("nf4", 4): 9.8}
    acts = {}
    for (quant, batch), peak in measured.items():
        assert main([*base, "--set", f"model.quantize='{quant}'", "--set", f"train.batch_size={batch}",
                     "--set", "llm.max_length=2048", "--set", "train.gradient_checkpointing=true"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["peak_gib"] == pytest.approx(peak, rel=0.15), (quant, batch, got["memory_gib"])
        acts[quant, batch] = got["memory_gib"]["activations"]
    # Without checkpointing every layer keeps all its activations: several times the checkpointed step's.
    assert main([*base, "--set", "train.batch_size=1", "--set", "llm.max_length=2048"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_gib"]["activations"] > 4 * acts["none", 1]
    # Without checkpointing, the step as `sdxl-lora llm train` ran it through benchmarks/llm_compare.py at
    # batch 4 (torch's peaks): within 15% too.
    for quant, peak in (("none", 70.4), ("nf4", 52.7)):
        assert main([*base, "--set", f"model.quantize='{quant}'", "--set", "train.batch_size=4",
                     "--set", "llm.max_length=2048"]) == 0
        assert json.loads(capsys.readouterr().out)["peak_gib"] == pytest.approx(peak, rel=0.15), quant
    # The checkpointed layers' inputs in host memory (llm.offload_activations): 32 layers x 4 x 2048 tokens x
    # 4096 x 2 bytes (2 GiB) leave the device, two layers' stay (the recomputed one's and the next, on its way).
    ckpt4 = [*base, "--set", "train.batch_size=4", "--set", "llm.max_length=2048",
             "--set", "train.gradient_checkpointing=true"]
    assert main(ckpt4) == 0
    kept = json.loads(capsys.readouterr().out)["memory_gib"]["activations"]
    assert main([*ckpt4, "--set", "llm.offload_activations=true"]) == 0
    assert kept - json.loads(capsys.readouterr().out)["memory_gib"]["activations"] == pytest.approx(30 / 16, abs=0.01)


def test_llm_memory_budget_chooses_checkpointing_then_nf4_and_refuses_what_cannot_fit(tmp_path, capsys, monkeypatch):
    # train.vram_gb (--vram) for an LLM: the fastest settings whose whole process fits, from the config alone.
    from transformers import LlamaConfig

    from sdxl_lora.core import kernels
    from sdxl_lora.llm.memory import LLM_BUDGET_FILL

    monkeypatch.setattr(kernels, "triton", None)  # the embedding's rows looked up by the host (no Triton)

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False).save_pretrained(tmp_path)
    base = ["llm", "plan", "--json", "--model", str(tmp_path), "--set", "adapter.preset='full'",
            "--max-length", "2048", "--batch-size", "4"]

    def fit(*extra):
        assert main([*base, *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["process_peak_gib"] <= LLM_BUDGET_FILL * got["vram_gb"]
        return got["budget_choices"]

    assert fit("--vram", "80") == {}  # every activation kept: it fits
    assert fit("--vram", "40") == {"train.gradient_checkpointing": True}
    # Between the two: the checkpointed layers' inputs and the 0.98 GiB embedding table wait in host memory,
    # slower steps than checkpointing alone but faster than quartering the batch.
    assert fit("--vram", "20") == {"train.gradient_checkpointing": True, "llm.offload_activations": True,
                                   "llm.offload_embeddings": True}
    # The bf16 base and its checkpointed batch of 4 do not fit 16 GiB: the base goes to nf4 (QLoRA).
    assert fit("--vram", "16") == {"model.quantize": "nf4", "train.gradient_checkpointing": True}
    # LoHa does not train over a 4-bit base: no nf4 for it, so 16 GiB is refused at the plan, not at the load.
    assert main([*base, "--vram", "16", "--set", "adapter.kind='loha'"]) == 2
    err = capsys.readouterr().err
    assert "train.vram_gb=16: this run needs at least about" in err and "model.quantize" not in err
    # What the config sets itself is kept: no checkpointing asked for, so a smaller batch carries the rows.
    assert fit("--vram", "40", "--set", "train.gradient_checkpointing=false") == {
        "train.batch_size": 1, "train.grad_accum": 4}
    # An 8 GiB card: QLoRA with both kinds of host memory and half the rows per step.
    assert fit("--vram", "8") == {"model.quantize": "nf4", "train.gradient_checkpointing": True,
                                  "llm.offload_activations": True, "llm.offload_embeddings": True,
                                  "train.batch_size": 2, "train.grad_accum": 2}
    assert main([*base, "--vram", "7"]) == 2
    err = capsys.readouterr().err
    assert "train.vram_gb=7: this run needs at least about" in err and "lower llm.max_length" in err
    # 22 GiB: checkpointing alone is 1 GiB over. The host's lookup of the embedding's rows costs more than
    # offloading the layers' inputs; where the GPU reads them from the pinned table (Triton), it costs nothing,
    # and the plan keeps the layers' inputs on the GPU instead.
    assert fit("--vram", "22") == {"train.gradient_checkpointing": True, "llm.offload_activations": True}
    monkeypatch.setattr(kernels, "triton", object())
    assert fit("--vram", "22") == {"train.gradient_checkpointing": True, "llm.offload_embeddings": True}
    assert fit("--vram", "80") == {}  # free, but not taken where nothing is needed


def test_llm_run_under_a_memory_budget_says_what_it_chose_and_trains(tmp_path, capsys):
    from sdxl_lora.core.runs import read_events
    from sdxl_lora.llm.memory import LLM_BUDGET_FILL

    out = tmp_path / "runs"
    assert main(["llm", "train", "--out", str(out), "--name", "b", "--steps", "1", "--max-length", "2048",
                 "--batch-size", "8", "--vram", "1.2", "--set", "train.save_every=0", "--set", "llm.preview_prompts=[]"]) == 0
    events = read_events(out / "b" / "events.jsonl")
    plan = next(e for e in events if e["event"] == "budget_plan")
    assert plan["vram_gb"] == 1.2 and plan["choices"] and plan["peak_gib"] <= LLM_BUDGET_FILL * 1.2
    assert events[-1]["event"] == "done"
    # `llm plan` with the same flags says the same before anything is loaded.
    capsys.readouterr()
    assert main(["llm", "plan", "--json", "--max-length", "2048", "--batch-size", "8", "--vram", "1.2"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_choices"] == plan["choices"]


def test_offloaded_checkpointing_frees_each_layers_input_and_gives_the_same_gradients(tiny_llm):
    # llm.offload_activations: each decoder layer's input waits in host memory, not on the device, until
    # backward recomputes the layer; the loss and gradients are those of the model as it is.
    import gc
    import weakref

    from sdxl_lora.llm.offload import checkpoint_layers

    ids = IDS.repeat(2, 1)

    def step(model):
        inputs, forward = [], [True]  # the layers' inputs in the forward pass, not in the recomputation
        hooks = [layer.register_forward_pre_hook(
            lambda m, args, kw: inputs.append(weakref.ref(args[0] if args else kw["hidden_states"]))
            if forward[0] else None, with_kwargs=True)
            for layer in model.model.layers]
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        alive = sum(r() is not None for r in inputs)
        forward[0] = False
        loss.backward()
        for h in hooks:
            h.remove()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, alive, len(inputs)

    plain_loss, plain_grads, _, _ = step(_base(tiny_llm).train())
    ckpt = _base(tiny_llm).train()
    layers = checkpoint_layers(ckpt, type(ckpt.model.layers[0]))
    ckpt_loss, ckpt_grads, ckpt_alive, seen = step(ckpt)
    assert seen == layers == len(ckpt.model.layers) >= 2 and ckpt_alive == layers  # kept on the device
    assert torch.allclose(ckpt_loss, plain_loss)
    assert all(torch.allclose(ckpt_grads[n], g, rtol=1e-4, atol=1e-6) for n, g in plain_grads.items() if g is not None)

    model = _base(tiny_llm).train()
    assert checkpoint_layers(model, type(model.model.layers[0]), offload=True) == layers
    loss, grads, alive, seen = step(model)
    assert seen == layers and alive == 0
    assert torch.allclose(loss, plain_loss)
    assert all(torch.allclose(grads[n], g, rtol=1e-4, atol=1e-6) for n, g in plain_grads.items() if g is not None)
    # Not training, or no gradients: the layers run as they are.
    with torch.no_grad():
        assert torch.allclose(model.eval()(input_ids=ids).logits, _base(tiny_llm)(input_ids=ids).logits)


def test_offloaded_inputs_come_back_one_layer_ahead_and_are_freed_after_backward(tiny_llm):
    # llm.offload_activations: as backward recomputes a layer, the input of the layer before it is already on
    # its way back, so the copy overlaps the work instead of waiting in line; nothing outlives the step.
    import gc
    import weakref

    from sdxl_lora.llm import offload

    model = _base(tiny_llm).train()
    layers = offload.checkpoint_layers(model, type(model.model.layers[0]), offload=True)
    events, holders = [], []
    made, bring, get = offload._HostCopy.__init__, offload._HostCopy.bring_back, offload._HostCopy.get

    def on_made(self, x):
        made(self, x)
        holders.append(weakref.ref(self))

    def on_bring(self):
        if self.first is None and self.back is None:
            events.append(("back", index(self)))
        bring(self)

    def on_get(self):
        if self.first is None:
            events.append(("recompute", index(self), self.back is not None))
        return get(self)

    def index(holder):
        return next(i for i, r in enumerate(holders) if r() is holder)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offload._HostCopy, "__init__", on_made)
        mp.setattr(offload._HostCopy, "bring_back", on_bring)
        mp.setattr(offload._HostCopy, "get", on_get)
        for _ in range(2):  # a second step must not link back to the first one's holders
            events.clear()
            holders.clear()
            model(input_ids=IDS, labels=IDS).loss.backward()
            gc.collect()
            assert len(holders) == layers and all(r() is None for r in holders)
            recomputed = [e for e in events if e[0] == "recompute"]
            assert [e[1] for e in recomputed] == list(range(layers - 1, -1, -1))
            # Only the last layer's input is brought back when its own recomputation asks for it.
            assert [e[2] for e in recomputed] == [False] + [True] * (layers - 1)
            # Each earlier input starts back during the recomputation of the layer after it, not sooner.
            at = {e[:2]: i for i, e in enumerate(events)}
            assert all(at["recompute", k + 1] < at["back", k] < at["recompute", k] for k in range(layers - 1))


@pytest.mark.parametrize("offload", [False, True])
def test_checkpointed_decoder_layers_compile_whole(tmp_path, monkeypatch, offload):
    # train.compile with train.gradient_checkpointing: each decoder layer compiles inside its checkpoint. With
    # transformers' own checkpointing (in newer versions inside the layer's forward) dynamo gave up on the
    # layers and they ran uncompiled, while the log said "compiled". Counting what the compiler is given and
    # its graph breaks; the weights trained are those of the same run uncompiled.
    # Both runs profile a step: the compiled one without torch's allocation history, which with its Python
    # stacks made a compiled layer's forward fail on the GPU (the loop's choice; a CPU records none anyway).
    import torch._dynamo
    from safetensors.torch import load_file
    from sdxl_lora.core import loop, speed
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    graphs, histories = [], []

    class Profiler(loop.StepProfiler):
        def __init__(self, *args, allocations=True, **kw):
            histories.append(allocations)
            super().__init__(*args, allocations=allocations, **kw)

    monkeypatch.setattr(loop, "StepProfiler", Profiler)
    monkeypatch.setattr(speed, "COMPILE_BACKEND", lambda gm, inputs: graphs.append(gm) or aot_eager(gm, inputs))
    common = ["llm", "train", "--out", str(tmp_path), "--steps", "3", "--set", "llm.preview_prompts=[]",
              "--set", "train.gradient_checkpointing=true", "--set", f"llm.offload_activations={str(offload).lower()}",
              "--set", "train.profile_steps=1"]
    torch._dynamo.reset()
    counters.clear()
    assert main([*common, "--name", "compiled", "--set", "train.compile='regional'"]) == 0
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert graphs and not breaks, breaks
    assert main([*common, "--name", "eager"]) == 0
    assert histories == [False, True]
    assert all((tmp_path / n / "profile" / "trace.json").is_file() for n in ("compiled", "eager"))
    compiled, eager = (load_file(str(tmp_path / n / "adapter" / "adapter_model.safetensors"))
                       for n in ("compiled", "eager"))
    assert compiled.keys() == eager.keys()
    for k in compiled:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-3, atol=1e-5, msg=k)


def test_a_compiled_run_whose_blocks_the_compiler_gave_up_on_says_so(tmp_path, monkeypatch):
    # torch.compile falls back to running a block uncompiled, without an error, where dynamo cannot trace it
    # (as under transformers' newer checkpointing, above). Such a run now says so after its first step, with
    # dynamo's reason, and records it. The layers made untraceable here; the same run traced says nothing (and
    # its train.log gets none of the next run's lines, though both ran in this process).
    import torch._dynamo
    from sdxl_lora.core import speed
    from sdxl_lora.core.runs import read_events
    from torch._dynamo.backends.debugging import aot_eager
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    monkeypatch.setattr(speed, "COMPILE_BACKEND", lambda gm, inputs: aot_eager(gm, inputs))
    common = ["llm", "train", "--out", str(tmp_path), "--steps", "2", "--set", "llm.preview_prompts=[]",
              "--set", "train.compile='regional'"]
    torch._dynamo.reset()
    assert main([*common, "--name", "traced"]) == 0
    monkeypatch.setattr(LlamaDecoderLayer, "forward", torch._dynamo.disable(LlamaDecoderLayer.forward))
    torch._dynamo.reset()
    assert main([*common, "--name", "untraced"]) == 0
    torch._dynamo.reset()
    said = {n: (tmp_path / n / "train.log").read_text() for n in ("traced", "untraced")}
    assert "the compiler gave up on every compiled block" not in said["traced"]
    assert "the compiler gave up on every compiled block" in said["untraced"]
    failed = [e for e in read_events(tmp_path / "untraced" / "events.jsonl") if e["event"] == "compile_failed"]
    assert len(failed) == 1


def test_preview_answers_that_run_out_of_memory_come_again_without_copies_and_training_goes_on(
        tmp_path, monkeypatch, capsys):
    # The step-0 answers' allocation fails as a GPU's allocator does: they come again without the adapter merged
    # into copies (less memory), the run trains on and answers at the end as usual.
    from sdxl_lora.core.runs import read_events
    from sdxl_lora.llm import task as llm_task

    real, merged = llm_task.answer, []

    def answer(model, *a, **kw):
        from peft.tuners.tuners_utils import BaseTunerLayer

        merged.append(not any(isinstance(m, BaseTunerLayer) for m in model.modules()))  # layers out: merged
        if len(merged) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, *a, **kw)

    monkeypatch.setattr(llm_task, "answer", answer)
    assert main(["llm", "train", "--out", str(tmp_path), "--name", "r", "--steps", "2", "--set",
                 "llm.max_new_tokens=4", "--set", "train.save_every=0"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    events = read_events(tmp_path / "r" / "events.jsonl")
    told = [(e["step"], e["then"]) for e in events if e["event"] == "previews_out_of_memory"]
    assert told == [(0, "answering again without merged copies")]
    assert merged == [True, False, True]  # the failed try merged, its second try and the final answers as usual
    assert (tmp_path / "r" / "samples" / "answers-step000000.json").is_file()
    assert (tmp_path / "r" / "samples" / "answers-step000002.json").is_file() and events[-1]["event"] == "done"


def test_offloaded_activations_train_through_the_cli_and_need_checkpointing(tmp_path, capsys, caplog):
    common = ["llm", "train", "--out", str(tmp_path), "--steps", "2", "--set", "llm.preview_prompts=[]",
              "--set", "llm.offload_activations=true"]
    assert main([*common, "--name", "no-ckpt"]) == 2
    err = capsys.readouterr().err
    assert "llm.offload_activations" in err and "train.gradient_checkpointing = true" in err
    with caplog.at_level("INFO"):
        assert main([*common, "--name", "ckpt", "--set", "train.gradient_checkpointing=true"]) == 0
    assert "decoder layers checkpointed, their inputs in host memory" in caplog.text
    events = [json.loads(line) for line in (tmp_path / "ckpt" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "done" and (tmp_path / "ckpt" / "adapter").is_dir()


def test_an_llm_run_does_not_import_diffusers(tmp_path):
    # The causal LM never uses diffusers; importing it (and the compiler stack it pulls in) only to quiet its
    # progress bars cost LLM runs seconds of their launch. Its own process: the suite has diffusers imported.
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        from sdxl_lora.cli import main
        rc = main(["llm", "train", "--model", "tiny-llm", "--steps", "1", "--out", {str(tmp_path)!r}, "--name", "a",
                   "--set", "llm.preview_prompts=[]"])
        print("rc", rc, "diffusers imported:", "diffusers" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rc 0 diffusers imported: False" in done.stdout, done.stdout[-2000:]
    # Nor bitsandbytes' offline notices (peft imports it), which ask for a download a run never makes.
    assert "kernels-community" not in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "a" / "adapter" / "adapter_model.safetensors").is_file()


def test_compiled_unpacked_batches_pad_to_a_few_widths_and_train_what_uncompiled_ones_do(tmp_path, monkeypatch):
    # train.compile pads every batch to a fixed width, so the compiled decoder layers meet few shapes. Packed rows
    # are full; unpacked ones vary: each batch goes to the narrowest of llm.max_length's halvings that holds its
    # longest row, not to llm.max_length itself (short rows would run at full width). Counting the shapes the
    # compiler is given; the weights trained are those of the same run uncompiled (batches padded to their
    # longest row).
    import torch._dynamo
    from safetensors.torch import load_file
    from sdxl_lora.core import speed
    from torch._dynamo.backends.debugging import aot_eager

    data = tmp_path / "mixed.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for i in range(12):
            words = " ".join(["star"] * (2, 22, 55)[i % 3])  # rows of about 36, 96 and 195 tokens
            f.write(json.dumps({"instruction": f"Say star {i}.", "output": words}) + "\n")
    widths = []

    def backend(gm, inputs):
        widths.extend(t.shape[1] for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 3)
        return aot_eager(gm, inputs)

    monkeypatch.setattr(speed, "COMPILE_BACKEND", backend)
    common = ["llm", "train", "--out", str(tmp_path), "--data", str(data), "--steps", "6", "--batch-size", "1",
              "--set", "llm.preview_prompts=[]", "--set", "llm.packing=false", "--set", "llm.max_length=512",
              "--set", "llm.validation_split=0"]
    torch._dynamo.reset()
    assert main([*common, "--name", "compiled", "--set", "train.compile='regional'"]) == 0
    torch._dynamo.reset()
    assert set(widths) <= set(llm_data.row_widths(512)) == {64, 128, 256, 512}
    assert len(set(widths)) >= 2 and max(widths) < 512, widths
    assert main([*common, "--name", "eager"]) == 0
    compiled, eager = (load_file(str(tmp_path / n / "adapter" / "adapter_model.safetensors"))
                       for n in ("compiled", "eager"))
    assert compiled.keys() == eager.keys()
    for k in compiled:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-3, atol=1e-5, msg=k)


def test_collate_pads_to_the_narrowest_width_that_holds_the_longest_row():
    rows = [{k: torch.arange(n) for k in ("input_ids", "labels", "example", "position_ids")} for n in (5, 40)]
    batch = llm_data.collate(rows, pad_id=0, width=(32, 64, 128))
    assert batch["input_ids"].shape == (2, 64)
    assert (batch["labels"][0, 5:] == llm_data.IGNORE).all() and (batch["labels"][1, 40:] == llm_data.IGNORE).all()
    assert llm_data.collate(rows[:1], pad_id=0, width=(32, 64))["input_ids"].shape == (1, 32)
    assert llm_data.collate(rows, pad_id=0, width=(16, 32))["input_ids"].shape == (2, 40)  # none holds it: its own
    assert llm_data.collate(rows, pad_id=0)["input_ids"].shape == (2, 40)
