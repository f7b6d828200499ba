"""Text the page shows in Markdown (messages, errors): written as it is, so the `*` of a glob, the `_` of a
field name or a `<` in a message reaches the user unchanged."""
from __future__ import annotations

import html


def md_text(text: str) -> str:
    """`text` for a Markdown component: every character shown as written (no emphasis, no HTML)."""
    text = html.escape(str(text), quote=False)
    return "".join("\\" + c if c in "\\`*_[]~#|" else c for c in text)


def error_md(message) -> str:
    """An error for a Markdown message box: "**Error:**" and the message as written."""
    return f"**Error:** {md_text(message)}"


_PASS_OVERWRITE = "choose another path or pass overwrite=True (--overwrite)"
_OVERWRITE_FLAG = "(--overwrite does not change this)"


def writer_words(message, name_box: str, overwrite_box: str) -> str:
    """A writer's refusal (core/fsutil.check_destination) in the words of the page that asked for the write: the
    box that names the file and the overwrite checkbox by their labels, instead of the CLI's path and flag."""
    text = str(message).replace(_PASS_OVERWRITE, f"type another {name_box}, or tick '{overwrite_box}'")
    return text.replace(_OVERWRITE_FLAG, f"(ticking '{overwrite_box}' does not change this)")
