"""Every byte of the files fedlb stores and reads back is checked, with or without the
.sha256 beside them (issue 35): before, `fedlb decrypt` without the side file accepted
272 of 1,894 single-byte flips, all in the zip headers, central directory and end record
that the arrays' digest inside the file did not cover. Real files, written by the real
writers; every byte of the zip's structure is flipped, and a sample of the arrays'."""

from __future__ import annotations

import io
import re
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.flower import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fedlb.flower.he import INNER_DIGEST, encrypt_record, load_encrypted, save_encrypted
from fedlb.flower.records import start_run_identity
from fedlb.he import CiphertextError, load_context, write_keys
from fedlb.security import DigestError, check_seal, seal_zip
from fedlb.security.digests import SEAL_PREFIX, SEAL_SIZE

runner = CliRunner()
WEIGHTS = np.linspace(-1, 1, 32, dtype=np.float32)
ARRAY_STRIDE = 61  # one byte in this many of an array's data beyond its .npy header


def said(result) -> str:
    """The output as one line, without the usage box rich draws around errors."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def flip_offsets(data: bytes) -> list[int]:
    """Every byte of the zip but its members' array data, and one in ARRAY_STRIDE of that:
    local headers, .npy headers, central directory, zip64 and end records, the seal."""
    sampled: set[int] = set()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            name_size, extra_size = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_size + extra_size + 128  # past .npy's header
            sampled.update(range(start, start + info.compress_size - 128))
    return [i for i in range(len(data)) if i not in sampled or i % ARRAY_STRIDE == 0]


def flipped(data: bytes, offset: int) -> bytes:
    damaged = bytearray(data)
    damaged[offset] ^= 1 << (offset % 8)  # one bit, each bit position in turn
    return bytes(damaged)


def truncations_and_additions(data: bytes) -> list[bytes]:
    size = len(data)
    cuts = {0, 1, 21, 22, 100, size // 2, size - 1, size - SEAL_SIZE, size - SEAL_SIZE - 1}
    cuts |= {size - SEAL_SIZE - 22 + k for k in range(-2, 3)}  # around the end record
    cuts |= set(range(0, size, 4099))
    empty_end = b"PK\x05\x06" + bytes(18)  # an end record of an empty zip, no comment
    return [data[:cut] for cut in sorted(cuts)] + [
        data + extra
        for extra in (b"\0", b"\n", b"x" * 100, data[-SEAL_SIZE:], empty_end, data[-200:])
    ]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def model(keys, tmp_path) -> Path:
    """A real encrypted model, as the server writes it, without a .sha256 beside it."""
    record = encrypt_record(load_context(keys.secret, "silo"), ArrayRecord({"w": Array(WEIGHTS)}))
    return save_encrypted(record, tmp_path / "model.ckks.npz")


def decrypt(model: Path, keys, out: Path, *extra: str):
    return runner.invoke(
        app, ["decrypt", str(model), "--context", str(keys.secret), "--out", str(out), *extra]
    )


# ---- the seal itself ------------------------------------------------------------------
def test_a_sealed_npz_is_an_ordinary_zip_whose_comment_is_its_digest(tmp_path):
    path = tmp_path / "a.npz"
    with path.open("w+b") as handle:
        np.savez(handle, x=np.arange(5))
        seal_zip(handle)
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        assert archive.comment == data[-SEAL_SIZE:]
        assert archive.comment.startswith(SEAL_PREFIX)
    with np.load(path) as loaded:
        assert loaded["x"].tolist() == [0, 1, 2, 3, 4]
    assert check_seal(path) is True
    unsealed = tmp_path / "b.npz"
    np.savez(unsealed, x=np.arange(5))  # as fedlb wrote them before it sealed them
    assert check_seal(unsealed) is False
    with path.open("r+b") as handle, pytest.raises(ValueError, match="cannot seal"):
        seal_zip(handle)  # already sealed: once only


# ---- fedlb decrypt ---------------------------------------------------------------------
@pytest.mark.slow
def test_decrypt_refuses_every_flipped_byte_without_the_side_file(model, keys, tmp_path):
    intact = model.read_bytes()
    out = tmp_path / "model.pt"
    ok = decrypt(model, keys, out)
    assert ok.exit_code == 0, ok.output
    assert np.allclose(torch.load(out)["w"].numpy(), WEIGHTS, atol=1e-3)
    out.unlink()
    offsets = flip_offsets(intact)
    assert len(offsets) > 1_000
    refused, lines = 0, set()
    for offset in offsets:
        damaged = flipped(intact, offset)
        model.write_bytes(damaged)
        with pytest.raises(CiphertextError) as caught:
            load_encrypted(model)
        message = str(caught.value)
        assert "\n" not in message, (offset, message)
        assert str(model) in message, (offset, message)
        assert model.read_bytes() == damaged  # refused, not repaired or removed
        refused += 1
        lines.add(message)
    print(f"decrypt: {refused} of {len(offsets)} single-bit flips refused")
    assert refused == len(offsets)  # how long it takes is the suite's timeout's to bound
    assert all("is damaged" in line for line in lines), lines
    # the command itself, on a sample of them: exit 2, one line, no traceback, no model.pt
    ending = range(len(intact) - SEAL_SIZE - 22, len(intact), 3)  # end record and seal
    for k, offset in enumerate([*offsets[:: len(offsets) // 20], *ending]):
        model.write_bytes(flipped(intact, offset))
        result = decrypt(model, keys, out, *(["--unchecked"] if k % 4 == 0 else []))
        assert result.exit_code == 2, (offset, result.output)  # --unchecked or not
        assert "is damaged" in said(result)
        assert "Traceback" not in result.output
        assert not out.exists()
    model.write_bytes(intact)
    assert decrypt(model, keys, out).exit_code == 0


def test_decrypt_refuses_a_model_cut_short_or_with_bytes_added(model, keys, tmp_path):
    intact = model.read_bytes()
    for damaged in truncations_and_additions(intact):
        model.write_bytes(damaged)
        with pytest.raises(CiphertextError) as caught:
            load_encrypted(model)
        assert "\n" not in str(caught.value), len(damaged)
    model.write_bytes(intact[:-1])
    result = decrypt(model, keys, tmp_path / "m.pt")
    assert result.exit_code == 2
    assert "is damaged" in said(result)
    assert "Traceback" not in result.output


def test_a_model_written_before_the_seal_is_read_as_before(model, keys, tmp_path):
    """An older fedlb's file (no seal) is checked on the arrays' digest inside it; one with
    no digest at all only with --unchecked; a sealed file stays readable by that fedlb."""
    with np.load(model) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    assert INNER_DIGEST in entries  # what an older fedlb checks in a sealed file
    with model.open("wb") as handle:
        np.savez(handle, **entries)
    assert decrypt(model, keys, tmp_path / "a.pt").exit_code == 0
    with model.open("wb") as handle:
        np.savez(handle, **{k: v for k, v in entries.items() if k != INNER_DIGEST})
    result = decrypt(model, keys, tmp_path / "b.pt")
    assert result.exit_code == 2
    assert "carries no digest" in said(result)
    assert decrypt(model, keys, tmp_path / "b.pt", "--unchecked").exit_code == 0


# ---- checkpoint.npz --------------------------------------------------------------------
def test_a_checkpoint_with_any_byte_flipped_is_refused(tmp_path):
    start_run_identity(tmp_path, {"seed": 1})
    arrays = ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3))})
    save_checkpoint(tmp_path, Checkpoint(2, 5, arrays, {"pending": None}, {"seed": 1}))
    path = tmp_path / "checkpoint.npz"
    intact = path.read_bytes()
    assert load_checkpoint(tmp_path).round == 2
    refused = 0
    for offset in range(len(intact)):  # every byte: the file is small
        damaged = flipped(intact, offset)
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(tmp_path)
        message = str(caught.value)
        assert "\n" not in message, (offset, message)
        assert "checkpoint.npz is damaged" in message, (offset, message)
        assert path.read_bytes() == damaged
        refused += 1
    print(f"checkpoint: {refused} of {len(intact)} single-bit flips refused")
    for damaged in truncations_and_additions(intact):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match=r"checkpoint\.npz is damaged"):
            load_checkpoint(tmp_path)
    path.write_bytes(flipped(intact, len(intact) // 3))
    result = runner.invoke(app, ["server", "--resume", str(tmp_path)])
    assert result.exit_code == 2, result.output
    # the box folds a long tmp path anywhere, the file's name too: compared unspaced
    assert "checkpoint.npzisdamaged" in said(result).replace(" ", ""), said(result)
    assert "Traceback" not in result.output
    path.write_bytes(intact)
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 2
    assert loaded.arrays["w"].numpy().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_a_checkpoint_written_before_the_seal_is_read_as_before(tmp_path):
    save_checkpoint(tmp_path, Checkpoint(1, 2, ArrayRecord({"w": Array(np.ones(3))}), {}, {}))
    path = tmp_path / "checkpoint.npz"
    with np.load(path) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    np.savez(path, **entries)  # its content digest, no seal
    assert check_seal(path) is False
    assert load_checkpoint(tmp_path).round == 1
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(DigestError, match="is damaged"):
        check_seal(path)
