"""The LLM path beyond the tiny Llama: throughput in the LLM's own units (tokens/s, examples/s), the
decoder families people fine-tune (each a tiny random config built in-process), peft's adapter
initialisations, and `llm plan`'s activation estimate."""
import json

import pytest
import torch

from sdxl_lora.core.config import load_config
from sdxl_lora.core.log_window import throughput_postfix
from sdxl_lora.core.loop import Trainer
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
    # The UI's run line, read from the run folder, says the same.
    from sdxl_lora.ui.jobs import run_status
    from sdxl_lora.ui.tab_train import _progress_html

    line = _progress_html(run_status(run.dir))
    assert "tokens/s" in line and "img/s" not in line


def test_sdxl_progress_bar_still_counts_images():
    from sdxl_lora.sdxl.task import SDXLTask

    task = SDXLTask(load_config())
    units = task.units({"latent_mean": torch.zeros(3, 4, 8, 8)})
    assert units == {"images": 3}
    assert throughput_postfix({"images": 12.34}, task.unit_labels) == {"img_s": "12.3"}


# Each family's chat template in the shape of its own (turn markers, role names, where the end-of-turn
# token sits), on the tiny tokenizer: the answers must still be found as spans of the rendered text. The
# markers are plain text to this tokenizer (many tokens each), hence rows of 192 tokens.
TEMPLATES = {
    "chatml": None,  # the tokenizer's own (Qwen's ChatML)
    "llama3": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
               " + m['content'] | trim + eos_token }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
                "{% else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endif %}{% endfor %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
              "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + eos_token + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
    "phi3": ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
}
FAMILIES = {  # transformers config class, extra fields, chat template, projections per decoder layer
    "llama": ("LlamaConfig", {}, "llama3", 7),
    "mistral": ("MistralConfig", {"sliding_window": 32}, "mistral", 7),
    "qwen2": ("Qwen2Config", {}, "chatml", 7),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, "chatml", 7),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 32}, "gemma", 7),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 32}, "gemma", 7),
    "phi3": ("Phi3Config", {}, "phi3", 4),  # fused qkv_proj and gate_up_proj
    "olmo": ("OlmoConfig", {}, "chatml", 7),
    "olmo2": ("Olmo2Config", {}, "chatml", 7),
}


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from sdxl_lora.core.config import ModelConfig
    from sdxl_lora.llm.model import load_tokenizer
    from sdxl_lora.llm.tiny import materialize_tiny_llm

    return load_tokenizer(materialize_tiny_llm(ModelConfig().cache_dir))


def _family_folder(tmp_path, family: str, tokenizer, tied: bool = False):
    """A tiny random model of `family` saved as a transformers folder with the tiny tokenizer (`tied`: its
    output head sharing the input embedding's weights)."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra, _, _ = FAMILIES[family]
    config = getattr(transformers, cls)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    folder = tmp_path / (family + ("-tied" if tied else ""))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("head", ["frozen", "trained"])
def test_gemma2s_soft_capped_logits_get_transformers_loss_and_gradients_a_chunk_at_a_time(head, tmp_path,
                                                                                       tiny_tokenizer):
    # Gemma 2 soft-caps its logits (cap * tanh(logits / cap)) inside its forward. The loss takes the hidden
    # states and caps each chunk itself, so Gemma 2 trains without the full logits, with transformers' own
    # loss and gradients; the model's forward caps as before once the loss is done.
    from transformers import AutoModelForCausalLM

    from sdxl_lora.llm.loss import response_loss

    folder = _family_folder(tmp_path, "gemma2", tiny_tokenizer)
    torch.manual_seed(0)
    ids = torch.randint(3, len(tiny_tokenizer), (2, 40))
    labels = ids.clone()
    labels[:, :9] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(40)[None].repeat(2, 1)}

    def grads(ours: bool):
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").train()
        assert model.config.final_logit_softcapping
        model.lm_head.requires_grad_(head == "trained")
        if ours:
            loss = response_loss(model, model, batch, chunk=16)
        else:
            loss = model(input_ids=ids, position_ids=batch["position_ids"], labels=labels, use_cache=False).loss
        loss.backward()
        return model, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (model, loss, got), (_, want_loss, want) = grads(True), grads(False)
    assert loss == pytest.approx(float(want_loss), rel=1e-5)
    assert ("lm_head.weight" in got) == (head == "trained")
    for n, g in want.items():
        assert torch.allclose(got[n], g, rtol=1e-4, atol=1e-7), n
    with torch.no_grad():  # the forward caps its logits again
        assert model(input_ids=ids).logits.abs().max() <= model.config.final_logit_softcapping


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_decoder_family_plans_trains_exports_and_merges(family, tmp_path, tiny_tokenizer, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sdxl_lora.cli import main

    folder = _family_folder(tmp_path, family, tiny_tokenizer)
    per_layer = FAMILIES[family][3]
    # The plan covers every projection of every decoder layer, fused ones included.
    assert main(["llm", "plan", "--json", "--model", str(folder), "--set", "adapter.preset='full'"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model_type"] == AutoModelForCausalLM.from_pretrained(folder).config.model_type
    assert plan["modules"] == 2 * per_layer
    template = TEMPLATES[FAMILIES[family][2]]
    cfg = load_config(extra={"task": "llm", "model.path": str(folder), "output.runs_dir": str(tmp_path / "runs"),
                             "train.steps": 3, "train.lr": 3e-3, "adapter.preset": "full", "llm.max_length": 192,
                             "llm.merge": True, "llm.preview_prompts": ["Count from one to five."],
                             "llm.max_new_tokens": 3, **({"llm.chat_template": template} if template else {})})
    run = create_run(cfg)
    trainer = Trainer(cfg, LLMTask(cfg), run)
    trainer.setup()
    trainer.fit()
    events = read_events(run.dir / "events.jsonl")
    assert next(e for e in events if e["event"] == "dataset")["label_tokens"] > 0  # answers found in the template
    assert next(e for e in events if e["event"] == "plan")["layers"] == 2 * per_layer
    ids = torch.tensor([tiny_tokenizer.encode("Reverse the word: garden")])
    trained = trainer.task.lm.eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-4)  # the adapter changed the model
        peft_model = PeftModel.from_pretrained(base, str(run.dir / "adapter")).eval()
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
        merged = AutoModelForCausalLM.from_pretrained(run.dir / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("init,quantize", [("pissa", "none"), ("olora", "none"), ("loftq", "nf4")])
def test_adapter_inits_train_and_export_a_lora_of_the_original_base(init, quantize, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(extra={"task": "llm", "output.runs_dir": str(tmp_path), "train.steps": 3, "train.lr": 3e-3,
                             "adapter.init": init, "model.quantize": quantize, "llm.max_length": 64,
                             "llm.preview_prompts": [], "llm.merge": True})
    run = create_run(cfg)
    trainer = Trainer(cfg, LLMTask(cfg), run)
    trainer.setup()
    trainer.fit()
    ids = torch.tensor([[3, 89, 482, 203, 339, 305, 283, 275]])
    from sdxl_lora.llm.export import load_with_adapter

    with torch.no_grad():
        want = trainer.task.lm.eval()(input_ids=ids).logits
        # PiSSA/OLoRA: a LoRA of the original base, whose weights the run never kept; LoftQ: of the 4-bit
        # base, loaded quantized and dequantized again as the merge does.
        model, _ = load_with_adapter(trainer.task.model_path, run.dir / "adapter", quantize=trainer.task.quant)
        got = model.eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run.dir / "merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    torch.testing.assert_close(merged, want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("extra,named", [
    ({"adapter.init": "loftq"}, "model.quantize"),
    ({"adapter.init": "pissa", "model.quantize": "nf4"}, "model.quantize"),
    ({"adapter.init": "olora", "adapter.kind": "dora"}, "adapter.kind"),
    ({"adapter.init": "pissa", "adapter.rank_budget": 1000}, "adapter.rank_budget"),
])
def test_adapter_inits_that_do_not_combine_are_refused_naming_the_field(extra, named):
    with pytest.raises(Exception) as e:
        load_config(extra={"task": "llm", **extra})
    assert named in str(e.value) and "adapter.init" in str(e.value)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_embedding_table_in_host_memory_trains_and_answers_as_on_the_device(family, tmp_path, tiny_tokenizer,
                                                                                capsys):
    # llm.offload_embeddings: the frozen input embedding stays in host memory; each call copies its tokens'
    # rows to the model's device. The run trains the same adapter and previews the same answers as with the
    # table on the device (Gemma 3's embedding scales its rows: on the host now). The model holds no
    # embedding parameter any more, and `llm plan` counts the table out of the frozen weights. A tied head
    # needs the table where it runs: refused, saying so.
    from safetensors.torch import load_file

    from sdxl_lora.cli import main

    folder = _family_folder(tmp_path, family, tiny_tokenizer)
    cfg = {"task": "llm", "model.path": str(folder), "output.runs_dir": str(tmp_path / "runs"), "train.steps": 3,
           "train.lr": 3e-3, "llm.max_length": 96, "llm.preview_prompts": ["Count from one to five."],
           "llm.max_new_tokens": 6}
    runs = {}
    for name, host in (("device", False), ("host", True)):
        c = load_config(extra={**cfg, "output.name": name, "llm.offload_embeddings": host})
        trainer = Trainer(c, LLMTask(c), create_run(c))
        trainer.setup()
        params = dict(trainer.task.lm.named_parameters())
        assert any("embed_tokens" in n for n in params) != host
        trainer.fit()
        runs[name] = trainer.run.dir
    adapters = [load_file(str(runs[n] / "adapter" / "adapter_model.safetensors")) for n in ("device", "host")]
    assert adapters[0].keys() == adapters[1].keys()
    for k in adapters[0]:
        assert torch.equal(adapters[0][k], adapters[1][k]), k
    answers = [sorted(p.read_text() for p in (runs[n] / "samples").glob("answers-*.txt")) for n in ("device", "host")]
    assert answers[0] and answers[0] == answers[1]

    plan = ["llm", "plan", "--json", "--model", str(folder)]
    assert main(plan) == 0
    on_device = json.loads(capsys.readouterr().out)
    assert main([*plan, "--set", "llm.offload_embeddings=true"]) == 0
    on_host = json.loads(capsys.readouterr().out)
    table = len(tiny_tokenizer) * 64 * 2 / 2**30  # vocabulary x hidden, bf16 (a GPU run's weights)
    assert on_host["host_embedding_gib"] == pytest.approx(table, abs=1e-3)
    assert sum(on_device["weights_gib"].values()) - sum(on_host["weights_gib"].values()) == pytest.approx(table, abs=2e-3)

    tied = _family_folder(tmp_path, family, tiny_tokenizer, tied=True)
    assert main(["llm", "train", "--model", str(tied), "--out", str(tmp_path / "runs"), "--name", "tied", "--steps",
                 "1", "--set", "llm.offload_embeddings=true", "--set", "llm.preview_prompts=[]"]) == 2
    assert "shares its weights with the input embedding" in capsys.readouterr().err
