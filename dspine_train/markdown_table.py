"""Markdown tables: the one formatter behind every table the project writes (model card, demo
report, evaluation and check summaries)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SEPARATOR = {"l": "---", "r": "---:"}


def markdown_cell(value: object) -> str:
    """`value` as one table cell: a `|` is escaped and line breaks become spaces, so no cell
    text can split its row or end the table."""
    return " ".join(str(value).replace("|", "\\|").splitlines())


def markdown_table(
    header: Sequence[object],
    rows: Iterable[Sequence[object]],
    align: str | None = None,
    indent: str = "",
) -> list[str]:
    """A GitHub-flavoured markdown table as lines: the header, its separator, one line per row.

    `align` has one letter per column, `l` (left) or `r` (right, for numbers); all left when
    omitted. `indent` prefixes every line (a table inside a list item). Cells are `str()` of the
    values (format numbers before); a row of another width than the header is refused.
    """
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - set(SEPARATOR):
        raise ValueError(f"align {align!r}: one of 'l'/'r' per column ({len(header)} columns)")
    lines = [_row(header, indent), indent + "|" + "|".join(SEPARATOR[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row!r}")
        lines.append(_row(row, indent))
    return lines


def _row(cells: Sequence[object], indent: str) -> str:
    return indent + "| " + " | ".join(markdown_cell(c) for c in cells) + " |"
