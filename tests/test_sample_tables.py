"""Sample tables for trackers: the steps that log one, their rows, and the markdown form text-only trackers show."""

from __future__ import annotations

from types import SimpleNamespace

from slime.observability.sample_tables import COLUMNS, as_markdown, table_due, table_rows

ROWS = [
    {"group": 0, "prompt": "copy: ab", "response": "ab", "reward": 1.0},
    {"group": 1, "prompt": "a | b\nc", "response": "back\\slash", "reward": 0.0},
]


def test_a_table_is_due_at_step_0_and_every_log_interval_steps():
    every_3 = SimpleNamespace(log_interval=3)
    assert [step for step in range(10) if table_due(every_3, step)] == [0, 3, 6, 9]
    assert [step for step in range(25) if table_due(SimpleNamespace(), step)] == [0, 10, 20]


def test_rows_follow_the_columns_with_the_step_first():
    assert COLUMNS[0] == "step"
    assert table_rows(7, ROWS) == [[7, 0, "copy: ab", "ab", 1.0], [7, 1, "a | b\nc", "back\\slash", 0.0]]
    assert table_rows(7, [{"group": 2}]) == [[7, 2, None, None, None]]


def test_markdown_escapes_what_would_break_a_row():
    lines = as_markdown(4, ROWS).splitlines()
    assert lines[0] == "| step | group | prompt | response | reward |"
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2] == "| 4 | 0 | copy: ab | ab | 1.0 |"
    assert lines[3] == "| 4 | 1 | a \\| b\\nc | back\\\\slash | 0.0 |"
    assert len(lines) == 4
