"""The Train form, generated from the config schema (core/config.py): one widget per field, the schema's
defaults. Nothing here restates a default or an allowed value.

Literal -> dropdown, bool -> checkbox, int/float -> number, a list of texts -> one a line, a list of Literals -> a
tick box per value, anything else -> text (TOML literal for lists and tables). Labels, help and grouping are the
page's own words (labels.py). Fields that name files or folders are not free text: the page picks them inside the
UI's folders (see PATH_FIELDS).
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from sdxl_lora.core.config import (SAMPLE_DATA, TASKS, Config, ConfigError, _parse_value, field_tasks, load_config,
                                   schema_field)

# Paths: set by the UI from its folders (or picked from them), never typed as free text.
#   model.path / data.dirs: picked from the models / datasets folder; model.cache_dir: the models folder;
#   preview.prompts: the prompts box, written to a file under runs/.ui; data.cache_dir, output.runs_dir:
#   the runs folder; output.overwrite: never from the page (it would delete a run); data.datasets: its tables
#   name folders, so not from a free-text box: the per-dataset table makes them for the picked folders
#   (dataset_table.py).
PATH_FIELDS = {"model.path", "data.dirs", "data.datasets", "model.cache_dir", "model.tokenizer", "preview.prompts",
               "data.cache_dir", "output.runs_dir", "output.overwrite"}


@dataclass
class FieldSpec:
    key: str               # "section.name"
    annotation: Any
    default: Any
    help: str              # the field's description
    tasks: tuple[str, ...] = TASKS  # the tasks the field does something for

    @property
    def base(self) -> Any:
        """The annotation without `| None`."""
        args = typing.get_args(self.annotation)
        if typing.get_origin(self.annotation) in (typing.Union, types.UnionType) and type(None) in args:
            rest = [a for a in args if a is not type(None)]
            return rest[0] if len(rest) == 1 else self.annotation
        return self.annotation

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.annotation)

    @property
    def kind(self) -> str:
        b = self.base
        if typing.get_origin(b) is Literal:
            return "choice"
        if b is bool:
            return "bool"
        if b is int:
            return "int"
        if b is float:
            return "float"
        if b is str:
            return "str"
        if typing.get_origin(b) is list and typing.get_args(b) == (str,):
            return "lines"  # a list of texts (prompts): one a line, not a TOML list on one line
        if typing.get_origin(b) is list and typing.get_origin(typing.get_args(b)[0]) is Literal:
            return "picks"  # some of a fixed set (the trackers): a tick box for each value the schema allows
        return "toml"


def schema_fields(model: type[BaseModel] = Config, prefix: str = "", defaults: BaseModel | None = None,
                  task: str = "sdxl") -> list[FieldSpec]:
    """Every leaf field of the schema, sections walked in order. The starting values are what the task's
    train command with no config uses (`sdxl-lora train`, `sdxl-lora llm train`): the schema's defaults,
    for SDXL with the default model's recommended settings (config.RECOMMENDED_SETTINGS) over them."""
    out = []
    if defaults is None:
        defaults = load_config(None, None, {"task": task}) if model is Config else model()
    if model is Config:
        model = type(defaults)  # the task's own config class: its sections hold the task's fields
    for name, info in model.model_fields.items():
        ann = info.annotation
        key = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(schema_fields(ann, f"{key}.", getattr(defaults, name)))
        else:
            out.append(FieldSpec(key, ann, getattr(defaults, name), info.description or "",
                                 field_tasks(model, name)))
    return out


def follow_kind(recommended: dict[str, dict[str, Any]], kind: str, current: dict[str, Any]) -> dict[str, Any]:
    """The fields to fill when a form's adapter kind becomes `kind`, from config.kind_recommendations: each
    field the model recommends per kind takes the new kind's value where it still holds one kind's
    recommendation; a value the user typed stays."""
    new = recommended.get(kind, {})
    return {k: new[k] for k, v in current.items()
            if k in new and any(v == per.get(k) for per in recommended.values())}


def _toml_literal(value: Any) -> str:
    """A value as a one-line TOML literal (what `--set` takes): inline tables, arrays, strings, numbers."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # strings and numbers: JSON's forms are valid TOML


def to_widget_value(spec: FieldSpec, value: Any) -> Any:
    if spec.kind == "lines":
        return "\n".join(value or [])
    if spec.kind == "toml":
        return "" if value is None else _toml_literal(value)
    if spec.kind == "picks":
        return list(value or [])
    if spec.kind == "str" and value is None:
        return ""
    return value


def _problem(spec: FieldSpec, kind: str, value: Any, msg: str) -> ConfigError:
    """A wrong form value as a ConfigError shaped like the schema's own (its problems), so the page words both
    alike (labels.error_words)."""
    return ConfigError(f"{spec.key} = {value!r}: {msg}",
                       [{"loc": tuple(spec.key.split(".")), "type": kind, "input": value, "msg": msg}])


def from_widget_value(spec: FieldSpec, value: Any) -> Any:
    """The page's value for a field as the schema takes it; empty means None where the schema allows it."""
    if value is None or (isinstance(value, str) and not value.strip() and spec.kind != "str"):
        if spec.optional:
            return None
        default = to_widget_value(spec, spec.default)
        raise _problem(spec, "value_error", value, f"needs a value (the default is {default!r})")
    if spec.kind == "str" and spec.optional and not str(value).strip():
        return None
    if spec.kind == "lines":
        return [line.strip() for line in str(value).splitlines() if line.strip()]
    if spec.kind in ("int", "float"):
        try:
            f = float(value)
        except ValueError:
            raise _problem(spec, "float_parsing", value, "must be a number") from None
        if spec.kind == "float":
            return f
        if not f.is_integer():
            raise _problem(spec, "int_from_float", value, "must be a whole number")
        return int(f)
    if spec.kind == "toml" or spec.kind == "picks" and isinstance(value, str):  # a list typed as TOML, too
        return _parse_value(str(value).strip())
    if spec.kind == "picks":
        return list(value)
    return value


# Fields a run decides when its config leaves them unset: train.speed="auto" the speed levers, train.vram_gb
# the memory levers. A form holds every field, so one left at the schema's default must stay unset in the
# config (and in the file the queue runs), or the run would take it as the user's choice and decide nothing.
DECIDED_WHEN_UNSET = ("train.cuda_graphs", "train.compile", "train.channels_last", "train.gradient_checkpointing",
                      "train.checkpoint_budget_gb", "model.quantize", "model.tiled_vae_encode", "preview.vae_tiling")


def schema_default(key: str) -> Any:
    return schema_field(key).default


def build_config(specs: list[FieldSpec], values: list[Any], fixed: dict[str, Any]) -> Config:
    """A validated Config from the form's values plus the fields the UI sets itself (`fixed`, dotted keys).
    Raises ConfigError naming the field."""
    extra: dict[str, Any] = {}
    for spec, value in zip(specs, values):
        v = from_widget_value(spec, value)
        if spec.key in DECIDED_WHEN_UNSET and v == schema_default(spec.key):
            continue
        if v is not None:
            extra[spec.key] = v
    extra.update(fixed)
    return load_config(None, None, extra)


def default_prompts() -> str:
    # The demo base's prompts (what preview.prompts unset gives it) ship with the repository: shown to edit.
    p = SAMPLE_DATA / "prompts.txt"
    return p.read_text(encoding="utf-8") if p.is_file() else ""


def model_default_prompts(text: str | None) -> bool:
    """Whether the preview prompts box holds what the page put there, the demo base's prompts: that means the
    model's own previews (preview.prompts unset), the same prompts for the demo base and a few of the dataset's
    captions for another model, whose previews would otherwise be the demo's shapes."""
    return bool(text and text.strip()) and text.strip() == default_prompts().strip()
