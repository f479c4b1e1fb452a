"""The one markdown table formatter: rows keep their columns whatever the cell text."""

from __future__ import annotations

import re

import pytest

from dspine_train.markdown_table import markdown_table


def _cells(line: str) -> list[str]:
    """A table line's cells as a markdown renderer splits them (on unescaped `|`)."""
    inner = line.strip()[1:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def test_header_separator_and_rows_with_alignment() -> None:
    lines = markdown_table(["name", "ms"], [("plain", 1.5), ("verify", 12)], align="lr")
    assert lines == ["| name | ms |", "|---|---:|", "| plain | 1.5 |", "| verify | 12 |"]


def test_pipes_and_line_breaks_in_a_cell_stay_in_that_cell() -> None:
    text = "a | b\nc"
    lines = markdown_table(["prompt", "ok"], [(text, True)])
    assert len(lines) == 3  # the line break did not end the row
    assert _cells(lines[2]) == ["a | b c", "True"]


def test_indent_prefixes_every_line() -> None:
    lines = markdown_table(["k"], [(1,)], indent="  ")
    assert all(line.startswith("  |") for line in lines)


@pytest.mark.parametrize(("rows", "align", "message"), [
    ([(1, 2, 3)], None, "3 cells under 2 columns"),
    ([(1, 2)], "l", "one of 'l'/'r' per column"),
    ([(1, 2)], "lc", "one of 'l'/'r' per column"),
])
def test_a_row_or_alignment_of_the_wrong_width_is_refused(rows, align, message) -> None:
    with pytest.raises(ValueError, match=message):
        markdown_table(["a", "b"], rows, align=align)

