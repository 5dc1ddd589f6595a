"""What an outside probe broke (issue 18), each reproduced and guarded: what cannot work is
refused up front, before anything starts: TLS files no silo would accept, a batch no silo
can fill, a folder that cannot be made (one line with its path, not a traceback)."""

from __future__ import annotations

import pytest

from fedlb.cli import app
from fedlb.deploy import ConfigError
from tests.reliability_helpers import runner, said


# ---- TLS files that no silo would accept are refused before a SuperLink starts -------------
def test_server_certificates_silos_would_refuse_are_refused_up_front(tmp_path):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    from fedlb.deploy import ServerSettings
    from fedlb.security import TlsError, make_certificates

    good = make_certificates(tmp_path / "good", ["127.0.0.1", "localhost"])
    good.check("127.0.0.1")
    good.check("0.0.0.0")  # a wildcard address: names not checked
    with pytest.raises(TlsError, match=r"not 10\.1\.2\.3.*--host 10\.1\.2\.3"):
        good.check("10.1.2.3")
    other = make_certificates(tmp_path / "other", ["127.0.0.1"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ca.crt").write_bytes(other.ca.read_bytes())  # another federation's CA
    (mixed / "server.crt").write_bytes(good.cert.read_bytes())
    (mixed / "server.key").write_bytes(good.key.read_bytes())
    result = runner.invoke(
        app, ["server", "--certs", str(mixed), "--num-silos", "1", "--port", "0"]
    )
    assert result.exit_code == 2
    assert "was not signed by" in said(result)
    (mixed / "ca.crt").write_bytes(good.ca.read_bytes())
    (mixed / "server.key").write_bytes(other.key.read_bytes())  # another certificate's key
    with pytest.raises(ConfigError, match="is not the key of"):
        ServerSettings.from_mapping({"certs": str(mixed)})
    # expired: the same certificate re-signed with a validity that ended yesterday
    from cryptography.hazmat.primitives import serialization

    ca_key = serialization.load_pem_private_key((tmp_path / "good" / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate(good.cert.read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    expired = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(cert.issuer)
        .public_key(cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, False
        )
        .sign(ca_key, hashes.SHA256())
    )
    (mixed / "server.crt").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    (mixed / "server.key").write_bytes(good.key.read_bytes())
    with pytest.raises(ConfigError, match="not now: make new certificates"):
        ServerSettings.from_mapping({"certs": str(mixed)})


def test_a_batch_no_silo_can_fill_is_refused_before_anything_starts(tmp_path):
    """Before: --batch-size 1000000000 was accepted, each silo's ClientApp grew to ~7 GB."""
    for flags, limit in (
        (["--batch-size", "1000000000"], "batch-size 1000000000 is more than any silo's"),
        (["--max-batch", "1000000000"], "max-batch 1000000000 is more than the federation's"),
    ):
        out = tmp_path / flags[0].strip("-")
        result = runner.invoke(app, ["server", "--port", "0", "--out-dir", str(out), *flags])
        assert result.exit_code == 2, result.output
        assert limit in said(result)
        assert "give " in said(result)
        assert not out.exists()


def test_a_folder_that_cannot_be_made_is_one_line_with_its_path():
    """Before: a traceback. /proc refuses new folders even to root (os.access says yes)."""
    import errno
    import subprocess
    import sys

    from fedlb.cli.common import file_error

    for command in (
        ["server", "--port", "0", "--out-dir"],
        ["experiment", "--rounds", "1", "--out"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "fedlb.cli", *command, "/proc/fedlb-no-such-folder"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        text = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1, text
        assert "fedlb stopped: /proc/fedlb-no-such-folder" in text
        assert "Traceback" not in text
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/rounds.jsonl")
    assert file_error(full).startswith("the disk is full at /data/run/rounds.jsonl")
    read_only = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x")
    assert "read-only filesystem" in file_error(read_only)
