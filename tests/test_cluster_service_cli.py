"""`fedlb manager`'s command and its security: bad options are usage errors, port 0 prints
the port it got and SIGTERM stops it; a token is required when the service has one, TLS
with fedlb certs' files, bad tokens and certificates are clear errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fedlb.cli import app
from fedlb.cluster import ManagerClient
from fedlb.cluster.service import serve
from fedlb.cluster.service_auth import TOKEN_ENV, ManagerSetupError, read_token
from tests.cluster_service_helpers import (
    TOKEN,
    _no_token_in_the_environment,  # noqa: F401 (autouse)
    flat,
    refused,
    runner,
    running,
)

# 7. The command's options.


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-workers", "0"], "--max-workers must be >= 1, got 0"),
        (["--max-jobs", "0"], "--max-jobs must be >= 1, got 0"),
        (["--max-job-workers", "-3"], "--max-job-workers must be >= 1, got -3"),
        (["--port", "70000"], "--port must be in 0..65535 (0: a free port), got 70000"),
        (["--wait-timeout", "0"], "--wait-timeout must be a number of seconds > 0, got 0.0"),
        (["--wait-timeout", "nan"], "--wait-timeout must be a number of seconds > 0, got nan"),
        (["--job-idle-timeout", "-1"], "--job-idle-timeout must be a number of seconds > 0"),
    ],
)
def test_bad_manager_options_are_usage_errors(flags, says):
    result = runner.invoke(app, ["manager", *flags])
    assert result.exit_code == 2, result.output
    assert says in flat(result.output)
    assert "Traceback" not in result.output


def test_the_cli_on_port_0_prints_the_port_it_got_and_stops_on_sigterm(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    command = [sys.executable, "-m", "fedlb.cli", "manager", "--port", "0"]
    env = {**os.environ, "COLUMNS": "200"}
    manager = subprocess.Popen(
        [*command, "--token-file", str(token_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert manager.stdout is not None
        first = manager.stdout.readline()
        found = re.search(r"fedlb manager on 127\.0\.0\.1:(\d+)", first)
        assert found, first
        guards = manager.stdout.readline()
        assert "token on, TLS off" in guards
        from fedlb.balance import defaults  # the manager says what "default" means

        assert defaults.controller() in manager.stdout.readline()
        client = ManagerClient(f"127.0.0.1:{found.group(1)}", timeout=5, token=TOKEN)
        assert client.register("j", ["a"], 4) == {"a": 4}
        client.close()
        manager.send_signal(signal.SIGTERM)
        manager.wait(timeout=20)
        # Read through the same buffered reader as readline() above:
        # communicate() reads the raw pipe and would miss what that reader holds.
        output = manager.stdout.read()
    finally:
        if manager.poll() is None:
            manager.kill()
    assert manager.returncode == 0, output
    assert "fedlb manager stopped" in output


# 8. A token, TLS.


def test_a_token_is_required_when_the_service_has_one():
    with running(token=TOKEN) as (address, _):
        for token in (None, "x" * 32):
            client = ManagerClient(address, timeout=5, token=token)
            error = refused(lambda c=client: c.register("j", ["a"], 8))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "this manager wants a token" in error.details()
            client.close()
        client = ManagerClient(address, timeout=5, token=TOKEN)
        assert client.register("j", ["a"], 8) == {"a": 8}
        assert client.report("j", "a", 1, 8, 0.1) == 8
        client.close()


def test_the_client_takes_the_token_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with running(token=TOKEN) as (address, _):
        client = ManagerClient(address, timeout=5)
        assert client.register("j", ["a"], 8) == {"a": 8}
        client.close()


def test_tls_with_the_files_of_fedlb_certs(tmp_path):
    from fedlb.security import make_certificates

    files = make_certificates(tmp_path, ["127.0.0.1"])
    with running(token=TOKEN, tls=(files.cert, files.key)) as (address, _):
        client = ManagerClient(address, timeout=5, token=TOKEN, root_certificates=files.ca)
        assert client.register("j", ["a"], 8) == {"a": 8}
        client.close()
        plain = ManagerClient(address, timeout=2, token=TOKEN)
        assert refused(lambda: plain.register("j", ["a"], 8)).code() == (
            grpc.StatusCode.UNAVAILABLE
        )
        plain.close()


def test_bad_tokens_and_certificates_are_clear_errors(tmp_path):
    with pytest.raises(ManagerSetupError, match="cannot read the token file"):
        read_token(tmp_path / "missing")
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ManagerSetupError, match="at least 16 printable ASCII characters"):
        read_token(tmp_path / "short")
    assert read_token(None, {TOKEN_ENV: f" {TOKEN}\n"}) == TOKEN
    assert read_token(None, {}) is None
    pair = (tmp_path / "server.crt", tmp_path / "server.key")
    with pytest.raises(ManagerSetupError, match="cannot read the TLS key"):
        serve(0, tls=pair)
    for path in pair:
        path.write_text("not PEM")
    with pytest.raises(ManagerSetupError, match="unusable TLS files"):
        serve(0, tls=pair)
    result = runner.invoke(app, ["manager", "--port", "0", "--token-file", str(Path("/nope"))])
    assert result.exit_code == 2
    assert "cannot read the token file /nope" in flat(result.output)
