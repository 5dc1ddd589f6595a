"""A child forked to run a function, with the part of `subprocess.Popen`'s face the warm
launcher uses (poll, wait, send_signal, terminate, kill, returncode).

The warm launcher imports what its children share once and forks them, instead of
starting each as a new Python that imports it all again (flwr alone is ~1.4 s of CPU).
Fork only from a process without threads of its own: a child gets one thread, and a lock
another thread held at the fork stays held in the child. A process that imported torch
forks only with fedlb.deploy.fork_safety armed: no CUDA context, no autograd, one
intra-op thread in it, and torch handed back whole to each child right after the fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

PR_SET_NAME = 15  # Linux prctl: the process's name, as `ps -o comm` and psutil's name() show it


def name_process(name: str) -> None:
    """Give this process a name of its own (Linux; up to 15 bytes): a fork's command line
    is its parent's, its name tells them apart."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class Forked:
    """`target()` in a forked child named `name`; its return value (or SystemExit's code)
    is the child's exit code, an exception's traceback goes to stderr and exits 1.
    `own_logging`: the child keeps the parent's root log handlers (False: none, as a fresh
    Python has; a program that configures its own logging then writes each line once)."""

    def __init__(
        self, target: Callable[[], int | None], name: str, own_logging: bool = False
    ) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                name_process(name)
                # the parent's handlers are the parent's: a fresh process has the defaults
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                root = logging.getLogger()
                for handler in [] if own_logging else list(root.handlers):
                    root.removeHandler(handler)
                result = target()
                code = result if isinstance(result, int) else 0
            except SystemExit as leaving:
                code = leaving.code if isinstance(leaving.code, int) else (1 if leaving.code else 0)
            except KeyboardInterrupt:
                code = 130
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
