"""The one table renderer of the experiment commands: the same cells as Markdown (files) or a rich table (terminal).

A command describes its table as columns (``(key, heading)``) and a ``cell(key, value) -> str`` formatter;
:func:`cells` turns rows into text cells, :func:`markdown` writes them as a Markdown table and
:func:`print_rich` prints them, saying on stderr when the terminal is too narrow for every column
(:func:`print_fitted`). ``bench``, ``ablate``, ``batch-bench``, ``profile`` and the results page use it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

Columns = Sequence[tuple[str, str]]  # (row key, heading), in table order
Cell = Callable[[str, Any], str]  # (row key, value) -> the cell's text


def cells(rows: Sequence[dict[str, Any]], columns: Columns, cell: Cell,
          default: Callable[[str], Any] = lambda key: None) -> list[list[str]]:
    """Each row's cells: ``cell(key, row[key])``, a missing key taking ``default(key)``."""
    return [[cell(key, r.get(key, default(key))) for key, _ in columns] for r in rows]


def markdown(headings: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table, one line per row, with a final newline."""
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def print_fitted(table: Any, where: str, console: Any = None) -> None:
    """Print a rich ``table``; when its columns do not fit the terminal (rich then squeezes and cuts them),
    say so on stderr and ``where`` every column can be seen."""
    from rich.console import Console
    from rich.measure import Measurement

    console = console or Console(markup=False)
    needed = Measurement.get(console, console.options.update_width(100_000), table).maximum
    console.print(table)
    if needed > console.width:
        print(f"note: the table needs {needed} columns and the terminal has {console.width}, so some cells are "
              f"cut; {where}, or widen the terminal (COLUMNS={needed} also works)", file=sys.stderr)


def print_rich(headings: Sequence[str], body: Sequence[Sequence[str]], title: str, left: Sequence[str] = (),
               where: str = "the output folder holds every column") -> None:
    """Print the table in the terminal (headings in ``left`` left-aligned, the rest right-aligned); text
    prints as it is (no rich markup: run labels keep their brackets). A file or pipe gets 200 columns (every
    column whole) unless ``COLUMNS`` says otherwise."""
    import os

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for head in headings:
        table.add_column(head, justify="left" if head in left else "right")
    for row in body:
        table.add_row(*row)
    piped = not Console().is_terminal and "COLUMNS" not in os.environ
    print_fitted(table, where, Console(markup=False, width=200 if piped else None))
