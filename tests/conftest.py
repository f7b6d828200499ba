import contextlib
import os
import signal
import subprocess
import sys

import pytest

# Tests never reach a hub, like the product.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# Under pytest-xdist (`-n 2`, pyproject's addopts) each worker is one process per core: one thread each
# (and in the training processes tests start), or the workers' thread pools fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# The files whose tests take longest start first, longest first: pytest-xdist (--dist loadfile, with
# --no-loadscope-reorder in pyproject's addopts, or it sorts the files by their number of tests) hands out
# whole files in collection order, and a long file handed out last keeps one worker busy while the other has
# nothing left.
FIRST = ("test_train.py", "test_speed.py", "test_ui.py", "test_adapter_kinds.py", "test_multiprocess.py",
         "test_durability.py", "test_frontends.py", "test_compare_kinds.py", "test_qlora.py",
         "test_plans_roundtrip.py", "test_ui_standby.py", "test_demo_base.py", "test_cache_reuse.py", "test_export.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_dir():
    """The embedded tiny SDXL as a diffusers folder (built once, in the repo's model cache)."""
    from sdxl_lora.core.config import ModelConfig
    from sdxl_lora.sdxl.demo.tiny import materialize_tiny

    return materialize_tiny(ModelConfig().cache_dir)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One latent and text-embedding cache for a module's runs (data.cache_dir): the sample images are encoded
    once, not in each test's runs folder; what a run trains and saves is the same either way."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def cache_args(shared_cache):
    """shared_cache as the CLI's arguments."""
    return ["--set", f"data.cache_dir='{shared_cache}'"]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: the tiny models gain nothing from a second, and when the other
    core is busy its spin-waits make each UNet call up to 100x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextlib.contextmanager
def _as_process(kill: str | None = None):
    """For a front end's main() called in this process, what its own process would have: one torch thread
    (the training subprocesses' OMP_NUM_THREADS=1; bit-exact comparisons between runs need the same count),
    log lines on stderr as training.setup_logging formats them (pytest's log handlers make its basicConfig a
    no-op), and `kill` as SDXL_LORA_TEST_KILL (core/checkpoint.py: test_fault). Undone after, the log
    files the run attached included; the signal handlers must be pytest's again."""
    import logging

    import torch

    from sdxl_lora.core import checkpoint

    # SIGKILL (a fault point without "@SIGNAL") cannot be caught: it needs a process of its own.
    assert kill is None or "@" in kill, kill
    root = logging.getLogger()
    handlers, level, threads, kill_at = list(root.handlers), root.level, torch.get_num_threads(), checkpoint._KILL_AT
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(stderr)
    root.setLevel(logging.INFO)
    torch.set_num_threads(1)
    checkpoint._KILL_AT = kill
    try:
        yield
    finally:
        checkpoint._KILL_AT = kill_at
        torch.set_num_threads(threads)
        root.setLevel(level)
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
            h.close()
    assert {s: signal.getsignal(s) for s in signals} == signals  # the trainer put the handlers back


@pytest.fixture(scope="session")
def as_process():
    """`with as_process(kill=None): main([...])`: see _as_process."""
    return _as_process


@pytest.fixture
def cli(capsys):
    """cli(*ARGV, kill=None, main=sdxl_lora.cli.main): `sdxl-lora ARGV` run in this process instead of its
    own (which spends seconds importing torch and diffusers), as a CompletedProcess: the exit code and
    what it printed on stdout and stderr, its log lines included."""
    def run(*argv: str, kill: str | None = None, main=None) -> subprocess.CompletedProcess:
        if main is None:
            from sdxl_lora.cli import main
        capsys.readouterr()  # what came before is not this run's
        with _as_process(kill):
            rc = main(list(argv))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([main.__module__, *argv], rc, out, err)
    return run
