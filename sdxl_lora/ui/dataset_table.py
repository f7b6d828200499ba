"""The Train form's per-dataset settings: one row per picked image folder (its repeats, trigger word, whether it
is a regularization set, its resolution, empty-caption share, tag dropout, kept leading tags and caption file
extension) and the [[data.datasets]] tables they make
(sdxl/config.py: DatasetConfig), as kohya's subsets and OneTrainer's concepts set each folder apart.

An empty cell means the run's setting. While every row is empty the form trains on data.dirs, exactly as it
does without the table; a row that sets something turns every picked folder into a table holding its path and
only what its row sets. Rows are matched to the picked folders by path, each one through Folders.inside."""
from __future__ import annotations

from pydantic import ValidationError

from sdxl_lora.core.config import Config, ConfigError
from sdxl_lora.sdxl.config import DatasetConfig

from .duplicate import _relative
from .folders import Folders
from .labels import DATASET_COLUMNS, must_words

# The columns after the folder: the DatasetConfig field each one sets, and its cell: a whole number, a number,
# text or a tick box. Numbers are text cells: an empty one means "the run's setting", which a number cell
# cannot say.
COLUMNS = (("repeats", "int"), ("trigger_word", "str"), ("is_regularization", "bool"), ("resolution", "int"),
           ("caption_dropout", "float"), ("tag_dropout", "float"), ("keep_tokens", "int"),
           ("caption_extension", "str"))
FIELDS = tuple(k for k, _ in COLUMNS)
HEADERS = [DATASET_COLUMNS[k] for k in ("path", *FIELDS)]
DATATYPES = ["str", *("bool" if kind == "bool" else "str" for _, kind in COLUMNS)]


def blank(folder: str) -> list:
    """A folder's row with every setting the run's."""
    return [folder, *(False if kind == "bool" else "" for _, kind in COLUMNS)]


def _rows(data) -> list[list]:
    # gr.Dataframe(type="array") hands lists; a pandas frame is taken too.
    rows = data.values.tolist() if hasattr(data, "values") else [list(r) for r in (data or [])]
    return [r[:len(HEADERS)] + blank("")[len(r):] for r in rows if r]


def follow(dirs: list[str] | None, data) -> list[list]:
    """The rows for the picked folders, in the picker's order: a folder keeps its row while it stays picked."""
    kept = {str(r[0]): r for r in _rows(data)}
    return [kept.get(d, blank(d)) for d in dirs or []]


def holds(dirs: list[str] | None, data) -> bool:
    """Whether the rows are already the picked folders', in the picker's order (`follow` would keep them as
    they are)."""
    return [str(r[0]) for r in _rows(data)] == list(dirs or [])


def _where(folder: str, field: str) -> str:
    return f"Per-dataset settings, folder {folder!r}, {DATASET_COLUMNS[field]}"


def _number(folder: str, field: str, raw, whole: bool) -> int | float | None:
    text = "" if raw is None else str(raw).strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{_where(folder, field)} = {text!r}: not a number; type a number, or leave the cell "
                          "empty for the run's setting") from None
    if not whole:
        return value
    if not value.is_integer():
        raise ConfigError(f"{_where(folder, field)} = {text!r}: must be a whole number")
    return int(value)


def _ticked(raw) -> bool:
    return raw is True or str(raw).strip().lower() in ("true", "yes", "1")


def _settings(folder: str, row: list) -> dict:
    """What a row sets, as DatasetConfig fields; ConfigError naming the folder and the column."""
    table = {}
    for (field, kind), raw in zip(COLUMNS, row[1:]):
        if kind == "bool":
            table[field] = _ticked(raw) or None
        elif kind == "str":
            table[field] = str(raw or "").strip() or None
        else:
            table[field] = _number(folder, field, raw, whole=kind == "int")
    table = {k: v for k, v in table.items() if v is not None}
    if table.get("is_regularization") and "trigger_word" in table:
        raise ConfigError(f"{_where(folder, 'trigger_word')} = {table['trigger_word']!r}: a regularization set never "
                          f"gets the trigger word; clear the cell, or untick "
                          f"{DATASET_COLUMNS['is_regularization']} if these are images of your subject")
    try:
        DatasetConfig(path=folder, **table)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "path"
        msg = must_words(err)
        raise ConfigError(f"{_where(folder, field)} = {table.get(field)!r}: {msg}; change it, or leave the cell "
                          "empty for the run's setting") from None
    return table


def tables(f: Folders, dirs: list[str], data) -> list[dict]:
    """The data.datasets tables of the picked folders (each folder's path inside the datasets folder and what its
    row sets), or [] when no row sets anything. A row for a folder that is not picked is not used. Raises
    ConfigError naming the folder and the column, PathRefused for a folder outside the datasets folder."""
    rows = {}
    for r in _rows(data):
        if str(r[0] or "").strip():  # a row added in the page names no folder
            rows[f.inside(str(r[0]), "datasets")] = r
    paths = {f.inside(d, "datasets"): d for d in dirs}
    settings = [_settings(shown, rows[p]) if p in rows else {} for p, shown in paths.items()]
    if not any(settings):
        return []
    if all(s.get("is_regularization") for s in settings):
        raise ConfigError(f"Per-dataset settings: every folder is ticked as {DATASET_COLUMNS['is_regularization']}, "
                          "so nothing teaches your concept; untick the folder of your subject's images")
    return [{"path": str(p), **s} for p, s in zip(paths, settings)]


def from_config(f: Folders, cfg: Config, dirs: list[str]) -> tuple[list[str], list[list], list[str]]:
    """What Duplicate puts in the folder picker and the table for a run's config: `dirs` (the picker's folders
    from data.dirs) with empty rows, or, for a run with data.datasets, its tables' folders and rows; and what
    the table has no column for (left out of the copy), in words."""
    if not cfg.data.datasets:
        return dirs, [blank(d) for d in dirs], []
    picked, rows, left_out = [], [], []
    default = DatasetConfig.model_construct()
    for d in cfg.data.datasets:
        if d.path is None:
            left_out.append(f"the regularization images made from {d.class_prompt!r}")
            continue
        folder = _relative(f, d.path, "datasets")
        other = [k for k in DatasetConfig.model_fields
                 if k != "path" and k not in FIELDS and getattr(d, k) != getattr(default, k)]
        if d.trigger_word == "" and not d.is_regularization:
            other.append("trigger_word (none)")  # an empty cell means the run's trigger word
        if other:
            left_out.append(f"{folder}: {', '.join(other)}")
        # A regularization set's trigger word does nothing (it never gets one): not shown, nothing lost.
        trigger = None if d.is_regularization else d.trigger_word
        rows.append([folder, *(d.is_regularization if kind == "bool" else
                               _cell(trigger if field == "trigger_word" else getattr(d, field))
                               for field, kind in COLUMNS)])
        picked.append(folder)
    return picked, rows, left_out


def _cell(value) -> str:
    return "" if value is None else str(value)


def describe(data) -> str:
    """What each picked folder sets, as the page lists it above the boxes (Markdown): "**ohwx**: repeats 3,
    trigger word sks" or "**ohwx**: the run's settings"."""
    from .text import md_text

    lines = []
    for row in _rows(data):
        said = []
        for (field, kind), raw in zip(COLUMNS, row[1:]):
            if kind == "bool":
                if _ticked(raw):
                    said.append(DATASET_COLUMNS[field])
            elif str(raw if raw is not None else "").strip():
                said.append(f"{DATASET_COLUMNS[field]} {str(raw).strip()}")
        shown = md_text(", ".join(said)) if said else "the run's settings"
        lines.append(f"- **{md_text(row[0])}**: {shown}")
    return "\n".join(lines) or "Pick an image folder above."


def cells(data, folder: str | None) -> list:
    """The settings of `folder`'s row (after the folder), empty where it has no row."""
    row = next((r for r in _rows(data) if str(r[0]) == folder), blank(folder or ""))
    return [(_ticked(v) if kind == "bool" else ("" if v is None else str(v))) for (_, kind), v in zip(COLUMNS, row[1:])]


def with_cell(data, folder: str | None, index: int, value) -> list[list]:
    """The rows with `folder`'s setting number `index` (COLUMNS) set to `value`; unchanged without a folder."""
    rows = _rows(data)
    for r in rows:
        if folder and str(r[0]) == folder:
            r[1 + index] = value
    return rows
