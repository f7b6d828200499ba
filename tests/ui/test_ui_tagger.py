"""The Dataset tab's tagger thresholds: the two boxes under "Caption with a local model" decide which tags a
WD14-style tagger writes, as `sdxl-lora dataset tag --general-threshold --character-threshold` do, and a bad value
is refused naming the box."""
from __future__ import annotations

import shutil

import pytest

from test_peers import images, tagger  # noqa: F401  (the tiny WD14-shaped tagger, a pytest fixture)


def test_the_tagger_thresholds_on_the_page_decide_the_tags_written(tmp_path, tagger):  # noqa: F811
    from sdxl_lora.ui import dataset_edit as edit
    from sdxl_lora.ui.folders import Folders

    (tmp_path / "datasets").mkdir()
    data = images(tmp_path / "datasets" / "d")
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    shutil.copytree(tagger, f.models / "taggers" / "wd14")
    # The boxes as first shown are the tagger's defaults: the half-sure character (0.60) is left out.
    msg = edit.caption(f, "d", "taggers/wd14", ".txt", False, "sks", None, 0.35, 0.85)
    assert msg.startswith("captions written: 3")
    assert (data / "dim.txt").read_text() == "sks, ^_^, long hair\n"
    # A stricter general box and a looser character box, as the CLI's flags give the same captions.
    edit.caption(f, "d", "taggers/wd14", ".txt", True, "", None, 0.9, 0.5)
    caption = {p.stem: p.read_text() for p in data.glob("*.txt")}
    assert caption == {"red": "red hair, ^_^\n", "green": "hatsune miku, ^_^\n", "dim": "hatsune miku, ^_^\n",
                       "kept": "red hair, ^_^\n"}
    before = {p: p.read_text() for p in data.glob("*.txt")}
    for general, character, label in ((35, 0.85, edit.GENERAL_LABEL), (0.35, 0, edit.CHARACTER_LABEL)):
        with pytest.raises(ValueError, match=f"'{label}' is {general if label == edit.GENERAL_LABEL else 0:g}: give "
                                             "a probability above 0 and at most 1"):
            edit.caption(f, "d", "taggers/wd14", ".txt", True, "", None, general, character)
    assert {p: p.read_text() for p in data.glob("*.txt")} == before  # nothing written
