"""The warm path: a SuperNode whose ClientApps start warm, a SuperLink whose ServerApps do.

Flower 1.42 runs every message a silo receives in a fresh `flwr-clientapp` process: it
waits for the SuperExec's next task poll (1 s), starts Python, imports flwr (~1.4 s),
the app and torch (~1.7 s), and pays torch's first-use costs (~1 s) before the first
training step (`../shared/notes/flower-1.42-wallclock.md`). On a cross-silo round that
is 4-5 s per silo per round, on the critical path of every balanced round.

Here a silo's SuperNode runs with `--isolation process` and this module takes the
SuperExec's place. One long-lived process (`serve`) imports torch, flwr's ClientApp
runtime and fedlb's silo once, warms torch up without autograd, then polls the SuperNode
for tasks every `POLL_S` and forks itself per task: the child runs Flower's own
`run_clientapp` (pull the message, install the FAB, load the app, call it, push the
reply, exit) with every import already done. One process per message keeps Flower's
isolation (a crash, a leak or a module-level global of one message does not reach the
next; a fresh FAB loads fresh), and costs a fork (milliseconds) instead of a start.

A GPU silo (`--resident`, the default where a silo trains on a GPU: decided by the
process that starts the silo, never here) runs its tasks instead in one resident worker
(fedlb.deploy.resident): a child forked once, at the same fork-safe point, that runs
Flower's `run_clientapp` task after task and so keeps its CUDA context and model
between rounds (a fresh fork paid ~0.5 s a round for them on an H200 machine). It gives
up the isolation of one message from the next; a worker lost mid-task fails that task at
once, and the next gets a fresh worker.

Fork safety (fedlb.deploy.fork_safety): a process that forks ClientApps must never create
a CUDA context nor run autograd (PyTorch's fork rules: on a CUDA build with a GPU, the
old warm-up's one backward made every forked ClientApp fail, GPU and CPU silos alike:
`../shared/notes/gpu-h200-federation.md`), nor run torch on several intra-op threads (a
child then hangs). The launcher and the server arm a tripwire right after importing
torch, warm up without autograd, and check before every fork; a server that finds torch
used anyway (a --preload module that trains at import) says why in the silo's log and
runs each task in Flower's own `flwr-clientapp` process (fedlb.deploy.warm_tasks), as
`--cold` does: slower, never a lost round. The forked child gets torch back as a fresh
process has it and pays its own first backward (~3 ms on a CPU-only build, ~0.2 s on
an H200 machine's CUDA build: docs/flower/framework-time.md, "Fork safety").

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
ClientApps when the server does. The launcher starts both as forks of itself
(fedlb.deploy.forked, named `fedlb-node` and `fedlb-warm`): it imports Flower's entry
point and forks the SuperNode, then imports torch, arms the tripwire, imports the app
and forks the server, so
what they share is imported once (a new Python for each imported flwr twice: ~1.4 s of
CPU per silo) and a restarted server is a fork too.

The warm ServerApp: a SuperLink pays the same start per run (its SuperExec polls once a
second, then a fresh `flwr-serverapp` imports flwr, torch and the app: ~3 s before the
first round's messages). `--task serverapp` serves a SuperLink the same way: its
`--isolation process`, the same HMAC secret, a fork per run running Flower's own
`run_serverapp` with its output mirrored to the run's log (what `flwr log` shows).
`--task simulation` does the same for a simulation SuperLink's runs (`flwr-simulation`'s
`run_simulation_process`; Ray is imported once and each run's fork connects to it).

Flower behaviours relied on (each in fedlb._flower_internals, checked by name in
tests/test_flower_internals_*.py; tests/test_warm_silo.py runs them on real processes, so a
Flower upgrade that changes one fails a test, not a run):
- `flower-supernode` and `flower-superlink` `--isolation process
  --superexec-auth-secret-file F` serve the runtime API for an external SuperExec and
  refuse AcquireTask unsigned;
- `RuntimeHttpClient.AcquireTask(AcquireTaskRequest(supported_task_types=...))` returns
  a task and its token, signed by `SuperExecAuthHttpInterceptor`;
- `run_clientapp(runtime_api_address, token, insecure, certificates, parent_pid)` runs
  one task to its end and leaves through `flwr_exit` (SystemExit);
- `run_serverapp(runtime_api_address, log_queue, token, insecure, certificates,
  parent_pid, runtime_dependency_install)` does the same for a ServerApp, what
  `flwr-serverapp` runs after `mirror_output_to_queue(log_queue)`, and
  `run_simulation_process` (the same parameters) what `flwr-simulation` runs;
- the ClientApp runtime's object pulls take `initial_backoff` (fedlb.deploy.prompt).
The SuperNode itself runs prompt (fedlb.deploy.prompt).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fedlb import _flower_internals as flower

from . import fork_safety
from .forked import Forked
from .prompt import IDLE_PULL_S, fast_object_pulls, node_entry, supernode_command
from .resident import ResidentWorker
from .warm_tasks import (
    CLIENTAPP,
    SERVERAPP,
    SIMULATION,
    TASK_TYPES,
    TaskStarter,
    reap,
    report_failed,
)

POLL_S = 0.1  # task poll: one process polls, so a short interval costs little CPU
PRELOAD = {  # what each kind imports once, before its first task
    CLIENTAPP: ("torch", flower.CLIENTAPP_RUNTIME, "fedlb.deploy.client_app"),
    SERVERAPP: ("torch", flower.SERVERAPP_RUNTIME, "fedlb.deploy.server_app"),
    # importing Ray starts nothing (each run's child connects: ray.init after the fork)
    SIMULATION: ("torch", "ray", flower.SIMULATION_RUNTIME, "fedlb.experiments.simulation"),
}
RESTART_PAUSE_S = 1.0
NODE_NAME, SERVER_NAME = "fedlb-node", "fedlb-warm"  # forks' names (a task's: TASK_NAME)
RESTARTS_IN_A_ROW = 5  # a server dying this often right after its start cannot start here
ACQUIRE_TASK = flower.ACQUIRE_TASK  # the SuperExec-signed method
log = logging.getLogger("fedlb.warm")


def unsupported() -> str | None:
    """Why this Flower cannot run a silo warm (None: it can): the warm path drives the
    runtime API of Flower 1.42's process isolation."""
    return flower.runtime_api_gaps()


def make_secret(path: Path) -> Path:
    """A fresh SuperExec secret in `path`, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(os.urandom(32))
    return path


def _this_module(
    runtime_api_address: str,
    secret: Path,
    preload: Sequence[str],
    task: str = CLIENTAPP,
    root_certificates: Path | None = None,
    resident: bool = False,
    import_paths: Sequence[Path] = (),
) -> list[str]:
    """`python -m fedlb.deploy.warm` with the launcher's options."""
    return [
        sys.executable,
        "-m",
        "fedlb.deploy.warm",
        "--runtime-api-address",
        runtime_api_address,
        "--secret-file",
        str(secret),
        "--task",
        task,
        *(["--root-certificates", str(root_certificates)] if root_certificates else []),
        *[arg for folder in import_paths for arg in ("--path", str(folder))],
        *[arg for module in preload for arg in ("--preload", module)],
        *(["--resident"] if resident else []),
    ]


def launcher_command(
    runtime_api_address: str,
    secret: Path,
    supernode: Sequence[str],
    preload: Sequence[str] = (),
    idle_pull_s: float = IDLE_PULL_S,
    task: str = CLIENTAPP,
    root_certificates: Path | None = None,
    resident: bool = False,
    import_paths: Sequence[Path] = (),
) -> list[str]:
    """The command that runs `supernode` (flower-supernode and its arguments) warm, its
    idle pull every `idle_pull_s`; with `task=SERVERAPP` (or SIMULATION), `supernode` is
    a SuperLink's command (flower-superlink ...) and `root_certificates` the CA its
    runtime API's TLS certificate is signed by (None: plain HTTP). `resident`: a silo's
    ClientApp tasks run in one resident worker (fedlb.deploy.resident), not a fork each.
    `import_paths`: folders put first on the import path of the launcher and its forks
    before `preload` is imported (a user's app folder: its modules found without
    PYTHONPATH)."""
    return [
        *_this_module(
            runtime_api_address,
            secret,
            preload,
            task,
            root_certificates,
            resident,
            import_paths,
        ),
        "--idle-pull",
        repr(idle_pull_s),
        "--",
        *isolated(supernode, secret),
    ]


def isolated(supernode: Sequence[str], secret: Path) -> list[str]:
    """`supernode` (or a SuperLink's command) with what the warm path needs added where it
    is missing: Flower's process isolation and the SuperExec secret the warm server signs
    with."""
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
    task: str = CLIENTAPP,
    root_certificates: Path | None = None,
    resident: bool = False,
) -> None:
    """Import what a `task` (ClientApp or ServerApp) needs once, then run each task in a
    fork of this process while that is safe (fedlb.deploy.fork_safety), else cold;
    `root_certificates`: the CA of a TLS runtime API (None: plain HTTP); `resident`: a
    ClientApp task runs in the resident worker (fedlb.deploy.resident) when it is idle."""
    started = time.perf_counter()
    fork_safety.arm()  # first: nothing here may reach autograd or CUDA unseen
    modules = (*PRELOAD[task], *preload)
    skipped = fork_safety.import_modules(modules)
    if task == CLIENTAPP:
        fast_object_pulls()
    with contextlib.suppress(fork_safety.ForkSafetyError):  # remembered: the tasks then run cold
        fork_safety.warm_up_for_forks()
    log.info(
        "warm: %s imported%s and torch warmed up for forks in %.1f s; serving %s tasks of %s (%s)",
        ", ".join(module for module in modules if module not in skipped),
        f" (not {', '.join(skipped)}: unsafe to import in a forking process)" if skipped else "",
        time.perf_counter() - started,
        task,
        runtime_api_address,
        fork_safety.state(),
    )
    starter = TaskStarter(runtime_api_address, task, root_certificates)
    starter.forks()  # says now, not at the first task, when they will run cold
    if parent_pid is not None:
        flower.watch_parent(parent_pid)
    client = flower.superexec_client(  # a SuperNode's runtime API: loopback, plain HTTP
        runtime_api_address,
        secret,
        root_certificates.read_bytes() if root_certificates else None,
    )
    running: dict[int, tuple[int, str]] = {}  # child pid -> task id, token
    failed = functools.partial(report_failed, runtime_api_address, root_certificates)
    worker = ResidentWorker(runtime_api_address, failed) if resident and task == CLIENTAPP else None
    while True:
        reap(running, failed)
        if worker is not None:
            worker.poll()
        acquired = flower.acquire_task(client, TASK_TYPES[task])
        if acquired is not None:
            task_id, run_id, token = acquired
            if worker is not None and not worker.busy and starter.forks():
                worker.run(task_id, token, run_id)
                continue
            if worker is not None and worker.busy:
                log.info(
                    "warm: the resident worker is busy: task %s runs in a fork of its own",
                    task_id,
                )
            child = starter.start(task_id, token)
            if child is not None:
                running[child] = (task_id, token)
            continue  # another task may be waiting (a second run): no sleep
        time.sleep(poll_s)


def launch(
    runtime_api_address: str,
    secret_file: Path,
    supernode: Sequence[str],
    preload: Sequence[str],
    idle_pull_s: float = IDLE_PULL_S,
    task: str = CLIENTAPP,
    root_certificates: Path | None = None,
    resident: bool = False,
) -> int:
    """Run the SuperNode (prompt; or the SuperLink, for SERVERAPP tasks) and the warm
    server; restart the server if it dies; return the SuperNode's exit code."""
    what = {CLIENTAPP: "ClientApp", SERVERAPP: "ServerApp", SIMULATION: "simulation"}[task]
    owner = "silo" if task == CLIENTAPP else "server"
    # This process is the children's zygote: what a child needs is imported here once and
    # the child forked. The node (Flower's SuperNode or SuperLink) goes first, before the
    # heavy imports (torch) it does not need; the server after them.
    entry = node_entry(supernode, idle_pull_s)
    node: subprocess.Popen[bytes] | Forked
    if entry is None:  # a command other than Flower's own: run as given
        node = subprocess.Popen(supernode_command(supernode, idle_pull_s))
    else:
        importlib.import_module(entry[0])
        node = Forked(entry[1], NODE_NAME)
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        with contextlib.suppress(ProcessLookupError):
            node.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # The server is this process's fork: armed before torch's first use here, so that what
    # a --preload module does at import is caught (the server then runs its tasks cold)
    fork_safety.arm()
    fork_safety.import_modules((*PRELOAD[task], *preload))
    launcher = os.getpid()
    secret = secret_file.read_bytes()

    def serving() -> None:
        serve(
            runtime_api_address,
            secret,
            launcher,
            preload,
            task=task,
            root_certificates=root_certificates,
            resident=resident,
        )

    server = Forked(serving, SERVER_NAME, own_logging=True)
    started, quick_deaths = time.monotonic(), 0
    try:
        while node.poll() is None:
            if server.poll() is not None and not stopping:
                quick_deaths = quick_deaths + 1 if time.monotonic() - started < 10 else 1
                if quick_deaths >= RESTARTS_IN_A_ROW:  # it cannot start here: end the node
                    log.error(
                        "warm: the %s's warm %s server died %d times in a row within 10 s "
                        "of starting (last code %s); stopping the %s (its log above says "
                        "why; `--cold` runs Flower's own %s processes instead)",
                        owner,
                        what,
                        quick_deaths,
                        server.returncode,
                        owner,
                        what,
                    )
                    node.terminate()
                    node.wait(30)
                    return 1
                log.warning(
                    "warm: the %s's warm %s server exited with code %s; restarting it "
                    "(a task in flight fails as a crashed %s's does)",
                    owner,
                    what,
                    server.returncode,
                    what,
                )
                time.sleep(RESTART_PAUSE_S)
                server, started = Forked(serving, SERVER_NAME, own_logging=True), time.monotonic()
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
    parser = argparse.ArgumentParser(prog="python -m fedlb.deploy.warm")
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--secret-file", type=Path, required=True)
    parser.add_argument("--preload", action="append", default=[])
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        help="a folder put first on the import path before --preload modules are imported "
        "(a user's Flower app folder); the forked ClientApps inherit it",
    )
    parser.add_argument("--task", choices=tuple(PRELOAD), default=CLIENTAPP)
    parser.add_argument("--root-certificates", type=Path)
    parser.add_argument(
        "--resident",
        action="store_true",
        help="run a silo's ClientApp tasks in one resident worker (a GPU silo keeps its "
        "CUDA context and model between rounds), not a fork per task",
    )
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
    for folder in reversed(args.path):  # the first given is searched first
        if folder not in sys.path:
            sys.path.insert(0, folder)
    if not args.secret_file.exists():  # a user's own SuperNode: a fresh secret of theirs
        make_secret(args.secret_file)
    return launch(
        args.runtime_api_address,
        args.secret_file,
        isolated(arguments[split + 1 :], args.secret_file),
        args.preload,
        args.idle_pull,
        args.task,
        args.root_certificates,
        args.resident,
    )


if __name__ == "__main__":
    sys.exit(main())
