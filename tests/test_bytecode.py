"""The libraries' one map of the installed packages."""
import importlib.metadata

from sdxl_lora import training


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
