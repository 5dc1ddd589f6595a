"""Run a command for as long as the process that started it lives.

    python guard.py PARENT_PID COMMAND [ARGS...]

fedlb starts every Flower process (SuperLink, SuperNode) through this guard, as the
leader of its own process group. The guard runs the command in that group and waits;
when PARENT_PID is gone (its parent was SIGKILLed, crashed, or exited without stopping
what it started) it stops the whole group: SIGTERM, then SIGKILL after a grace period.
Flower does the same one level down (`--parent-pid` of flower-superexec, flwr-serverapp,
flwr-clientapp), but a SuperLink or SuperNode has no such option: without the guard a
killed `fedlb server` left its SuperLink finishing the run, and a killed `fedlb silo` its
SuperNode training.

Flower starts a ServerApp in a session of its own, out of the group's reach, and a
ServerApp whose SuperLink is gone may keep retrying for ever: the guard keeps a list of
every process descended from it (PID and start time, refreshed each poll) and, when it
stops, stops those too: SIGTERM, then SIGKILL after a grace period. A SIGTERM or SIGINT
to the group (FlowerProcess.stop) starts the same. The guard exits with the command's
code, so whoever stops the group can wait on the guard. Run as a file, not
`-m fedlb...`: it starts in milliseconds without importing fedlb (or torch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 8.0  # below FlowerProcess.stop's 10 s, after which it SIGKILLs the group


def parent_gone(parent: int) -> bool:
    # Reparented (to init or a subreaper) means the parent died, even if its PID was reused.
    if os.getppid() != parent:
        return True
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Descendants:
    """Every process started below the guard, kept by (PID, start time): one that left
    the process group, or whose parent died, is still found."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def refresh(self) -> None:
        try:
            for process in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen[process.pid] = process.create_time()
        except psutil.Error:
            pass

    def alive(self) -> list[psutil.Process]:
        found = []
        for pid, started in list(self.seen.items()):
            try:
                process = psutil.Process(pid)
                if process.create_time() == started and process.status() != "zombie":
                    found.append(process)
                    continue
            except psutil.Error:
                pass
            del self.seen[pid]
        return found

    def stop(self, child: subprocess.Popen[bytes]) -> None:
        """SIGTERM to all, SIGKILL to what is left after GRACE_S; the child reaped."""
        self.refresh()
        for process in self.alive():
            with contextlib.suppress(psutil.Error):
                process.terminate()
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and (child.poll() is None or self.alive()):
            time.sleep(0.1)
        for process in self.alive():
            with contextlib.suppress(psutil.Error):
                process.kill()
        child.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: guard.py PARENT_PID COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    stopping = False

    def on_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    child = subprocess.Popen(argv[1:])
    descendants = Descendants()
    while True:
        descendants.refresh()
        if stopping:  # the group was told to stop: see that all below stop too
            descendants.stop(child)
            return child.returncode
        code = child.poll()
        if code is not None:
            descendants.stop(child)  # what it left behind (usually nothing)
            return code
        if parent_gone(parent):
            print(
                f"fedlb guard: process {parent}, which started this one, is gone: stopping "
                f"{os.path.basename(argv[1])} (pid {child.pid}) and its children",
                file=sys.stderr,
                flush=True,
            )
            descendants.stop(child)
            return child.returncode
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
