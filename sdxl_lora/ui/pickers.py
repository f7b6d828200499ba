"""The page's pickers of folders and files (dataset folders, models, adapters, runs): their choices are read from
the folders again when the page loads, when a tab is shown and when the person opens a picker, so what appeared
since (a folder the UI's own upload made, a model copied in, a run that finished) is offered without a restart.
A page's components are built once per server; without this, every browser would see the choices of the
moment the server started, a reload included."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr


class Pickers:
    """The dropdowns whose choices come from the folders, each with the function that lists them."""

    def __init__(self):
        self.items: list[tuple[gr.Dropdown, Callable[[], dict]]] = []  # each with its update

    def add(self, dropdown: gr.Dropdown, choices: Callable[[], list], empty: str | None = None,
            info: str | None = None) -> gr.Dropdown:
        """Keep `dropdown`'s choices as `choices()` lists them: read again each time the person opens it. empty: its
        help while there is nothing to choose (where to put what it lists), `info` (its own) otherwise."""
        own = info if info is not None else dropdown.info

        def again():
            found = choices()
            return gr.update(choices=found, **({"info": own if found else empty} if empty else {}))

        self.items.append((dropdown, again))
        dropdown.focus(again, None, dropdown, show_progress="hidden")
        return dropdown

    def mark(self) -> int:
        return len(self.items)

    def refresh(self, since: int = 0, until: int | None = None):
        """A handler and its outputs: the choices of the pickers added between two marks, read again."""
        items = self.items[since:until]

        def again():
            return [fn() for _, fn in items]

        return again, [d for d, _ in items]
