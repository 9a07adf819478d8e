"""Tables and consoles for people: ids, names and numbers are never cut or wrapped mid-token, and output written
to a pipe or a file is as wide as it needs (issue 35, item 8). Every command's tables go through `print_table`."""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions
from rich.table import Table

# columns of output written to a pipe or a file (no terminal to fit): a table as wide as its widest row, a line
# never wrapped, so `… | grep job-0002395` finds the id whole (issue 35, item 8)
MAX_PIPE_WIDTH = 10_000


class CliConsole(Console):
    """rich's Console, as wide as the text needs when it writes to a pipe or a file instead of folding everything
    into 80 columns; on a terminal, the terminal's width."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(MAX_PIPE_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


def print_table(table: Table, console: Console) -> None:
    """Print a table whose ids and numbers are never cut or wrapped mid-token: its columns are no_wrap (ids,
    numbers) or wrap at spaces (text); when even that does not fit the terminal, the table is printed at the width
    it needs (the terminal wraps the long lines, the tokens stay whole); in a pipe or a file, at its natural width."""
    if console.is_terminal:
        need = console.measure(table, options=console.options.update_width(MAX_PIPE_WIDTH)).minimum
        if need <= console.width:
            console.print(table)
            return
        width = need
    else:
        width = console.measure(table, options=console.options.update_width(MAX_PIPE_WIDTH)).maximum
    wide = Console(file=console.file, width=max(width, 20), no_color=console.no_color, highlight=False,
                   force_terminal=console.is_terminal, color_system=console.color_system and "auto")
    wide.print(table)


def id_column(table: Table, name: str, right: bool = False, **kw) -> None:
    """A column of ids, names or numbers: never wrapped, never cut."""
    table.add_column(name, justify="right" if right else "left", no_wrap=True, overflow="ignore", **kw)
