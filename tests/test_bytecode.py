"""The launch's warning for a Python that compiles the heavy packages' sources on every launch; the libraries'
one map of the installed packages."""
import importlib.metadata
import subprocess
import sys

from sdxl_lora import training
from sdxl_lora.core.bytecode import advice

PROBE = ("import sdxl_lora.core.allocator; from sdxl_lora.core.bytecode import compiled_from_source; "
         "print(compiled_from_source(('sdxl_lora.core.allocator', 'not_imported_anywhere')))")


def _probe(tmp_path, *flags, env_extra=None):
    env = {"PYTHONPYCACHEPREFIX": str(tmp_path / "pyc"), "PATH": "/usr/bin:/bin", **(env_extra or {})}
    done = subprocess.run([sys.executable, *flags, "-c", PROBE], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_imports_without_byte_code_to_read_or_write_are_named_and_the_fix_given(tmp_path):
    # Byte-code writing off and none to read (an empty byte-code folder): the module was compiled from source.
    assert _probe(tmp_path, "-B") == "['sdxl_lora.core.allocator']"
    assert _probe(tmp_path, env_extra={"PYTHONDONTWRITEBYTECODE": "1"}) == "['sdxl_lora.core.allocator']"
    # Writing allowed: nothing to report, and the byte-code it wrote is read afterwards even with writing off.
    assert _probe(tmp_path) == "[]"
    assert _probe(tmp_path, "-B") == "[]"
    text = advice(["torch", "diffusers"])
    assert text.startswith("torch, diffusers imported from source") and "PYTHONPYCACHEPREFIX" in text


def test_the_libraries_importing_share_one_read_of_the_installed_packages(monkeypatch):
    reads = []

    def packages_distributions():  # stands for the standard library's, which reads every installed package
        reads.append(1)
        return {"PIL": ["pillow"]}

    monkeypatch.setattr(importlib.metadata, "packages_distributions", packages_distributions)
    training.stay_offline()  # where a front end starts, before transformers and diffusers are imported
    first = importlib.metadata.packages_distributions()
    first["PIL"].append("changed by its caller")
    assert importlib.metadata.packages_distributions() == {"PIL": ["pillow"]}
    assert len(reads) == 1
