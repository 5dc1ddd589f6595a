"""The "in use by another fedlb run" line quotes the holder's command cut between whole
arguments, or whole characters, with "..." where it is cut (issue 51, item 8: it was cut
mid-character); a damaged lock file is read within bounds."""

from __future__ import annotations

import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from fedlb.security import LOCK_FILE, FolderInUseError, claim_folder
from fedlb.security.run_lock import COMMAND_CHARS, cut_command

HOLD = (
    "import sys, time; from pathlib import Path; from fedlb.security import claim_folder\n"
    "with claim_folder(Path(sys.argv[1])):\n"
    "    print('held', flush=True); time.sleep(60)"
)


def quoted_in(refusal: str) -> str:
    return refusal.split("`")[1]


@pytest.mark.parametrize(
    "arguments",
    [
        ["--name", "é" * 200],  # one argument longer than the limit, two bytes a character
        ["日本"] * 80,  # many short ones, three bytes a character
        ["--note", "e\u0301" * 100],  # a letter and its combining accent: one character
    ],
    ids=["é", "日本", "combining"],
)
def test_a_holders_long_multibyte_command_is_cut_between_whole_arguments(tmp_path, arguments):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), *arguments], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError) as refused, claim_folder(out):
            pass
    finally:
        holder.kill()
        holder.wait(10)
    command = quoted_in(str(refused.value))
    assert len(command) <= COMMAND_CHARS
    assert command.endswith(" ...")
    words = shlex.split(command.removesuffix(" ..."))  # quotes balanced: it parses
    given = ["python", "-c", str(out), *arguments]  # python -c: argv without the code
    assert words == given[: len(words)]  # whole arguments, as given, in order
    assert "\ufffd" not in command


def test_a_first_argument_too_long_alone_is_cut_between_characters():
    for text in ("é" * 300, "日本" * 100, "e\u0301" * 150, "a" * 300):
        cut = cut_command([text, "more"], 40)
        assert len(cut) <= 40
        assert cut.endswith(" ...")
        kept = shlex.split(cut.removesuffix(" ..."))[0]
        assert text.startswith(kept)
        assert not unicodedata.combining(text[len(kept)])  # no accent parted from its letter
    short = ["fedlb", "server", "--out-dir", "runs/日本"]
    assert shlex.split(cut_command(short)) == short  # whole, when it fits


def test_an_argument_the_os_gave_as_bytes_shows_as_utf8():
    """Bytes that are no text in the locale's encoding come as lone surrogates: shown read
    as UTF-8, U+FFFD where they are not UTF-8, never a half character."""
    import os

    assert shlex.split(cut_command([os.fsdecode("日本".encode())])) == ["日本"]
    assert shlex.split(cut_command([os.fsdecode(b"a\xffb")])) == ["a\ufffdb"]


def test_a_damaged_lock_file_names_no_holder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        (out / LOCK_FILE).write_bytes(b"[" * 200_000)  # the holder's own line, replaced
        with (
            pytest.raises(FolderInUseError, match="it has not named itself yet"),
            claim_folder(out),
        ):
            pass
    finally:
        holder.kill()
        holder.wait(10)


def test_the_holders_line_is_cut_when_it_was_written_long(tmp_path, monkeypatch):
    from fedlb.security import run_lock

    out = tmp_path / "out"
    monkeypatch.setattr(run_lock, "HOLDER_WRITTEN_S", 0.1)
    long = {"pid": 1, "command": "日本" * 100, "started": "then"}
    (out).mkdir()
    monkeypatch.setattr(run_lock, "_alive", lambda pid: True)
    import json

    (out / LOCK_FILE).write_text(json.dumps(long))
    refusal = run_lock.refusal(Path(out))
    command = quoted_in(refusal)
    assert len(command) <= COMMAND_CHARS
    assert command == "日本" * 58 + " ..."  # whole characters, 120 in all
