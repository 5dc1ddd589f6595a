"""`--app DIR` that cannot be an app (issue 56, item 6), on the real commands: a folder
that is a symlink loop, and an app whose server module raises when imported. Each is one
clear line, exit 2, no traceback, before anything starts; the import's own error is
said, not Flower's static "Unable to find attribute app"."""

from __future__ import annotations

import subprocess

import pytest

from fedlb.deploy import ConfigError
from fedlb.deploy.user_app import UserApp
from tests.apps.adopt import adopt
from tests.test_stored_not_regular import fedlb


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    shown = result.stdout + result.stderr
    assert result.returncode == 2, shown
    assert "Traceback" not in shown
    return " ".join(shown.replace("│", " ").split())


def test_a_symlink_loop_as_app_is_one_line_for_the_server_and_a_silo(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for command in (
        ["server", "--app", str(loop)],
        ["silo", "--app", str(loop), "--partition-id", "0", "--num-partitions", "3"],
    ):
        said = one_line(fedlb(*command))
        assert f"app {loop}: cannot be followed (Symlink loop" in said, said


def test_an_app_whose_import_raises_is_said_with_the_error_it_raised(tmp_path):
    app, _ = adopt("quickstart_pytorch", tmp_path / "a")
    (app / "pytorchexample" / "server_app.py").write_text('raise RuntimeError("boom\\x1b[31m")\n')
    said = one_line(fedlb("server", "--app", str(app)))
    assert "importing pytorchexample.server_app raises RuntimeError: boom\\x1b[31m" in said, said
    assert "\x1b[31m" not in said
    package, _ = adopt("quickstart_pytorch", tmp_path / "b")
    init = package / "pytorchexample" / "__init__.py"
    init.write_text(init.read_text() + '\nraise RuntimeError("package boom")\n')
    with pytest.raises(ConfigError, match="importing its package raised RuntimeError: package"):
        UserApp.read(package).fab_digest()
