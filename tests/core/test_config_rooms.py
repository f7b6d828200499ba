"""Each task's settings live with the task (sdxl_lora/sdxl/config.py, sdxl_lora/llm/config.py) over the core's
sections; the TOML keys and the run folders written before the split keep working."""
import shutil
from pathlib import Path

from sdxl_lora.core.runs import read_events

FIXTURES = Path(__file__).parent / "fixtures"


def test_a_run_folder_written_before_the_split_resumes_through_the_cli(tmp_path, cli, cache_args):
    # Killed before step 3 of 4 with a state at step 2 (fixtures/sdxl_run_before_issue71/README.md): the
    # resume trains steps 3 and 4 and writes the adapter.
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.config import SDXLConfig

    run = tmp_path / "old_run"
    shutil.copytree(FIXTURES / "sdxl_run_before_issue71", run)
    cfg = load_config(run / "config.toml")  # every key of its day is one of SDXL's or the core's
    assert isinstance(cfg, SDXLConfig) and (cfg.adapter.rank, cfg.train.steps, cfg.train.fuse_qkv) == (1, 4, True)
    p = cli("train", "--resume", str(run), *cache_args)
    assert p.returncode == 0, p.stderr[-3000:]
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [2]
    resumed = events[[e["event"] for e in events].index("resume"):]
    assert [e["step"] for e in resumed if e["event"] == "step"] == [3, 4]
    assert events[-1]["event"] == "done" and events[-1]["step"] == 4
    assert (run / "old_run.safetensors").is_file()


def test_config_files_saved_before_the_split_load_as_their_tasks_config():
    # Each task's config.toml as the one schema wrote it (fixtures/*_config_before_issue71.toml): every key is
    # the task's own or the core's, so it loads as before, into the task's config class.
    from sdxl_lora.core.config import load_config
    from sdxl_lora.llm.config import CausalLMConfig
    from sdxl_lora.sdxl.config import SDXLConfig

    llm = load_config(FIXTURES / "llm_config_before_issue71.toml")
    assert isinstance(llm, CausalLMConfig) and (llm.adapter.init, llm.llm.max_length, llm.model.path) == \
        ("pissa", 64, "tiny-llm")
    sdxl = load_config(FIXTURES / "sdxl_config_before_issue71.toml")
    assert isinstance(sdxl, SDXLConfig) and (sdxl.card, sdxl.train.fuse_qkv, sdxl.train.vram_gb) == ("8gb", False, 8.0)


def test_each_task_trains_its_own_embedded_model_where_the_config_names_none():
    # The core names no task's model: an SDXL config without model.path (or with it empty) trains the shipped
    # demo base, an LLM config the tiny Llama.
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.config import DEMO_DIR, DEMO_NAME

    assert load_config().model.path == DEMO_NAME and (DEMO_DIR / "model_index.json").is_file()
    assert load_config(extra={"model.path": ""}).model.path == DEMO_NAME
    assert load_config(extra={"task": "llm"}).model.path == "tiny-llm"
    assert load_config(extra={"task": "llm", "model.path": ""}).model.path == "tiny-llm"
