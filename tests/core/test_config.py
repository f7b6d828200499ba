"""The config schema: defaults that work, TOML + --set overrides, errors that name the field."""
import pytest

from sdxl_lora.core.config import Config, ConfigError, load_config


def test_defaults_are_valid_and_roundtrip_through_toml(tmp_path):
    cfg = load_config()
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


def test_set_overrides_parse_toml_literals(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 10\nlr = 0.5\n")
    cfg = load_config(path, ["train.lr=1e-4", "data.flip=true", "output.name=my run", "data.dirs=['a', 'b']"])
    assert cfg.train.steps == 10
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.data.flip is True
    assert cfg.output.name == "my run"
    assert cfg.data.dirs == ["a", "b"]


def test_a_config_written_before_settings_were_removed_loads_with_a_warning_for_each(tmp_path, caplog):
    # A run folder's config.toml names every field of its day: it must load (and resume) after a lever is gone.
    path = tmp_path / "config.toml"
    path.write_text("[train]\nsteps = 7\nreuse_conv_search = true\nbackground_compile = true\n"
                    "graphs_while_compiling = false\nlora_matmul = 'concat'\n")
    with caplog.at_level("WARNING"):
        cfg = load_config(path)
    assert cfg.train.steps == 7 and cfg.train.lora_matmul == "merged"
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert sorted(m.split(" ", 1)[0] for m in gone) == ["train.background_compile", "train.graphs_while_compiling",
                                                        "train.lora_matmul='concat'", "train.reuse_conv_search"]
    assert not any(k in cfg.to_toml() for k in ("reuse_conv_search", "background_compile", "graphs_while_compiling"))
    with pytest.raises(ConfigError, match="lora_matmul"):  # typed today, it is no choice
        load_config(overrides=["train.lora_matmul=fused"])


def test_bad_choice_names_field_value_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["train.mixed_precision=fp8"])
    msg = str(e.value)
    assert "train.mixed_precision" in msg and "'fp8'" in msg
    for allowed in ("'no'", "'fp16'", "'bf16'"):
        assert allowed in msg


def test_unknown_field_lists_allowed_fields(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlearning_rate = 1e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "train.learning_rate" in msg and "lr" in msg and str(path) in msg


def test_out_of_range_number_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["adapter.rank=0"])
    assert "adapter.rank" in str(e.value) and "0" in str(e.value)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_a_key_set_twice_is_named_with_its_line_and_a_byte_order_mark_is_accepted(tmp_path, cli):
    twice = tmp_path / "twice.toml"
    twice.write_text("[train]\nsteps = 10\nlr = 1e-4\n\n[data]\nresolution = 64\n\n[train . 'x']\n\n[train]\n",
                     encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(twice)
    assert str(twice) in str(e.value) and "table [train] is declared twice (the second time at line 10)" in str(e.value)
    twice.write_text("[data]\nresolution = 64\n[train]\nsteps = 10\nlr = 1e-4\n  steps = 20  # more\n",
                     encoding="utf-8")
    p = cli("plan", str(twice))  # as a user sees it: one paragraph, exit 2
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"config file {twice} is not valid TOML: train.steps is set twice (the second time at line 6)" in p.stderr
    # Saved as "UTF-8 with BOM" (Notepad, PowerShell's Out-File): the same config.
    bom = tmp_path / "bom.toml"
    bom.write_bytes("\ufeff[train]\nsteps = 7\n".encode("utf-8"))
    assert load_config(bom).train.steps == 7


def test_set_needs_key_value():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["train.lr"])
    assert isinstance(load_config(), Config)


def test_a_model_folder_recommends_settings_that_apply_where_the_config_is_silent(tmp_path):
    model = tmp_path / "base"
    model.mkdir()
    (model / "sdxl_lora.toml").write_text('[train]\nlr = 5e-4\nsteps = 123\n[adapter]\noverrides = {"x" = 4}\n')
    cfg = load_config(overrides=[f"model.path='{model}'", "train.steps=7", 'adapter.overrides={"y"=2}'])
    assert cfg.train.lr == pytest.approx(5e-4)        # recommended: the user said nothing
    assert cfg.train.steps == 7                        # the user's value wins
    assert cfg.adapter.overrides == {"y": 2}           # a table field wins whole, not merged key by key
    assert load_config(overrides=[f"model.path='{tmp_path}'"]).train.lr == Config().train.lr  # no file: defaults
    # A timestep range is the user's whole: the base's recommended lower bound gives way to a user's upper one.
    (model / "sdxl_lora.toml").write_text("[train]\ntimestep_min = 400\n")
    assert load_config(overrides=[f"model.path='{model}'"]).train.timestep_min == 400
    ranged = load_config(overrides=[f"model.path='{model}'", "train.timestep_max=300"]).train
    assert (ranged.timestep_min, ranged.timestep_max) == (0, 300)
    # Settings for one adapter kind apply to runs of that kind only, and the user's still win.
    (model / "sdxl_lora.toml").write_text("[train]\nlr = 1e-3\n[kind.lokr.train]\nlr = 1e-2\nsteps = 9\n")
    assert load_config(overrides=[f"model.path='{model}'"]).train.lr == pytest.approx(1e-3)
    lokr = load_config(overrides=[f"model.path='{model}'", "adapter.kind='lokr'", "train.steps=5"]).train
    assert (lokr.lr, lokr.steps) == (pytest.approx(1e-2), 5)
    (model / "sdxl_lora.toml").write_text("[kind.lycoris.train]\nlr = 1e-2\n")
    with pytest.raises(ConfigError, match=r"\[kind.lycoris\] must name an adapter kind \(lora, dora, loha, lokr\)"):
        load_config(overrides=[f"model.path='{model}'"])
    (model / "sdxl_lora.toml").write_text("[model]\npath = 'elsewhere'\n")
    with pytest.raises(ConfigError, match=r"sdxl_lora.toml.*\[data\], \[adapter\], \[train\], \[preview\]"):
        load_config(overrides=[f"model.path='{model}'"])
    (model / "sdxl_lora.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="sdxl_lora.toml.*not valid TOML"):
        load_config(overrides=[f"model.path='{model}'"])


def test_the_previews_are_scored_for_a_concept_only_where_the_model_asks():
    # The shapes detector knows the demo base's shapes: the demo base asks for the star (its sdxl_lora.toml),
    # any other model scores nothing unless the config names a concept.
    assert load_config().preview.concept == "star"
    assert load_config(extra={"model.path": "tiny-sdxl"}).preview.concept is None
    assert load_config(overrides=["preview.concept=''"]).preview.concept == ""


def test_a_setting_of_the_other_task_is_refused_naming_the_key_the_file_and_what_to_do(tmp_path):
    # Each task's config holds only its own fields (sdxl/config.py, llm/config.py): one the task would ignore is
    # refused where it is read, not trained past.
    llm = tmp_path / "llm.toml"
    llm.write_text("task = 'llm'\n[train]\nsteps = 3\nfuse_qkv = true\ncompile = 'regional'\n")
    with pytest.raises(ConfigError) as err:
        load_config(llm)
    assert f"train.fuse_qkv = True: a setting of task='sdxl', which does nothing for task='llm': remove it from " \
           f"{llm}" in str(err.value)
    assert err.value.problems[0]["loc"] == ("train", "fuse_qkv")
    with pytest.raises(ConfigError, match=r"llm.max_length = 64: a setting of task='llm'.*remove it from the "
                                          r"settings given"):
        load_config(overrides=["llm.max_length=64", "data.flip=true"])
    with pytest.raises(ConfigError, match=r"card = '8gb': a setting of task='sdxl'"):
        load_config(extra={"task": "llm", "card": "8gb"})
    # The shared fields (train.compile, preview.every) are every task's; an unknown one is still named as such.
    assert load_config(overrides=["task='llm'", "train.compile='regional'", "preview.every=5"]).train.compile == \
        "regional"
    with pytest.raises(ConfigError, match="train.fuse_qvk = True: unknown field; allowed here: steps"):
        load_config(overrides=["train.fuse_qvk=true"])


def test_each_task_loads_its_own_config_class_and_a_saved_config_loads_back_the_same(tmp_path):
    from sdxl_lora.core.config import config_class
    from sdxl_lora.llm.config import CausalLMConfig
    from sdxl_lora.sdxl.config import SDXLConfig

    assert config_class("sdxl") is SDXLConfig and config_class("llm") is CausalLMConfig
    llm = load_config(overrides=["task='llm'", "train.steps=7", "llm.max_length=64"])
    sdxl = load_config(overrides=["train.channels_last=true", "train.steps=7"])
    assert isinstance(llm, CausalLMConfig) and isinstance(sdxl, SDXLConfig)
    (tmp_path / "llm.toml").write_text(llm.to_toml())
    (tmp_path / "sdxl.toml").write_text(sdxl.to_toml())
    llm2, sdxl2 = load_config(tmp_path / "llm.toml"), load_config(tmp_path / "sdxl.toml")
    assert "[data]" not in (tmp_path / "llm.toml").read_text() and "[llm]" not in (tmp_path / "sdxl.toml").read_text()
    assert llm2 == llm and sdxl2 == sdxl
    assert (llm2.train.steps, llm2.llm.max_length, llm2.task) == (7, 64, "llm") and sdxl2.train.channels_last is True


def test_every_field_has_a_short_description_for_users():
    import re

    from pydantic import BaseModel

    def leaves(model, prefix=""):
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                yield from leaves(f.annotation, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", f.description or ""

    from sdxl_lora.core.config import TASKS, config_class

    lab_notes = re.compile(r"H100|H200|A100|\bround \d|\bsession \d|\d ?ms\b|images/s|sdxl_lora/")
    for key, text in [leaf for task in TASKS for leaf in leaves(config_class(task))]:
        assert text, f"{key} has no description"
        assert len(text) <= 200 and not lab_notes.search(text), f"{key}: {text!r}"


def _number_fields():
    """Every int and float field of each task's schema, as (dotted key, type, {"task": the first task with it})."""
    import types as _types
    import typing

    from sdxl_lora.core.config import TASKS, config_class

    out, seen = [], set()
    for task in TASKS:
        for section, info in config_class(task).model_fields.items():
            model = info.annotation
            if not isinstance(model, type) or not hasattr(model, "model_fields"):
                continue
            for name, f in model.model_fields.items():
                ann = f.annotation
                args = [a for a in typing.get_args(ann) if a is not type(None)] \
                    if typing.get_origin(ann) in (typing.Union, _types.UnionType) else [ann]
                if len(args) == 1 and args[0] in (int, float) and f"{section}.{name}" not in seen:
                    seen.add(f"{section}.{name}")
                    out.append((f"{section}.{name}", args[0], {"task": task}))
    return out


def test_no_number_field_takes_inf_or_nan_and_each_refusal_names_the_field():
    fields = _number_fields()
    assert len(fields) > 40  # the walk reaches the whole schema
    for key, typ, task in fields:
        for bad in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(ConfigError, match=key.split(".")[1]):
                load_config(extra={**task, key: bad})


# Number fields where 0 means something a user asks for: off, none, no held-out images, the first timestep.
ZERO_MEANS_SOMETHING = {
    "data.keep_tokens", "data.caption_dropout", "data.tag_dropout", "data.validation_split", "adapter.dropout",
    "train.weight_decay", "train.prior_loss_weight",
    "train.warmup_steps", "train.max_grad_norm", "train.noise_offset", "train.min_snr_gamma", "train.timestep_min",
    "train.multires_noise_iterations", "train.ip_noise_gamma",
    "train.timestep_max", "train.profile_steps", "train.seed", "train.save_every", "train.save_every_minutes",
    "train.save_every_epochs", "preview.every", "preview.every_epochs", "preview.guidance", "preview.guidance_rescale", "preview.seed", "llm.validation_split"}


def test_no_number_field_takes_a_negative_and_zero_only_where_it_means_off_or_none():
    # A new number field without bounds fails here until it gets them (or is listed above, with why).
    for key, typ, task in _number_fields():
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            load_config(extra={**task, key: typ(-1)})
        if key in ZERO_MEANS_SOMETHING:
            assert getattr(getattr(load_config(extra={**task, key: typ(0)}), key.split(".")[0]),
                           key.split(".")[1]) == 0
        else:
            with pytest.raises(ConfigError, match=key.split(".")[1]):
                load_config(extra={**task, key: typ(0)})


def test_out_of_range_numbers_are_refused_with_the_field_and_the_bound():
    for key, bad in (("data.resolution", 0), ("data.resolution", -64), ("data.resolution", 10_000_000),
                     ("adapter.alpha", -4), ("adapter.overrides", {"*.attn2.to_v": -8}),
                     ("train.lr_multipliers", {"OUT00": -0.5}), ("train.lr", 0), ("data.bucket_step", 0),
                     ("preview.guidance", -1.0), ("data.max_aspect", 0.5)):
        with pytest.raises(ConfigError) as err:
            load_config(extra={key: bad})
        assert key.split(".")[1] in str(err.value), (key, str(err.value))


def test_a_config_file_that_is_not_utf8_text_is_a_clear_error(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[data]\ntrigger_word = "caf\xe9"\n'.encode("latin-1"))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
    for p in (latin1, binary):
        with pytest.raises(ConfigError, match="not UTF-8"):
            load_config(p)


def test_a_form_follows_the_models_settings_per_adapter_kind_and_keeps_what_the_user_typed(tmp_path):
    from sdxl_lora.sdxl.config import kind_recommendations
    from sdxl_lora.ui.form import follow_kind

    model = tmp_path / "base"
    model.mkdir()
    (model / "sdxl_lora.toml").write_text("[train]\nlr = 1e-3\nsteps = 50\n[kind.loha.train]\nlr = 2e-3\n")
    recs = kind_recommendations(str(model))
    assert recs["loha"] == {"train.lr": 2e-3} and recs["lora"] == recs["lokr"] == {"train.lr": 1e-3}
    assert follow_kind(recs, "loha", {"train.lr": 1e-3}) == {"train.lr": 2e-3}  # the recommended value follows
    assert follow_kind(recs, "lora", {"train.lr": 2e-3}) == {"train.lr": 1e-3}  # and back
    assert follow_kind(recs, "loha", {"train.lr": 5e-4}) == {}                  # a rate the user typed stays
    assert kind_recommendations(str(tmp_path)) == {}                            # no file: nothing follows
