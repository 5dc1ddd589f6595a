"""The warm path (fedlb.deploy.warm: silos and SuperLink) on real processes, and the Flower
behaviours it relies on: a Flower upgrade that changes one of them fails here, not in a
user's run."""

from __future__ import annotations

import functools
import inspect
import os
import signal
import time

import psutil
import pytest

from fedlb.deploy import RunConfig
from fedlb.deploy.federation import Federation
from fedlb.deploy.join import LOST_TASK, ClientAppFailures
from fedlb.deploy.prompt import SUPERNODE_SLEEPS, fast_object_pulls, prompt_supernode
from fedlb.deploy.warm import (
    ACQUIRE_TASK,
    NODE_NAME,
    SERVER_NAME,
    isolated,
    launcher_command,
    make_secret,
    unsupported,
)
from fedlb.deploy.warm_tasks import TASK_NAME


def test_the_flower_runtime_it_drives_has_the_shape_it_expects():
    from flwr.proto.runtime_pb2 import AcquireTaskRequest, AcquireTaskResponse
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor
    from flwr.supernode.runtime import run_clientapp as runtime

    run = inspect.signature(runtime.run_clientapp).parameters
    assert {"runtime_api_address", "token", "insecure", "certificates", "parent_pid"} <= set(run)
    assert (
        "initial_backoff" in inspect.signature(runtime.pull_and_inflate_object_from_tree).parameters
    )
    assert TaskType.CLIENT_APP.value == "flwr-clientapp"
    assert TaskType.SERVER_APP.value == "flwr-serverapp"
    from flwr.supercore.logger import mirror_output_to_queue, restore_output  # noqa: F401
    from flwr.superlink.runtime.run_serverapp import run_serverapp

    served = set(inspect.signature(run_serverapp).parameters)
    assert {
        "runtime_api_address",
        "log_queue",
        "token",
        "insecure",
        "certificates",
        "parent_pid",
        "runtime_dependency_install",
    } <= served
    AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
    assert {"task", "token"} <= {f.name for f in AcquireTaskResponse.DESCRIPTOR.fields}
    SuperExecAuthHttpInterceptor(master_secret=b"x" * 32, protected_methods={ACQUIRE_TASK})
    assert unsupported() is None  # this Flower runs silos warm (else they start cold)

    before = runtime.pull_and_inflate_object_from_tree
    try:
        fast_object_pulls(0.05)
        fast_object_pulls(0.02)  # twice: still one partial over Flower's function
        pull = runtime.pull_and_inflate_object_from_tree
        assert isinstance(pull, functools.partial)
        assert pull.keywords == {"initial_backoff": 0.02}
        assert not isinstance(pull.func, functools.partial)
    finally:
        runtime.pull_and_inflate_object_from_tree = before


def test_a_warm_serverapps_grid_retries_a_replys_objects_after_20_ms():
    """Flower's ServerApp grid pulls a reply's objects through its module's
    `pull_objects`, which takes `initial_backoff` (Flower's default: 1 s, paid whenever a
    poll finds a reply whose objects are still arriving); fast_reply_pulls binds 0.02 s."""
    from flwr.superlink.grid import http_grid

    from fedlb.deploy.prompt import fast_reply_pulls

    assert "initial_backoff" in inspect.signature(http_grid.pull_objects).parameters
    assert "pull_objects(" in inspect.getsource(http_grid.HttpGrid.pull_messages)
    before = http_grid.pull_objects
    try:
        fast_reply_pulls()
        fast_reply_pulls()
        assert http_grid.pull_objects.keywords == {"initial_backoff": 0.02}
        assert not isinstance(http_grid.pull_objects.func, functools.partial)
    finally:
        http_grid.pull_objects = before


def test_the_supernode_loop_it_shortens_sleeps_where_it_expects():
    """Flower's SuperNode loop pauses 3 s after an empty pull and 0.5 s while a reply is
    not there yet, through its module's `time`; prompt_supernode shortens those two only."""
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop)
    idle, reply = SUPERNODE_SLEEPS
    assert f"time.sleep({idle})" in source
    assert f"time.sleep({reply})" in source
    assert loop.time is time
    assert "initial_backoff" in inspect.signature(loop.pull_objects).parameters
    pull_objects = loop.pull_objects
    try:
        prompt_supernode(0.01, 0.02)
        prompt_supernode(0.01, 0.02)  # twice: still one partial over Flower's function
        assert loop.pull_objects.keywords == {"initial_backoff": 0.02}
        assert loop.pull_objects.func is pull_objects
        started = time.perf_counter()
        loop.time.sleep(idle)
        loop.time.sleep(reply)
        assert time.perf_counter() - started < 0.5
        assert loop.time.monotonic() > 0
        assert loop.time.time() > 0
    finally:
        loop.time = time
        loop.pull_objects = pull_objects


def test_the_secret_is_the_users_own_and_the_supernode_runs_isolated(tmp_path):
    secret = make_secret(tmp_path / "home" / "superexec.secret")
    assert secret.stat().st_mode & 0o777 == 0o600
    assert len(secret.read_bytes()) == 32
    first = secret.read_bytes()
    make_secret(secret)
    assert secret.read_bytes() != first  # a fresh one each start
    command = launcher_command("127.0.0.1:9", secret, ["flower-supernode", "--insecure"])
    tail = command[command.index("--") + 1 :]
    assert tail[:2] == ["flower-supernode", "--insecure"]
    assert command[command.index("--idle-pull") + 1] == "0.2"
    assert tail[-4:] == ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    # a user's own SuperNode command: what the warm path needs is added only where missing
    own = ["flower-supernode", "--isolation", "process", "--superlink", "s:9092"]
    assert isolated(own, secret) == [*own, "--superexec-auth-secret-file", str(secret)]
    assert isolated(isolated(own, secret), secret) == isolated(own, secret)


def test_the_launcher_gives_a_users_own_supernode_a_fresh_secret(tmp_path, monkeypatch):
    import fedlb.deploy.warm as warm

    started = {}
    monkeypatch.setattr(warm, "launch", lambda *args: started.setdefault("args", args) and 0)
    secret = tmp_path / "new" / "superexec.secret"
    arguments = ["--runtime-api-address", "127.0.0.1:9", "--secret-file", str(secret)]
    assert warm.main([*arguments, "--", "flower-supernode", "--insecure"]) == 0
    assert secret.stat().st_mode & 0o777 == 0o600  # written, the user's own
    supernode = started["args"][2]
    assert supernode[:2] == ["flower-supernode", "--insecure"]
    assert supernode[-2:] == ["--superexec-auth-secret-file", str(secret)]


def silo_config(i: int) -> dict[str, object]:
    return {"partition-id": i, "num-partitions": 2, "emulated-speed": 400.0, "threads": 1}


def run_settings(out_dir, **changes):
    return {
        **RunConfig().to_mapping(),
        "num-silos": 2,
        "num-rounds": 2,
        "local-steps": 3,
        "batch-size": 8,
        "evaluate-every": 2,
        "out-dir": str(out_dir),
        **changes,
    }


def foreign_acquire(address: str, secret: bytes | None, task: str = "flwr-clientapp") -> None:
    """AcquireTask as another caller would: unsigned, or signed with another secret."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if secret is not None:
        interceptors.append(
            SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE_TASK})
        )
    client = RuntimeHttpClient.from_server_address(address, True, None, interceptors)
    try:
        client.AcquireTask(AcquireTaskRequest(supported_task_types=[task]))
    finally:
        client.close()


def warm_server(node) -> psutil.Process:
    """The warm server of a silo (or of the SuperLink): the launcher's child that serves."""
    launcher = psutil.Process(node.pid).children()[0]
    deadline = time.monotonic() + 60  # forked once the launcher has imported torch
    while time.monotonic() < deadline:
        for child in launcher.children():
            if child.name() == SERVER_NAME:
                return child
        time.sleep(0.1)
    raise AssertionError(f"no warm server under {launcher.cmdline()}")


@pytest.mark.slow
def test_warm_silos_serve_every_message_from_one_warm_server(tmp_path):
    """Two warm silos and a warm SuperLink: a run completes; each silo imported torch
    once (one server) and ran each message in a fork of it, the SuperLink each run; an
    unsigned caller is refused their tasks; a silo's server killed between runs is
    restarted, said so, and the next run completes."""
    with Federation(tmp_path / "procs") as federation:
        # a fork per message (what this tests), also on a GPU machine (auto: resident there)
        nodes = federation.add_silos(
            {f"silo-{i}": silo_config(i) for i in range(2)}, warm=True, resident="off"
        )
        servers = [warm_server(node) for node in nodes]
        warm_server(federation.link)
        for node in [*nodes, federation.link]:  # Flower's SuperNode (SuperLink), forked
            launcher = psutil.Process(node.pid).children()[0]  # by fedlb's launcher
            names = sorted(child.name() for child in launcher.children())
            assert names == sorted([NODE_NAME, SERVER_NAME]), names
        outcome = federation.run(run_settings(tmp_path / "one"), timeout=240)
        assert outcome.status == "finished:completed", outcome.problem()
        assert [r.round for r in outcome.records] == [1, 2]
        for record in outcome.records:  # each silo's timeline: its start-up, its wall
            for silo in record.silos:
                assert silo.start_s is not None
                assert 0 <= silo.start_s < 3.0  # a fork: no imports (a cold start: ~4 s)
                assert silo.wall_s is not None
                assert silo.round_s <= silo.wall_s <= record.wall_s + 0.5
        for node, server in zip(nodes, servers, strict=True):
            log = node.log_path.read_text()
            assert log.count("warm: torch") == 1  # imported once, for every message
            assert log.count("warm: task") >= 2  # a fork per message
            assert "Loading ClientApp" not in log  # Flower's DEBUG line: not the app's output
            assert server.is_running()
            assert warm_server(node).pid == server.pid

        # The runtime APIs hand tasks only to a caller signed with the owner's secret: the
        # silo's (ClientApps) and the server's (ServerApps), at both of its doors.
        for address, task in (
            (f"127.0.0.1:{nodes[0].port}", "flwr-clientapp"),
            (federation.address, "flwr-serverapp"),
            (federation.control_address, "flwr-serverapp"),
        ):
            for secret in (None, b"not the owner's secret, 32 bytes"):
                with pytest.raises(Exception, match=r"(?i)unauthenticated|401|403|auth"):
                    foreign_acquire(address, secret, task)

        os.kill(servers[0].pid, signal.SIGKILL)  # a crash of the warm server
        deadline = time.monotonic() + 30
        while "restarting it" not in nodes[0].log_path.read_text():
            assert time.monotonic() < deadline, "the launcher did not restart the server"
            time.sleep(0.2)
        outcome = federation.run(run_settings(tmp_path / "two"), timeout=240)
        assert outcome.status == "finished:completed", outcome.problem()
        assert warm_server(nodes[0]).pid != servers[0].pid
        # The SuperLink's ServerApps: both runs forked from one warm server that imported
        # torch once; each run's own output still reached its log (Flower's log upload).
        assert federation.link is not None
        assert federation.link.log_path.read_text().count("warm: torch") == 1
        assert warm_server(federation.link).is_running()
        for run_log in federation.workdir.glob("serverapp-*.log"):
            assert "Starting LoadBalancedFedAvg strategy" in run_log.read_text()
        assert len(list(federation.workdir.glob("serverapp-*.log"))) == 2


@pytest.mark.slow
def test_a_task_lost_mid_round_fails_at_once_and_the_silo_stays_in(tmp_path):
    """Before: a silo whose warm server was killed mid-task dropped out for the rest of the
    run, silently: its SuperNode waited for the lost task's reply for ever, the round for
    its timeout (600 s by default), and the silo was never sampled again. Now a task lost
    to its warm server's death (round 1) or to its own (SIGKILL, round 3) is answered with
    an error at once: the round goes on without that reply, the silo trains in the next,
    and what happened is in the silo's log as the console reads it. A silo lost whole
    (round 5) ends its round after ~20 s of missed heartbeats, not Flower's ~60."""
    import threading

    kills: dict[int, float] = {}  # round -> when its task (or server) was killed

    def next_task(node, after: int = 0) -> psutil.Process:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for child in warm_server(node).children():
                if child.name() == TASK_NAME and child.pid != after:
                    return child
            time.sleep(0.05)
        raise AssertionError("no task was forked")

    with Federation(tmp_path / "procs") as federation:
        configs = {f"silo-{i}": {**silo_config(i), "emulated-speed": 20.0} for i in range(2)}
        nodes = federation.add_silos(configs, warm=True, resident="off")  # forks, also on a GPU
        failures = ClientAppFailures(nodes[0].log_path)

        def kill() -> None:  # round 1: the warm server; round 3: the task's own process
            task = next_task(nodes[0])  # round 1's training (~4 s at 20 samples/s)
            time.sleep(1.0)
            kills[1] = time.monotonic()
            os.kill(warm_server(nodes[0]).pid, signal.SIGKILL)
            for _ in range(2):  # round 2's task, then round 3's
                task.wait(60)
                task = next_task(nodes[0], task.pid)
            time.sleep(1.0)
            kills[3] = time.monotonic()
            task.kill()
            task = next_task(nodes[0], task.pid)  # round 4's task runs to its end
            task.wait(60)
            task = next_task(nodes[0], task.pid)  # round 5's: the whole silo goes
            time.sleep(1.0)
            kills[5] = time.monotonic()
            nodes[0].kill()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        ended: dict[int, float] = {}

        def on_round(record) -> None:
            ended[record.round] = time.monotonic()

        settings = {"num-rounds": 5, "local-steps": 10, "round-timeout": 300.0}
        outcome = federation.run(
            run_settings(tmp_path / "out", **settings), on_round=on_round, timeout=500
        )
        killer.join(5)
    assert outcome.status == "finished:completed", outcome.problem()
    assert sorted(kills) == [1, 3, 5]
    taking_part = {r.round: sorted(s.silo for s in r.silos) for r in outcome.records}
    assert taking_part == {
        1: ["silo-1"],
        2: ["silo-0", "silo-1"],
        3: ["silo-1"],
        4: ["silo-0", "silo-1"],
        5: ["silo-1"],
    }
    for number in (1, 3):
        record = outcome.records[number - 1]
        assert len(record.failed) == 1, record.failed
        assert "ClientApp failed" in record.failed[0], record.failed
        assert ended[number] - kills[number] < 30  # its round did not wait for the timeout
    # Round 5: the silo's machine gone (SuperNode and all): the SuperLink declares the node
    # unavailable after 2 of its heartbeat intervals (fedlb's 10 s; Flower's are 30 s)
    assert any("Node Unavailable" in f for f in outcome.records[4].failed), outcome.records[4]
    assert ended[5] - kills[5] < 2 * 10 + 10
    log = nodes[0].log_path.read_text()
    assert log.count(LOST_TASK) == 2, log[-3000:]
    assert "its process was killed by SIGKILL" in log
    said = failures.new()  # what `fedlb silo` prints on the silo's console
    assert any("warm ClientApp server exited" in line for line in said), said
    assert sum("ClientApp ended without a reply" in line for line in said) == 2, said


def test_a_runs_log_is_flushed_without_flowers_pause():
    """Flower's ServerApp and simulation processes flush the run's log through their
    modules' `start_log_uploader` / `flush_logs` (the names flush_without_pause replaces),
    and Flower's own flush sleeps 1 s after the queue empties; the replacement returns
    once the uploader has pushed every line, and Flower's stop afterwards is a no-op."""
    import importlib
    import types
    from queue import Queue

    from flwr.supercore import logger as flower_logger

    from fedlb.deploy.prompt import flush_without_pause

    for name in ("flwr.superlink.runtime.run_serverapp", "flwr.simulation.app"):
        module = importlib.import_module(name)
        assert module.start_log_uploader is flower_logger.start_log_uploader
        assert module.flush_logs is flower_logger.flush_logs
        assert module.stop_log_uploader is flower_logger.stop_log_uploader

    pushed: list[str] = []

    class Client:  # the runtime client's one call the uploader makes
        def PushLogs(self, request):  # noqa: N802 (Flower's name)
            time.sleep(0.05)  # a round trip
            pushed.extend(request.logs)

    runtime = types.SimpleNamespace(
        start_log_uploader=flower_logger.start_log_uploader, flush_logs=flower_logger.flush_logs
    )
    flush_without_pause(runtime)
    queue: Queue[str | None] = Queue()
    uploader = runtime.start_log_uploader(queue, node_id=0, run_id=1, client=Client())
    for i in range(5):
        queue.put(f"line {i}\n")
    started = time.monotonic()
    assert runtime.flush_logs(queue)
    took = time.monotonic() - started
    assert pushed == [f"line {i}\n" for i in range(5)]  # every line, pushed, in order
    assert not uploader.is_alive()
    assert took < 0.8  # Flower's flush: 1 s after the queue empties
    flower_logger.stop_log_uploader(queue, uploader, timeout=0.1)  # Flower's stop: done


def test_flowers_own_flush_pauses_a_second():
    """The pause flush_without_pause removes is there in this Flower (else drop it)."""
    from queue import Queue

    from flwr.supercore import logger as flower_logger

    started = time.monotonic()
    assert flower_logger.flush_logs(Queue())
    assert time.monotonic() - started >= 0.9


def test_a_forked_child_ends_as_a_started_one_would():
    """The launcher's children are forks (fedlb.deploy.forked): their exit codes, signals
    and names read as a started process's would."""
    import subprocess
    import sys

    from fedlb.deploy.forked import Forked

    assert Forked(lambda: 3, "fedlb-test").wait(10) == 3
    assert Forked(lambda: sys.exit(4), "fedlb-test").wait(10) == 4
    assert Forked(lambda: None, "fedlb-test").wait(10) == 0
    assert Forked(lambda: 1 // 0, "fedlb-test").wait(10) == 1  # its traceback on stderr
    sleeper = Forked(lambda: time.sleep(60), "fedlb-sleeper")
    deadline = time.monotonic() + 10  # the child names itself first thing
    while psutil.Process(sleeper.pid).name() != "fedlb-sleeper":
        assert time.monotonic() < deadline, psutil.Process(sleeper.pid).name()
        time.sleep(0.02)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    sleeper.terminate()
    assert sleeper.wait(10) == -signal.SIGTERM
    sleeper.kill()  # gone already: nothing to signal, no error


def test_the_supernode_pushes_the_reply_of_the_run_it_handles():
    """Flower's SuperNode loop pushes whichever reply comes first. A ClientApp of a run
    whose server died (its message ignored, the app already started) replies late: a fast
    restart's next message then got that stale reply as its own, and its real reply
    waited a round. With replies_of_the_current_run the push step takes the reply of the
    run it pulled a message of, and drops the stale one."""
    import inspect
    import types

    from flwr.supernode import start_client_internal as flower_loop

    from fedlb.deploy.prompt import replies_of_the_current_run

    for name in ("_pull_and_store_message", "_push_messages"):  # what the loop calls
        assert name in inspect.getsource(flower_loop.start_client_internal)
    assert {"state", "object_store", "send", "push_object"} <= set(
        inspect.signature(flower_loop._push_messages).parameters
    )

    def reply(run_id: int, name: str):
        return types.SimpleNamespace(
            metadata=types.SimpleNamespace(
                run_id=run_id, message_id=name, reply_to_message_id=f"to-{name}"
            )
        )

    class State:  # Flower's NodeState as the push step uses it (retrieval marks a message)
        def __init__(self, messages):
            self.messages = {m.metadata.message_id: [m, False] for m in messages}

        def get_messages_legacy(self, *, run_ids=None, is_reply=None, limit=None):
            found = []
            for entry in self.messages.values():
                message, retrieved = entry
                if retrieved or (run_ids is not None and message.metadata.run_id not in run_ids):
                    continue
                entry[1] = True
                found.append(message)
            return found

        def delete_messages(self, *, message_ids=None):
            for name in message_ids or []:
                self.messages.pop(name, None)

    pushed, deleted = [], []

    def flower_push(*, state, object_store, send, push_object):  # the part that matters
        for message in state.get_messages_legacy(is_reply=True):
            pushed.append(message.metadata.message_id)
            state.delete_messages(message_ids=[message.metadata.message_id])

    loop = types.SimpleNamespace(_pull_and_store_message=lambda **_: 2, _push_messages=flower_push)
    replies_of_the_current_run(loop)
    replies_of_the_current_run(loop)  # twice: still one wrapper
    state = State([reply(1, "stale"), reply(2, "current")])
    store = types.SimpleNamespace(delete=deleted.append)
    assert loop._pull_and_store_message() == 2  # a message of run 2 is being handled
    loop._push_messages(state=state, object_store=store, send=None, push_object=None)
    assert pushed == ["current"]  # not the stale reply of run 1 ...
    assert deleted == ["stale"]  # ... which is dropped
    assert state.messages == {}
