"""The warm silo path: a SuperNode whose ClientApps start warm.

Flower 1.42 runs every message a silo receives in a fresh `flwr-clientapp` process: it
waits for the SuperExec's next task poll (1 s), starts Python, imports flwr (~1.4 s),
the app and torch (~1.7 s), and pays torch's first-use costs (~1 s) before the first
training step (`../shared/notes/flower-1.42-wallclock.md`). On a cross-silo round that
is 4-5 s per silo per round, on the critical path of every balanced round.

Here a silo's SuperNode runs with `--isolation process` and this module takes the
SuperExec's place. One long-lived process (`serve`) imports torch, flwr's ClientApp
runtime and fedlb's silo once, warms torch up, then polls the SuperNode for tasks every
`POLL_S` and forks itself per task: the child runs Flower's own `run_clientapp` (pull
the message, install the FAB, load the app, call it, push the reply, exit) with every
import already done. One process per message keeps Flower's isolation (a crash, a leak
or a module-level global of one message does not reach the next; a fresh FAB loads
fresh), and costs a fork (milliseconds) instead of a start.

Security: the runtime API listens on loopback only, and the SuperNode hands out tasks
(AcquireTask) only to a caller that signs with the silo's SuperExec secret (Flower's
HMAC, `--superexec-auth-secret-file`): a file of the silo's own user, mode 0600. Each
task's calls then carry the task's own token, as with Flower's executor.

Lifetimes: `python -m fedlb.deploy.warm --runtime-api-address A --secret-file F --
flower-supernode ...` (what `start_supernode(warm=True)` runs, in the silo's process
group under fedlb's guard) starts the SuperNode and the warm server, restarts the
server if it dies (saying so; the message in flight fails as a ClientApp crash does,
and the next one is served), and exits with the SuperNode's code when it exits. The
server exits when the launcher does (Flower's parent-process monitor), the forked
ClientApps when the server does.

Flower behaviours relied on (tests/test_warm_silo.py checks each on real processes, so
a Flower upgrade that changes one fails a test, not a run):
- `flower-supernode --isolation process --superexec-auth-secret-file F` serves the
  runtime API for an external SuperExec and refuses AcquireTask unsigned;
- `RuntimeHttpClient.AcquireTask(AcquireTaskRequest(supported_task_types=...))` returns
  a task and its token, signed by `SuperExecAuthHttpInterceptor`;
- `run_clientapp(runtime_api_address, token, insecure, certificates, parent_pid)` runs
  one task to its end and leaves through `flwr_exit` (SystemExit);
- it pulls the message through its module's `pull_and_inflate_object_from_tree`, which
  takes `initial_backoff` (fast_object_pulls shortens it);
- the SuperNode's loop (`flwr.supernode.start_client_internal`) sleeps `time.sleep(3)`
  when a pull finds no message and `time.sleep(0.5)` while it waits for a reply or an
  object's content, and pulls a message's objects from the SuperLink through its
  module's `pull_objects`, which takes `initial_backoff` (prompt_supernode shortens all
  three; see below).

The SuperNode prompt: after each reply a SuperNode pulls once, finds nothing yet (the
server is still aggregating) and sleeps 3 s, so the next round reached it 1.5-3 s late,
on every balanced round's critical path. The launcher runs Flower's own `flower-supernode`
entry point in a process of ours whose SuperNode loop sleeps `IDLE_PULL_S` instead (a
pull is one small request to the SuperLink: 5 a second per silo is nothing for a
cross-silo federation; `--idle-pull 3` restores Flower's pace).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

POLL_S = 0.1  # task poll: one process polls, so a short interval costs little CPU
PRELOAD = ("torch", "flwr.supernode.runtime.run_clientapp", "fedlb.deploy.client_app")
RESTART_PAUSE_S = 1.0
RESTARTS_IN_A_ROW = 5  # a server dying this often right after its start cannot start here
# Flower pulls a message's objects from its SuperNode with a backoff that starts at 1 s;
# the SuperNode has them a few ms after it announces the message, so the first retry
# cost ~1 s a round. Ours start at this.
PULL_BACKOFF_S = 0.02
ACQUIRE_TASK = "/flwr.proto.Runtime/AcquireTask"  # the SuperExec-signed method
IDLE_PULL_S = 0.2  # the SuperNode's pause after a pull that found no message (Flower: 3 s)
REPLY_WAIT_S = 0.05  # its pause while a reply or an object is not there yet (Flower: 0.5 s)
SUPERNODE_SLEEPS = (3, 0.5)  # Flower 1.42's fixed pauses in that loop, idle and reply

log = logging.getLogger("fedlb.warm")


def unsupported() -> str | None:
    """Why this Flower cannot run a silo warm (None: it can): the warm path drives the
    runtime API of Flower 1.42's process isolation."""
    try:
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor  # noqa: F401
        from flwr.supernode.runtime import run_clientapp as runtime
    except ImportError as error:
        return f"this Flower lacks its runtime API for an external SuperExec ({error})"
    if "supported_task_types" not in AcquireTaskRequest.DESCRIPTOR.fields_by_name:
        return "this Flower's AcquireTask takes no task types"
    if not hasattr(runtime, "pull_and_inflate_object_from_tree"):
        return "this Flower's ClientApp runtime pulls messages another way"
    return None


def make_secret(path: Path) -> Path:
    """A fresh SuperExec secret in `path`, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(os.urandom(32))
    return path


class _ShortSleeps:
    """The `time` module as Flower's SuperNode loop sees it: its fixed pauses shortened,
    everything else untouched."""

    def __init__(self, shortened: dict[float, float]) -> None:
        self.shortened = shortened

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(self.shortened.get(seconds, seconds))


def prompt_supernode(idle_s: float = IDLE_PULL_S, reply_s: float = REPLY_WAIT_S) -> None:
    """Shorten the SuperNode loop's idle pause (3 s) to `idle_s`, its reply and object
    waits (0.5 s) to `reply_s`, and the first retry of its object pulls from the
    SuperLink (1 s) to PULL_BACKOFF_S, in this process."""

    from flwr.supernode import start_client_internal as loop

    idle, reply = SUPERNODE_SLEEPS
    setattr(loop, "time", _ShortSleeps({idle: idle_s, reply: reply_s}))  # noqa: B010 (a module)
    # A prompt SuperNode often holds a message before the ServerApp has pushed all of its
    # objects to the SuperLink; Flower's object pulls then retry after 1 s. Ours: sooner.
    _first_retry_after(loop, "pull_objects", PULL_BACKOFF_S)


def _supernode_main(arguments: Sequence[str]) -> int:
    """`python -m fedlb.deploy.warm node [--idle-pull S] -- ARGS`: Flower's own
    `flower-supernode ARGS`, prompt."""
    parser = argparse.ArgumentParser(prog="python -m fedlb.deploy.warm node")
    parser.add_argument("--idle-pull", type=float, default=IDLE_PULL_S)
    split = arguments.index("--") if "--" in arguments else len(arguments)
    args = parser.parse_args(arguments[:split])
    from flwr.supernode.cli import flower_supernode

    prompt_supernode(args.idle_pull, min(REPLY_WAIT_S, args.idle_pull))
    sys.argv = ["flower-supernode", *arguments[split + 1 :]]
    flower_supernode()
    return 0


def _supernode_command(supernode: Sequence[str], idle_pull_s: float) -> list[str]:
    """Flower's `flower-supernode ...` run prompt (the same Flower, through
    `_supernode_main`); any other command as given."""
    if not supernode or Path(supernode[0]).name != "flower-supernode":
        return list(supernode)
    return [
        sys.executable,
        "-m",
        "fedlb.deploy.warm",
        "node",
        "--idle-pull",
        repr(idle_pull_s),
        "--",
        *supernode[1:],
    ]


def _this_module(
    runtime_api_address: str, secret: Path, preload: Sequence[str], serving: bool = False
) -> list[str]:
    """`python -m fedlb.deploy.warm [serve]` with the options the launcher and the server
    share."""
    return [
        sys.executable,
        "-m",
        "fedlb.deploy.warm",
        *(["serve"] if serving else []),
        "--runtime-api-address",
        runtime_api_address,
        "--secret-file",
        str(secret),
        *[arg for module in preload for arg in ("--preload", module)],
    ]


def launcher_command(
    runtime_api_address: str,
    secret: Path,
    supernode: Sequence[str],
    preload: Sequence[str] = (),
    idle_pull_s: float = IDLE_PULL_S,
) -> list[str]:
    """The command that runs `supernode` (flower-supernode and its arguments) warm, its
    idle pull every `idle_pull_s`."""
    return [
        *_this_module(runtime_api_address, secret, preload),
        "--idle-pull",
        repr(idle_pull_s),
        "--",
        *isolated(supernode, secret),
    ]


def isolated(supernode: Sequence[str], secret: Path) -> list[str]:
    """`supernode` with what the warm path needs added where it is missing: Flower's
    process isolation and the SuperExec secret the warm server signs with."""
    command = list(supernode)
    if "--isolation" not in command:
        command += ["--isolation", "process"]
    if "--superexec-auth-secret-file" not in command:
        command += ["--superexec-auth-secret-file", str(secret)]
    return command


def serve(
    runtime_api_address: str,
    secret: bytes,
    parent_pid: int | None = None,
    preload: Sequence[str] = (),
    poll_s: float = POLL_S,
) -> None:
    """Import what a ClientApp needs once, then fork a warm `run_clientapp` per task."""
    started = time.perf_counter()
    for module in (*PRELOAD, *preload):
        importlib.import_module(module)
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    from fedlb.flower import warm_up_torch

    fast_object_pulls()
    warm_up_torch()
    log.info(
        "warm: %s imported and torch warmed up in %.1f s; serving ClientApp tasks of %s",
        ", ".join((*PRELOAD, *preload)),
        time.perf_counter() - started,
        runtime_api_address,
    )
    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=True,  # loopback only (start_supernode binds the runtime API there)
        root_certificates=None,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="SuperExec"),
            SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE_TASK}),
        ],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    running: dict[int, int] = {}  # child pid -> task id
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
    while True:
        _reap(running)
        reply = client.AcquireTask(request)
        if reply.HasField("task") and reply.token:
            sys.stdout.flush()
            sys.stderr.flush()
            child = os.fork()
            if child == 0:
                _run_task(runtime_api_address, reply.token, os.getppid())
            running[child] = reply.task.task_id
            continue  # another task may be waiting (a second run): no sleep
        time.sleep(poll_s)


def fast_object_pulls(backoff: float = PULL_BACKOFF_S) -> None:
    """Make Flower's ClientApp runtime retry a message's object pulls after `backoff` s
    (doubling, capped as Flower caps it) instead of 1 s."""
    from flwr.supernode.runtime import run_clientapp as runtime

    _first_retry_after(runtime, "pull_and_inflate_object_from_tree", backoff)


def _first_retry_after(module: object, name: str, backoff: float) -> None:
    """Bind `initial_backoff=backoff` to Flower's pull function that `module` imported by
    `name` (once: a second call replaces the first binding, never nests it)."""
    import functools

    pull = getattr(module, name)
    original = pull.func if isinstance(pull, functools.partial) else pull
    setattr(module, name, functools.partial(original, initial_backoff=backoff))


def _run_task(runtime_api_address: str, token: str, server_pid: int) -> None:
    """In the forked child: Flower's own ClientApp process body, then leave at once (the
    parent's atexit handlers and threads are not the child's)."""
    code = 1
    try:
        from fedlb.flower.protocol import TASK_STARTED_ENV

        os.environ[TASK_STARTED_ENV] = repr(time.time())  # the ClientApp's start, for its report
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        run_clientapp(
            runtime_api_address=runtime_api_address,
            token=token,
            insecure=True,
            certificates=None,
            parent_pid=server_pid,
        )
        code = 0
    except SystemExit as leaving:  # flwr_exit
        code = leaving.code if isinstance(leaving.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(running: dict[int, int]) -> None:
    """Collect finished ClientApps; say which ended badly (Flower reports an app's own
    exception to the server; a killed process only this says, on the silo)."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            running.clear()
            return
        if pid == 0:
            return
        task = running.pop(pid, None)
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            log.warning(
                "warm: the ClientApp of task %s (pid %d) was killed by %s; its message "
                "fails as a crashed ClientApp's does, the next one is served afresh",
                task,
                pid,
                name,
            )
        elif os.WEXITSTATUS(status) != 0:
            log.warning(
                "warm: the ClientApp of task %s (pid %d) exited with code %d (its log is above)",
                task,
                pid,
                os.WEXITSTATUS(status),
            )


def launch(
    runtime_api_address: str,
    secret_file: Path,
    supernode: Sequence[str],
    preload: Sequence[str],
    idle_pull_s: float = IDLE_PULL_S,
) -> int:
    """Run the SuperNode (prompt) and the warm server; restart the server if it dies;
    return the SuperNode's exit code."""
    node = subprocess.Popen(_supernode_command(supernode, idle_pull_s))
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        with contextlib.suppress(ProcessLookupError):
            node.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server_command = [
        *_this_module(runtime_api_address, secret_file, preload, serving=True),
        "--parent-pid",
        str(os.getpid()),
    ]
    server = subprocess.Popen(server_command)
    started, quick_deaths = time.monotonic(), 0
    try:
        while node.poll() is None:
            if server.poll() is not None and not stopping:
                quick_deaths = quick_deaths + 1 if time.monotonic() - started < 10 else 1
                if quick_deaths >= RESTARTS_IN_A_ROW:  # it cannot start here: end the silo
                    log.error(
                        "warm: the silo's warm ClientApp server died %d times in a row within "
                        "10 s of starting (last code %s); stopping the silo (its log above "
                        "says why; `--cold` runs Flower's own ClientApp processes instead)",
                        quick_deaths,
                        server.returncode,
                    )
                    node.terminate()
                    node.wait(30)
                    return 1
                log.warning(
                    "warm: the silo's warm ClientApp server exited with code %s; "
                    "restarting it (a message in flight fails as a crashed ClientApp's does)",
                    server.returncode,
                )
                time.sleep(RESTART_PAUSE_S)
                server, started = subprocess.Popen(server_command), time.monotonic()
            time.sleep(0.2)
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
    return int(node.wait())


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["node"]:
        return _supernode_main(arguments[1:])
    serving = bool(arguments) and arguments[0] == "serve"
    parser = argparse.ArgumentParser(prog="python -m fedlb.deploy.warm")
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--secret-file", type=Path, required=True)
    parser.add_argument("--preload", action="append", default=[])
    if serving:
        parser.add_argument("--parent-pid", type=int)
        args = parser.parse_args(arguments[1:])
        with contextlib.suppress(KeyboardInterrupt):  # SIGINT: its launcher is gone
            serve(
                args.runtime_api_address,
                args.secret_file.read_bytes(),
                args.parent_pid,
                args.preload,
            )
        return 0
    if "--" not in arguments:
        parser.error("give the SuperNode's command after --")
    parser.add_argument(
        "--idle-pull",
        type=float,
        default=IDLE_PULL_S,
        help="seconds the SuperNode waits after a pull that found no message (Flower's: 3)",
    )
    split = arguments.index("--")
    args = parser.parse_args(arguments[:split])
    if not args.secret_file.exists():  # a user's own SuperNode: a fresh secret of theirs
        make_secret(args.secret_file)
    return launch(
        args.runtime_api_address,
        args.secret_file,
        isolated(arguments[split + 1 :], args.secret_file),
        args.preload,
        args.idle_pull,
    )


if __name__ == "__main__":
    sys.exit(main())
