"""Flower's console scripts (flower-supernode, flwr-clientapp, flwr, ray, ...), found as
the user's shell finds them, and which file runs said once.

fedlb started them from the folder of `sys.executable` only. With Flower installed
elsewhere (`pip install --target DIR` with DIR/bin on PATH, a system Python whose scripts
are in ~/.local/bin) a cold silo failed at once, although the user's shell found
`flower-supernode`. Here a script is this Python's own where its folder has one (a
virtual environment: the Flower this fedlb imports), else the first on PATH
(`shutil.which`), and the log says which file runs, once per process and file.

Flower starts its own helpers by name from PATH (a SuperNode or SuperLink runs
`flower-superexec`, which runs `flwr-clientapp` or `flwr-serverapp`); their processes get
this Python's folder first on PATH (`processes.flower_env`), so they find the same files
this module does. The warm path runs Flower's entry points inside fedlb's own processes
(`python -m fedlb.deploy.warm ... -- flower-supernode ARGS`) and needs no file but for
its cold fallback (fedlb.deploy.fork_safety).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import DeployError

log = logging.getLogger("fedlb.flower")
_SAID: set[tuple[str, str]] = set()  # (script, how it runs) said in this process's log


class MissingScriptError(DeployError):
    """A console script that is neither in this Python's folder nor on PATH."""


def bin_dir() -> Path:
    """This Python's folder: a virtual environment's console scripts are there."""
    return Path(sys.executable).parent


def find_script(name: str) -> Path | None:
    """The file `name` runs: this Python's own (bin_dir) if it has one, else the first on
    PATH, as a shell finds it; None where neither has it."""
    own = bin_dir() / name
    if own.is_file() and os.access(own, os.X_OK):
        return own
    found = shutil.which(name)
    return Path(found) if found else None


def console_script(name: str, needed_for: str = "") -> Path:
    """`find_script(name)`, said in the log the first time this process uses that file;
    MissingScriptError saying what to do where there is none (`needed_for`: why it is needed)."""
    return console_scripts((name,), needed_for)[0]


def console_scripts(names: Sequence[str], needed_for: str = "") -> list[Path]:
    """`console_script` of each of `names`, all looked for before anything starts: a
    MissingScriptError names every one missing."""
    found = {name: find_script(name) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        why = f" ({needed_for})" if needed_for else ""
        listed = ", ".join(f"`{name}`" for name in missing)
        scripts = "console script" if len(missing) == 1 else "console scripts"
        raise MissingScriptError(
            f"Flower's {scripts} {listed} not found{why}: neither in this Python's folder "
            f"({bin_dir()}) nor on PATH. Install Flower for this Python "
            f"({sys.executable} -m pip install 'flwr>=1.41,<1.43'), or put the folder that "
            "holds its console scripts on PATH (after `pip install --target DIR`: DIR/bin)"
        )
    paths = []
    for name, path in found.items():
        assert path is not None  # none missing
        _say(name, f"from {path} (found {_where(path)})")
        paths.append(path)
    return paths


def say_in_process(name: str) -> None:
    """Say, once, that Flower's `name` runs inside fedlb's own process (the warm path),
    and which Flower that is: no console script runs."""
    import flwr

    version = getattr(flwr, "__version__", "?")
    _say(
        name,
        f"inside fedlb's own process ({sys.executable}; flwr {version} from "
        f"{Path(flwr.__file__ or '').parent}), not as a console script",
    )


def _where(path: Path) -> str:
    return "in this Python's folder" if path.parent == bin_dir() else "on PATH"


def _say(name: str, how: str) -> None:
    if (name, how) not in _SAID:
        _SAID.add((name, how))
        log.info("fedlb runs Flower's %s %s", name, how)
