"""What an outside probe broke (issue 18), each reproduced and guarded, for the files a run
leaves: a checkpoint belongs to its run and damage is detected, decrypt refuses a model
with a flipped bit, a damaged file or a lost digest file."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedlb.cli import app
from fedlb.flower import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fedlb.flower.records import start_run_identity
from tests.reliability_helpers import runner, said


# ---- a checkpoint belongs to its run; damage is detected ---------------------------------
def checkpoint(settings=None, round_=1):
    arrays = ArrayRecord({"w": Array(np.arange(6, dtype=np.float32))})
    return Checkpoint(round_, 3, arrays, {"pending": None}, settings or {"seed": 1})


def test_a_checkpoint_from_another_runs_folder_is_refused(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    start_run_identity(ours, {"seed": 1})
    start_run_identity(theirs, {"seed": 1})
    save_checkpoint(theirs, checkpoint())
    assert load_checkpoint(theirs).round == 1
    (ours / "checkpoint.npz").write_bytes((theirs / "checkpoint.npz").read_bytes())
    with pytest.raises(CheckpointError, match="copied from another run"):
        load_checkpoint(ours)
    bare = tmp_path / "bare"  # a folder without a run.json: no run to belong to
    bare.mkdir()
    (bare / "checkpoint.npz").write_bytes((theirs / "checkpoint.npz").read_bytes())
    with pytest.raises(CheckpointError, match="copied from another run"):
        load_checkpoint(bare)
    # the same run's id with other settings: refused too
    save_checkpoint(ours, checkpoint({"seed": 2}))
    with pytest.raises(CheckpointError, match="settings"):
        load_checkpoint(ours)
    # and the resume path says so as a usage error
    result = runner.invoke(app, ["server", "--resume", str(ours)])
    assert result.exit_code == 2
    assert "settings" in said(result)


def test_a_damaged_checkpoint_is_refused(tmp_path):
    start_run_identity(tmp_path, {"seed": 1})
    save_checkpoint(tmp_path, checkpoint())
    path = tmp_path / "checkpoint.npz"
    with np.load(path) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    entries["array-0"][2] += 1e-3  # one value changed, the file re-saved whole
    np.savez(path, **entries)
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(tmp_path)


def test_decrypt_refuses_a_model_with_a_flipped_bit_and_a_damaged_file(tmp_path):
    from fedlb.flower import save_encrypted
    from fedlb.flower.he import encrypt_record
    from fedlb.he import load_context, write_keys
    from fedlb.security.digests import write_digest

    keys = write_keys(tmp_path / "keys")
    record = encrypt_record(
        load_context(keys.secret, "silo"),
        ArrayRecord({"w": Array(np.linspace(-1, 1, 32, dtype=np.float32))}),
    )
    model = save_encrypted(record, tmp_path / "model.ckks.npz")
    write_digest(model)
    ok = runner.invoke(
        app, ["decrypt", str(model), "--context", str(keys.secret), "--out", str(tmp_path / "a.pt")]
    )
    assert ok.exit_code == 0, ok.output
    with np.load(model) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    entries["ckks/0"][200] ^= 0x01  # one bit of one ciphertext
    with model.open("wb") as handle:
        np.savez(handle, **entries)
    result = runner.invoke(
        app, ["decrypt", str(model), "--context", str(keys.secret), "--out", str(tmp_path / "b.pt")]
    )
    assert result.exit_code == 2, result.output
    assert "does not match its digest" in said(result)
    assert not (tmp_path / "b.pt").exists()
    model.write_bytes(b"PK\x03\x04 not really a zip")  # damaged, without a digest
    (tmp_path / "model.ckks.npz.sha256").unlink()
    result = runner.invoke(app, ["decrypt", str(model), "--context", str(keys.secret)])
    assert result.exit_code == 2
    assert "damaged" in said(result)
    assert "Traceback" not in result.output


def test_decrypt_checks_a_model_that_lost_its_digest_file(tmp_path):
    """Before: a bit-flipped model.ckks.npz without its .sha256 decrypted, exit 0, to
    weights off by 6.8e7. Its digest now travels inside the file; a file with neither
    digest (an older fedlb's) is refused unless --unchecked."""
    from fedlb.flower import save_encrypted
    from fedlb.flower.he import INNER_DIGEST, encrypt_record
    from fedlb.he import load_context, write_keys

    keys = write_keys(tmp_path / "keys")
    record = encrypt_record(
        load_context(keys.secret, "silo"),
        ArrayRecord({"w": Array(np.linspace(-1, 1, 32, dtype=np.float32))}),
    )
    model = save_encrypted(record, tmp_path / "model.ckks.npz")  # no .sha256 beside it

    def decrypt(*extra):
        return runner.invoke(
            app,
            [
                "decrypt",
                str(model),
                "--context",
                str(keys.secret),
                "--out",
                str(tmp_path / "m.pt"),
                *extra,
            ],
        )

    assert decrypt().exit_code == 0  # the digest inside vouches for it
    with np.load(model) as data:
        entries = {k: np.array(data[k]) for k in data.files}
    flipped = dict(entries)
    flipped["ckks/0"] = flipped["ckks/0"].copy()
    flipped["ckks/0"][200] ^= 0x01
    with model.open("wb") as handle:
        np.savez(handle, **flipped)
    result = decrypt()
    assert result.exit_code == 2, result.output
    assert "does not match the digest written inside it" in said(result)
    older = {k: v for k, v in entries.items() if k != INNER_DIGEST}  # as an older fedlb wrote
    with model.open("wb") as handle:
        np.savez(handle, **older)
    result = decrypt()
    assert result.exit_code == 2, result.output
    assert "carries no digest" in said(result)
    assert "--unchecked" in said(result)
    assert decrypt("--unchecked").exit_code == 0
