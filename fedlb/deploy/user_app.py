"""A user's own Flower app, deployed by `fedlb server --app DIR` and `fedlb silo --app DIR`.

The server submits the app as `flwr run DIR --run-config ...` would (its pyproject.toml's
[tool.flwr.app], built into a FAB by Flower's own builder), with the run's out-dir in
the ServerApp's environment (`RUN_DIR_ENV`; `RESUME_ENV` too when it goes on after a
stop): a `LoadBalanced` strategy given no reporter of its own keeps rounds.jsonl, its
checkpoints and summary.json there (fedlb.flower.run_dir). What the run was started with
(the app's folder, the FAB's digest, the run-config overrides, the silos waited for) is
kept in the out-dir's app.json, from which `--resume` goes on with the same app.

A silo's SuperNode runs the ClientApp from the FAB the server submits, as Flower always
does; its warm server imports the app's clientapp module from DIR once, before the
first message, so every forked ClientApp finds it imported (fedlb.deploy.warm).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlb import _flower_internals as flower
from fedlb._markup import visible
from fedlb.security import StoredFileError, read_json

from .run_config import ConfigError, read_toml

# The environment a user's ServerApp reads (fedlb.flower.run_dir's RUN_DIR_ENV and
# RESUME_ENV: the same names, checked by tests/test_deploy_user_app.py).
RUN_DIR_ENV = "FEDLB_RUN_DIR"
RESUME_ENV = "FEDLB_RESUME"
APP_FILE = "app.json"  # in the out-dir: the app a run was started with
IMPORT_TIMEOUT_S = 60.0  # an app's import, tried to say why Flower cannot find its app
# fedlb's run settings that still mean something for a user's app: the silos the server
# waits for before it submits the app, and where the results go.
APP_RUN_SETTINGS = frozenset({"num-silos", "out-dir"})
# How Flower's templates and examples name their rounds (shown on the live page only;
# the run's own checkpoint says how many rounds it plans).
ROUNDS_KEYS = ("num-server-rounds", "num-rounds")


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A TOML table's keys as Flower flattens them ("a.b" for a nested table)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(_flat(value, name))
        else:
            flat[name] = value
    return flat


@dataclass(frozen=True)
class UserApp:
    """A Flower app in `folder`: its components and run config, and the overrides a run
    gives it (Flower's `--run-config`, parsed)."""

    folder: Path
    serverapp: str  # "package.module:attr"
    clientapp: str
    config: dict[str, Any]  # [tool.flwr.app.config], flattened as Flower does
    overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(
        cls, folder: Path | str, run_config: str = "", overrides: Mapping[str, Any] | None = None
    ) -> UserApp:
        """The app in `folder` with `run_config` (Flower's "k=v k2=v2" text) or already
        parsed `overrides`; a ConfigError, naming the file or key and what to do, for a
        folder that holds no Flower app or an override the app has no key for."""
        try:
            where = Path(folder).expanduser().resolve()
        except (OSError, RuntimeError) as error:  # pathlib: RuntimeError for a link loop
            raise ConfigError(
                f"app {folder}: cannot be followed ({error}); give the folder of your Flower "
                "app (the one holding its pyproject.toml)"
            ) from None
        if not where.is_dir():
            raise ConfigError(
                f"app {folder}: no such folder; give the folder of your Flower app (the one "
                "holding its pyproject.toml)"
            )
        project = where / "pyproject.toml"
        if not project.is_file():
            raise ConfigError(
                f"app {folder}: no pyproject.toml in it; give the folder of your Flower app "
                "(`flwr new` makes one)"
            )
        data = read_toml(project, "the app's pyproject.toml")
        app = data.get("tool", {}).get("flwr", {}).get("app", {})
        components = app.get("components", {}) if isinstance(app, dict) else {}
        refs = {}
        for part in ("serverapp", "clientapp"):
            ref = components.get(part) if isinstance(components, dict) else None
            if not isinstance(ref, str) or ":" not in ref or not ref.split(":")[0]:
                raise ConfigError(
                    f"{project}: [tool.flwr.app.components] needs {part} = "
                    f'"package.module:attribute" (e.g. "{part}.py"\'s app), got {ref!r}'
                )
            refs[part] = ref
        config = app.get("config", {}) if isinstance(app, dict) else {}
        config = _flat(config) if isinstance(config, dict) else {}
        given = dict(overrides or {}) if overrides is not None else parse_run_config(run_config)
        unknown = sorted(set(given) - set(config))
        if unknown:
            raise ConfigError(
                f"run-config {', '.join(unknown)}: not in the app's [tool.flwr.app.config] "
                f"({project}), so Flower would refuse the run; the app's keys: "
                + (", ".join(sorted(config)) or "none")
            )
        return cls(where, refs["serverapp"], refs["clientapp"], config, given)

    @property
    def clientapp_module(self) -> str:
        """The module a silo's warm server imports once: the clientapp's."""
        return self.clientapp.split(":", 1)[0]

    @property
    def run_config(self) -> dict[str, Any]:
        """The run config the app's ServerApp and ClientApps see: its defaults, overridden."""
        return {**self.config, **self.overrides}

    @property
    def num_rounds(self) -> int | None:
        """The rounds the app's run config names under a usual key (None: none of them)."""
        for key in ROUNDS_KEYS:
            value = self.run_config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    def fab_digest(self) -> str:
        """The sha256 of the FAB Flower builds from the folder (what the SuperLink keys the
        run's app by): equal on the server and a silo when their copies are the same.
        A ConfigError where Flower refuses to build it."""
        try:
            return hashlib.sha256(flower.build_fab(self.folder)).hexdigest()
        except (ValueError, OSError) as error:
            raised = self.import_error() if "Unable to find attribute" in str(error) else ""
            if raised:  # what the operator must fix, before Flower's static finding
                raise ConfigError(
                    f"the Flower app in {self.folder} cannot be built: {raised} (Flower's "
                    f"check, which reads the module without running it: {_first(error)})"
                ) from None
            raise ConfigError(f"the Flower app in {self.folder} cannot be built: {error}") from None
        except Exception as error:  # Flower's check imports the app's package: its error
            raise ConfigError(
                f"the Flower app in {self.folder} cannot be built: importing its package "
                f"raised {type(error).__name__}: {visible(error)}; fix the app (python -c 'import "
                f"{self.serverapp.split(':')[0]}' in its folder shows the traceback)"
            ) from None

    def import_error(self) -> str:
        """What importing the app's serverapp and clientapp modules raises, in a process
        of its own ('' : nothing). Flower's check reads a module without running it, so
        a module that raises before it defines `app` (or never does) is said to lack
        the attribute; the error it raises is what the operator needs."""
        for module in dict.fromkeys(ref.split(":")[0] for ref in (self.serverapp, self.clientapp)):
            try:
                tried = subprocess.run(
                    [sys.executable, "-c", f"import {module}"],
                    cwd=self.folder,
                    capture_output=True,
                    text=True,
                    timeout=IMPORT_TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return f"nothing within {IMPORT_TIMEOUT_S:.0f} s: importing {module} hangs"
            lines = [line for line in tried.stderr.splitlines() if line.strip()]
            if tried.returncode != 0 and lines:
                return f"importing {module} raises {visible(lines[-1].strip())}"
        return ""

    def env(self, out_dir: Path, resume: Path | None) -> dict[str, str]:
        """What a SuperLink running this app needs in its environment (its ServerApps
        inherit it): the run's folder, and where to go on from."""
        env = {RUN_DIR_ENV: str(out_dir)}
        if resume is not None:
            env[RESUME_ENV] = str(resume)
        return env

    def keep(self, out_dir: Path, num_silos: int) -> None:
        """Write out_dir/app.json: what `--resume` goes on with."""
        kept = {
            "app": str(self.folder),
            "fab-sha256": self.fab_digest(),
            "run-config": self.overrides,
            "num-silos": num_silos,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / APP_FILE).write_text(json.dumps(kept, indent=2))

    def changed_since(self, out_dir: Path) -> str | None:
        """Why the app is not the one the run in `out_dir` started with, in words (None:
        the same FAB; a run's app code may change between a stop and its resume, which
        is said, not refused: a fixed bug is a reason to resume)."""
        kept = read_kept(out_dir)
        if kept.get("fab-sha256") == self.fab_digest():
            return None
        return (
            f"the app in {self.folder} changed since the run started (its FAB's sha256 is "
            f"not {str(kept.get('fab-sha256'))[:12]}... any more): the run goes on with the "
            "app as it is now"
        )


def parse_run_config(text: str) -> dict[str, Any]:
    """Flower's `--run-config` text ("k=v k2='s'" or an overrides .toml file), as Flower
    parses it; a ConfigError in Flower's words for text it cannot read."""
    if not text.strip():
        return {}
    try:
        parsed = flower.parse_config(text)
    except Exception as error:  # Flower's ClickException, a .toml file it cannot read
        why = error.format_message() if hasattr(error, "format_message") else str(error)
        raise ConfigError(f"run-config {text!r}: {why}") from None
    if not parsed:
        raise ConfigError(
            f"run-config {text!r} sets nothing: give key=value pairs separated by spaces, "
            'e.g. "num-server-rounds=5 learning-rate=0.01" (strings in quotes)'
        )
    return parsed


APP_FILE_BYTES = 2**20  # an app's folder and its run-config overrides


def read_kept(out_dir: Path) -> dict[str, Any]:
    """out_dir/app.json ({}: none, a run of fedlb's own app); a ConfigError naming it and
    what to do where it is damaged."""
    path = out_dir / APP_FILE
    try:
        kept = read_json(path, max_bytes=APP_FILE_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, StoredFileError) as error:  # too large, not UTF-8, not JSON, too deep
        why = error.reason if isinstance(error, StoredFileError) else error.strerror or error
        raise ConfigError(
            f"{path} is damaged ({why}): it names the app the run was started with; "
            "restore it, or start a new run"
        ) from None
    if not (
        isinstance(kept, dict)
        and isinstance(kept.get("app"), str)
        and isinstance(kept.get("run-config"), dict)
        and isinstance(kept.get("num-silos"), int)
    ):
        raise ConfigError(
            f"{path} is damaged (not an app, run-config and num-silos): it names the app "
            "the run was started with; restore it, or start a new run"
        )
    return kept


def kept_app(out_dir: Path) -> tuple[UserApp, int] | None:
    """The app (and the silos waited for) the run in `out_dir` was started with; None for
    a run of fedlb's own app."""
    kept = read_kept(out_dir)
    if not kept:
        return None
    app = UserApp.read(kept["app"], overrides=kept["run-config"])
    return app, int(kept["num-silos"])


def same_app(given: str, run_config: str, kept: UserApp) -> bool:
    """Whether `--app given --run-config run_config` names the app a run keeps."""
    try:
        same_folder = os.path.samefile(Path(given).expanduser(), kept.folder)
    except OSError:
        return False
    return same_folder and parse_run_config(run_config) == kept.overrides


def _first(error: Exception) -> str:
    """Flower's finding in one line: its list's first item."""
    found = [line.strip("- ").strip() for line in str(error).splitlines() if line.startswith("- ")]
    return found[0] if found else str(error).splitlines()[0]
