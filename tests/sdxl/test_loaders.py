"""Which tools load each adapter kind (sdxl/formats/loaders.py): the docs' table is the code's, and the line per kind that
the end of a run, `inspect`, `export` and the UI's Export tab print is the table's for that file; LoHa/LoKr files
are written with alpha = rank, so LyCORIS' merge applies the trained update too; the facts a line depends on are
read from the file as the tools read it.

Two more loaders' rules are reproduced here from their public source (not copied), as test_adapter_kinds.py does
for ComfyUI's and LyCORIS' generation path:
  LyCORIS   KohakuBlueleaf/LyCORIS lycoris/modules/loha.py, lokr.py @f49d30d670591ec8841d241d79aaa8449b30a715:
            get_weight already scales by alpha / rank (gamma=scale) and get_diff_weight, which merge_to runs,
            scales again; for LoKr only where lokr_w2 is split.
  InvokeAI  invoke-ai/InvokeAI invokeai/backend/model_manager/util/model_util.py (lora_token_vector_length)
            @8e71a8a519399d6db32054ae9afc7c6c4e2355af: the first UNet cross-attention to_k/to_v key (or a LoRA's
            time_emb_proj down) it reads an input width from decides the base; a LoKr layer gives one only when
            lokr_w1 and lokr_w2 are both whole (its lookups of the split names lack the dot).
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdxl_lora.sdxl.formats import export, loaders
from test_adapter_kinds import KINDS, _key, _loader_weight, _trained, _training_deltas, _unet

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def test_the_docs_table_is_the_codes_and_cites_the_versions_it_was_read_from():
    text = DOCS.read_text(encoding="utf-8")
    table = loaders.docs_table()
    assert table in text, ("docs/export.md's table of the kinds in each tool differs from sdxl/formats/loaders.py's; "
                           "paste `python -m sdxl_lora.sdxl.formats.loaders` over it:\n" + table)
    header = table.splitlines()[0]
    for tool in loaders.TOOLS:
        assert (tool.version and f"{tool.name} {tool.version}" in header) or (tool.source and tool.source in table)
    cited = set(header.strip("| ").split(" | "))
    assert {"AUTOMATIC1111 1.10.1", "LyCORIS 4.1.3", "InvokeAI 6.14.2", "diffusers 0.42.1"} <= cited
    # Every kind and tool has a cell; every condition names a fact a file's header gives.
    facts = set(loaders.FileFacts.__dataclass_fields__) - {"kinds"}
    for kind in loaders.KINDS:
        assert set(loaders.TABLE[kind]) == {t.name for t in loaders.TOOLS}
        for c in loaders.TABLE[kind].values():
            assert c.status in loaders.STATUSES and (not c.when or (c.when in facts and c.then is not None))
    # The example line on the page is the code's line for a DoRA file.
    assert f"tools      : {loaders.note('dora')}\n" in text


def _said(line: str) -> dict[str, str]:
    """tool -> the status a line puts it under, read back from its wording: each phrase (up to a ';' outside
    parentheses) starts with its status's words and names its tools outside parentheses."""
    said, depth, outside = {}, 0, ""
    for ch in line.split(": ", 1)[1] + ";":
        if ch == ";" and depth == 0:
            status = next(s for s in loaders.STATUSES
                          if outside.strip().startswith(loaders.PHRASES[s].split("{tools}")[0]))
            said.update({t.name: status for t in loaders.TOOLS if t.name in outside})
            outside = ""
            continue
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch != ")":
            outside += ch
    return said


def _run(tmp_path, tiny_dir, kind):
    """A run folder (its config names the tiny model) holding the kohya file of a trained `kind` adapter, the
    UNet it came from."""
    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.runs import create_run

    unet, _ = _trained(tiny_dir, kind)
    cfg = load_config(extra={"output.runs_dir": str(tmp_path / "runs"), "output.name": "r",
                             "model.path": str(tiny_dir)})
    run = create_run(cfg)
    export.save_kohya_lora(unet, run.dir / "r.safetensors")
    return cfg, run, unet


@pytest.mark.parametrize("kind", KINDS)
def test_each_kinds_line_at_the_end_of_a_run_in_inspect_export_and_the_ui_is_the_tables(tiny_dir, tmp_path, kind,
                                                                                          capsys):
    """A run's kohya file of each kind: the table's line for the kind (each tool under its cell's status) is
    printed once at the end of the run, by `inspect`, by `export` and in the UI's Export tab; a diffusers-format
    file, which the table does not cover, gets the line for its format."""
    from sdxl_lora import training
    from sdxl_lora.cli import main
    from sdxl_lora.core.loop import Result
    from sdxl_lora.ui import tab_export
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.text import md_text

    cfg, run, unet = _run(tmp_path, tiny_dir, kind)
    path = run.dir / "r.safetensors"
    facts = loaders.file_facts(path)
    # This project's file: alpha = rank in every LoHa/LoKr layer, and cross-attention k/v InvokeAI reads.
    assert facts == loaders.FileFacts((kind,))
    line = loaders.note(kind)
    assert _said(line) == {t.name: loaders.TABLE[kind][t.name].status for t in loaders.TOOLS}
    want = f"tools      : {line}"

    lines = training.report(training.Outcome(training.Job(cfg, run), Result(run, 3, {"kohya": path}), True))
    assert lines.count(want) == 1 and sum(x.startswith("tools") for x in lines) == 1, lines
    assert main(["inspect", str(path)]) == 0  # the run's model, from its folder
    assert capsys.readouterr().out.splitlines().count(want) == 1
    assert main(["export", str(run.dir), "--format", "kohya", "--out", str(tmp_path / "x.safetensors")]) == 0
    assert capsys.readouterr().out.splitlines().count(want) == 1
    (tmp_path / "datasets").mkdir()
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    written, msg = tab_export.export(f, "runs/r", "kohya", "ui", "", "", "", "", True, "sgm", False, False)
    assert written and msg.count(md_text(line)) == 1, msg
    if kind in ("lora", "dora"):
        other = export.save_diffusers_lora(unet, tmp_path / "d.diffusers.safetensors")
        assert main(["inspect", str(other), "--model", str(tiny_dir)]) == 0
        said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tools")]
        assert said == [f"tools      : {export.OTHER_FORMAT_TOOLS}"]


def _rank(parts) -> int | None:
    """The rank LyCORIS scales a layer by: a LoHa's, a LoKr's split lokr_w2's; None where it scales by 1."""
    for key in ("hada_w1_b", "lokr_w2_b"):
        if key in parts:
            return parts[key].shape[0]
    return None


def _lycoris_merge_weight(kind, parts, w):
    """LyCORIS' merge_to: the generation path's update (`_loader_weight`) times alpha / rank once more."""
    once = _loader_weight(kind, parts, w) - w
    rank = _rank(parts)
    return w + once * (parts["alpha"].item() / rank if rank and "alpha" in parts else 1.0)


def _file_deltas(path, base, rule) -> dict[str, torch.Tensor]:
    """Each file layer's weight change by a loader's `rule` on the tiny base, keyed as `_training_deltas`."""
    from sdxl_lora.sdxl.formats.single_file import _unet_sgm

    sgm = {k.removeprefix("model.diffusion_model.").removesuffix(".weight"): v
           for k, v in _unet_sgm(base).items() if k.endswith(".weight")}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in load_file(path).items():
        name, suffix = k.split(".", 1)
        layers.setdefault(name, {})[suffix] = v.float()
    by_name = {"lora_unet_" + k.replace(".", "_"): k for k in sgm}
    out = {}
    for name, parts in layers.items():
        w = sgm[by_name[name]].float()
        kind = "loha" if "hada_w1_a" in parts else "lokr"
        out[_key(w)] = rule(kind, parts, w) - w
    return out


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_merge_applies_the_trained_update_and_a_file_with_other_alphas_is_named_and_rewritten(
        tiny_dir, tmp_path, kind, capsys):
    """LoHa/LoKr files carry alpha = rank with the training alpha / rank (here 3 / 4) folded into the factors:
    every loader's rule, LyCORIS' merge included, gives peft's weights. A file with the same update but the
    training alpha (as other tools write it) merges wrong in LyCORIS; its line says so, and `export` rewrites
    it with alpha = rank."""
    from sdxl_lora.cli import main

    unet, _ = _trained(tiny_dir, kind)
    want = _training_deltas(unet)
    base = _unet(tiny_dir)
    ours = export.save_kohya_lora(unet, tmp_path / "ours.safetensors")
    sd = load_file(ours)
    split = [k.rsplit(".", 1)[0] for k in sd if k.endswith((".hada_w1_b", ".lokr_w2_b"))]
    assert split and all(sd[f"{n}.alpha"].item() == _rank({k.rsplit(".", 1)[1]: sd[k] for k in sd
                                                           if k.startswith(n + ".")}) for n in split)
    _assert_same(_file_deltas(ours, base, _loader_weight), want)
    _assert_same(_file_deltas(ours, base, _lycoris_merge_weight), want)

    # The same update with the training alpha, 3, in the layers LyCORIS scales.
    foreign = dict(sd)
    for n in split:
        rank = foreign[f"{n}.alpha"].item()
        foreign[f"{n}.alpha"] = torch.tensor(3.0)
        if kind == "loha":
            for k in ("hada_w1_a", "hada_w2_a"):
                foreign[f"{n}.{k}"] = sd[f"{n}.{k}"] * (rank / 3.0) ** 0.5
        else:
            foreign[f"{n}.lokr_w1"] = sd[f"{n}.lokr_w1"] * (rank / 3.0)
    save_file(foreign, str(tmp_path / "foreign.safetensors"))
    _assert_same(_file_deltas(tmp_path / "foreign.safetensors", base, _loader_weight), want)
    merged = _file_deltas(tmp_path / "foreign.safetensors", base, _lycoris_merge_weight)
    assert sum(not torch.allclose(merged[k], want[k], rtol=1e-4, atol=1e-6) for k in want) == len(split)
    facts = loaders.file_facts(tmp_path / "foreign.safetensors")
    assert facts == loaders.FileFacts((kind,), merged_twice=len(split))
    line = loaders.note(kind, facts)
    assert _said(line)["LyCORIS"] == loaders.MERGE and "sdxl-lora export rewrites it with alpha = rank" in line
    assert main(["inspect", str(tmp_path / "foreign.safetensors"), "--model", str(tiny_dir)]) == 0
    assert f"tools      : {line}" in capsys.readouterr().out.splitlines()

    assert main(["export", str(tmp_path / "foreign.safetensors"), "--format", "kohya", "--model", str(tiny_dir),
                 "--out", str(tmp_path / "rewritten.safetensors")]) == 0
    assert f"tools      : {loaders.note(kind)}" in capsys.readouterr().out.splitlines()
    assert loaders.file_facts(tmp_path / "rewritten.safetensors") == loaders.FileFacts((kind,))
    _assert_same(_file_deltas(tmp_path / "rewritten.safetensors", base, _lycoris_merge_weight), want)
    # --true-alpha keeps LoRA's training alphas; a LoHa/LoKr file is written with alpha = rank all the same.
    assert main(["export", str(ours), "--format", "kohya", "--model", str(tiny_dir), "--true-alpha",
                 "--out", str(tmp_path / "true.safetensors")]) == 0
    assert loaders.file_facts(tmp_path / "true.safetensors") == loaders.FileFacts((kind,))


def _invokeai_base(path) -> str | None:
    """InvokeAI's probe (the rule cited above) on a file, for the parts this project's files hold: the base it
    finds ("sdxl", "sd1", "sd2") or None, which it refuses as "Unknown"."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        shapes = {k: fh.get_slice(k).get_shape() for k in fh.keys()}

    def width(key):
        name, part = key.split(".", 1)
        if part in ("lora_down.weight", "hada_w1_b", "hada_w2_b"):
            return shapes[key][1]
        if "lokr_" in part and f"{name}.lokr_w1" in shapes and f"{name}.lokr_w2" in shapes:
            return shapes[f"{name}.lokr_w1"][1] * shapes[f"{name}.lokr_w2"][1]
        return None

    found, te = None, {"lora_te1_": None, "lora_te2_": None}
    for key in shapes:  # the file's order, sorted by name
        if key.startswith("lora_unet_") and ("_attn2_to_k." in key or "_attn2_to_v." in key
                                             or "time_emb_proj.lora_down" in key):
            found = width(key)
        elif key.startswith(tuple(te)) and "_self_attn_" in key:
            te[key[:len("lora_te1_")]] = width(key)
        if None not in te.values():
            found = sum(te.values())
        if found is not None:
            break
    return {768: "sd1", 1024: "sd2", 1280: "sdxl", 2048: "sdxl"}.get(found)


@pytest.mark.parametrize("kind, settings, refused", [
    ("lokr", {"preset": "cross-attn", "rank": 16}, True),  # every cross-attention k/v splits lokr_w2
    ("lokr", {"preset": "cross-attn", "rank": 16, "overrides": {"*.attn2.to_v": 32}}, False),
    ("lokr", {"preset": "topology", "rank": 16}, True),  # the default plan
    ("lokr", {"preset": "topology", "rank": 32}, False),  # the deepest level's to_v at 32 keeps lokr_w2 whole
    ("loha", {"preset": "cross-attn", "rank": 8}, False),
    ("lora", {"preset": "attn", "rank": 4, "overrides": {"*.attn2.*": 0}}, True),  # self-attention only
])
def test_invokeais_probe_on_sdxl_base_is_what_the_line_says(tmp_path, kind, settings, refused):
    """On SDXL base's real UNet (meta device; the file holds zeros of the right shapes): the file the line says
    InvokeAI refuses is the one its probe finds no base model in, and the overrides the line suggests for
    LoKr make it find SDXL."""
    from diffusers import UNet2DConditionModel

    from sdxl_lora.core import inject
    from sdxl_lora.sdxl.config import AdapterConfig
    from sdxl_lora.sdxl import slots as unet_slots
    from sdxl_lora.sdxl.formats.single_file import unet_config

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config())
        inject.apply_plan(unet, unet_slots.make_plan(unet, AdapterConfig(kind=kind, **settings)))
    sd = export.kohya_state_dict(export.adapter_from_model(unet), unet.config)
    path = tmp_path / "a.safetensors"
    save_file({k: torch.zeros(v.shape) if v.is_meta else v for k, v in sd.items()}, str(path))
    assert _invokeai_base(path) == (None if refused else "sdxl")
    facts = loaders.file_facts(path)
    assert facts == loaders.FileFacts((kind,), no_invokeai_base=refused)
    line = loaders.note(kind, facts)
    assert _said(line)["InvokeAI"] == (loaders.REFUSED if refused else loaders.TABLE[kind]["InvokeAI"].status)
    assert ("Unsupported LoRA base model: Unknown" in line) == refused
