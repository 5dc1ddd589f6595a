"""fedlb.security.stored: every JSON file fedlb reads back is bounded in size and depth,
holds finite numbers only, and a damaged one is one line naming the file (and line)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedlb.security import (
    StoredFileError,
    parse_json,
    read_json,
    read_json_lines,
    read_json_object,
    set_aside,
)


def test_deep_nesting_is_refused_in_one_line_not_a_recursion_error(tmp_path):
    path = tmp_path / "verdicts.json"
    path.write_text("[" * 200_000)
    with pytest.raises(StoredFileError, match=r"verdicts.json: (nested deeper|not JSON)"):
        read_json(path)
    path.write_text("[" * 40 + "]" * 40)  # parses, but deeper than any file fedlb writes
    with pytest.raises(StoredFileError, match="nested deeper than 32 levels"):
        read_json(path)
    assert read_json_object(_written(tmp_path, {"a": [[{"b": 1}]]})) == {"a": [[{"b": 1}]]}


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999", "9" * 5000])
def test_numbers_that_are_not_finite_or_too_long_are_refused(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text('{"speed": ' + text + "}")
    with pytest.raises(StoredFileError, match=r"profile.json: (not a finite number|a \d+-digit)"):
        read_json(path)


def test_a_file_over_its_size_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.json"
    with path.open("wb") as file:
        file.truncate(2**30)  # sparse: 1 GiB on paper, nothing on disk
    with pytest.raises(StoredFileError, match="1073741824 bytes, more than"):
        read_json(path)


def test_json_lines_name_the_damaged_line(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"round": 1}\n\n{"round": 2}\n{"round": \n')
    rows = read_json_lines(path)
    assert next(rows)[:2] == (1, '{"round": 1}')
    assert next(rows)[0] == 3
    with pytest.raises(StoredFileError, match=r"rounds.jsonl line 4: not JSON"):
        next(rows)
    path.write_text('{"round": 1}\n' + " " * 100 + "\n")
    with pytest.raises(StoredFileError, match="line 2: longer than 50 bytes"):
        list(read_json_lines(path, max_line_bytes=50))


def test_not_utf8_and_not_an_object_say_so(tmp_path):
    path = tmp_path / "run.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(StoredFileError, match="not UTF-8 text: byte 8 is 0xff"):
        read_json(path)
    path.write_text("[1]")
    with pytest.raises(StoredFileError, match="an array, not a JSON object"):
        read_json_object(path)


def test_a_damaged_file_is_set_aside_beside_itself_and_kept(tmp_path):
    path = _written(tmp_path, {"x": 1})
    first = set_aside(path)
    assert not path.exists()
    assert first.parent == tmp_path
    assert first.name.startswith(path.name + ".damaged-")
    path.write_text("again")
    second = set_aside(path)
    assert second != first
    assert second.read_text() == "again"
    assert json.loads(first.read_text()) == {"x": 1}


@given(st.text(max_size=200))
def test_any_text_is_a_value_or_a_value_error(text):
    with contextlib.suppress(ValueError):
        parse_json(text)


def _written(folder: Path, value: object) -> Path:
    path = folder / "file.json"
    path.write_text(json.dumps(value))
    return path
