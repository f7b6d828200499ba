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
