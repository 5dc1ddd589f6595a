"""The private details of Flower's runtime API and processes that fedlb's warm server
relies on (fedlb/_flower_internals/): tasks handed to a signed SuperExec, their tokens
and outputs, what the runtimes' processes are passed, a run's log mirrored and flushed,
the parent-process monitor, the exit handlers. Quick tier; run against the newest
flwr-nightly by scripts/check-flower-nightly.sh."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time

import pytest

from fedlb import _flower_internals as flower
from tests.flower_internals_helpers import ROOT, parameters

# --- the runtime API, as fedlb's warm server drives it ----------------------------------


def test_the_runtime_api_hands_tasks_to_a_signed_superexec_as_the_warm_path_asks():
    """AcquireTaskRequest(supported_task_types=[...]) -> AcquireTaskResponse(task: task_id,
    run_id; token); TaskType's values are the task types fedlb asks for;
    SuperExecAuthHttpInterceptor(master_secret, protected_methods) signs; the ClientApp
    runtime pulls its message with pull_and_inflate_object_from_tree (runtime_api_gaps)."""
    from flwr.proto.runtime_pb2 import AcquireTaskResponse
    from flwr.supercore.constant import TaskType

    assert flower.runtime_api_gaps() is None
    assert {f.name for f in AcquireTaskResponse.DESCRIPTOR.fields} >= {"task", "token"}
    task_fields = AcquireTaskResponse.DESCRIPTOR.fields_by_name["task"].message_type.fields
    assert {"task_id", "run_id"} <= {f.name for f in task_fields}
    types = (TaskType.CLIENT_APP.value, TaskType.SERVER_APP.value, TaskType.SIMULATION.value)
    assert types == flower.TASK_TYPES
    client = flower.superexec_client("127.0.0.1:9", b"x" * 32)
    client.close()


def test_acquire_task_reads_a_task_and_its_token_from_the_reply():
    """acquire_task returns (task id, run id, token), None when the reply has no task."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest, AcquireTaskResponse
    from flwr.proto.task_pb2 import Task

    asked: list[object] = []

    class Client:
        def __init__(self, reply):
            self.reply = reply

        def AcquireTask(self, request):  # noqa: N802 (Flower's name)
            assert isinstance(request, AcquireTaskRequest)
            asked.append(list(request.supported_task_types))
            return self.reply

    task = Task(task_id=3, run_id=4, type="flwr-clientapp")
    assert flower.acquire_task(
        Client(AcquireTaskResponse(task=task, token="t")), "flwr-clientapp"
    ) == (3, 4, "t")
    assert flower.acquire_task(Client(AcquireTaskResponse()), "flwr-serverapp") is None
    assert asked == [["flwr-clientapp"], ["flwr-serverapp"]]


def test_a_task_is_finished_failed_with_push_task_output_and_its_token():
    """PushTaskOutputRequest(sub_status=, details=) and RuntimeTokenHttpInterceptor(token)
    exist as push_task_failed calls them; a runtime API that is not there raises."""
    from flwr.proto.runtime_pb2 import PushTaskOutputRequest
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor

    PushTaskOutputRequest(sub_status="failed", details="x")
    RuntimeTokenHttpInterceptor("token")
    with pytest.raises(Exception):  # noqa: B017, PT011 (nothing listens on port 9)
        flower.push_task_failed("127.0.0.1:9", None, "token", "killed")


def test_run_clientapp_takes_what_flwr_clientapp_passes_and_ends_through_its_flwr_exit():
    """`run_clientapp(runtime_api_address, token, insecure, certificates, parent_pid)` of
    flwr/supernode/runtime/run_clientapp.py ends a task through its module global
    `flwr_exit` (what a resident worker replaces: end_tasks_with)."""
    runtime = flower.module(flower.CLIENTAPP_RUNTIME)
    assert {"runtime_api_address", "token", "insecure", "certificates", "parent_pid"} <= (
        parameters(runtime.run_clientapp)
    )
    assert "flwr_exit(" in inspect.getsource(runtime.run_clientapp)
    original = runtime.flwr_exit
    try:
        flower.end_tasks_with(runtime, print)
        assert runtime.flwr_exit is print
    finally:
        runtime.flwr_exit = original
    called = {}
    fake = type("Runtime", (), {"run_clientapp": staticmethod(lambda **kw: called.update(kw))})
    flower.run_clientapp("127.0.0.1:9", "token", 42, fake)
    assert called == {
        "runtime_api_address": "127.0.0.1:9",
        "token": "token",
        "insecure": True,
        "certificates": None,
        "parent_pid": 42,
    }


@pytest.mark.parametrize("task", ["flwr-serverapp", "flwr-simulation"])
def test_server_side_runtimes_take_what_their_processes_pass(task):
    """run_serverapp and run_simulation_process take (runtime_api_address, log_queue,
    token, insecure, certificates, parent_pid, runtime_dependency_install), and their
    modules use flwr.supercore.logger's log uploader by name (flush_logs_without_pause)."""
    from flwr.supercore import logger

    runtime, run = flower.server_side_runtime(task)
    assert {
        "runtime_api_address",
        "log_queue",
        "token",
        "insecure",
        "certificates",
        "parent_pid",
        "runtime_dependency_install",
    } <= parameters(run)
    assert runtime.start_log_uploader is logger.start_log_uploader
    assert runtime.flush_logs is logger.flush_logs
    assert runtime.stop_log_uploader is logger.stop_log_uploader


MIRROR_PROBE = """
import sys
from queue import Queue
from fedlb._flower_internals import output_mirrored_to

queue = Queue()
with output_mirrored_to(queue):
    print("a line of the run", flush=True)
seen = []
while not queue.empty():
    seen.append(str(queue.get()))
restored = sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
sys.__stderr__.write(f"MIRRORED {'a line of the run' in ''.join(seen)} RESTORED {restored}\\n")
"""


def test_a_processs_output_is_mirrored_to_a_runs_log_queue():
    """mirror_output_to_queue: what the process prints meanwhile reaches the queue (the
    run's log); restore_output puts sys.__stdout__ / sys.__stderr__ back (in a process of
    its own: it does not restore what a test runner had put there)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", MIRROR_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert "MIRRORED True RESTORED True" in done.stderr, done.stderr[-3000:]


def test_flowers_flush_logs_pauses_a_second_after_the_queue_empties():
    """The pause flush_logs_without_pause removes is there in this Flower (else drop it)."""
    from queue import Queue

    from flwr.supercore import logger

    started = time.monotonic()
    assert logger.flush_logs(Queue())
    assert time.monotonic() - started >= 0.9 * flower.LOG_FLUSH_PAUSE_S


def test_a_runs_log_is_flushed_without_flowers_pause():
    """The log uploader Flower starts (start_log_uploader: a thread that pushes what the
    queue holds and ends at a None) and flush_logs, replaced: the flush returns once every
    line is pushed and the uploader has ended, without calling Flower's flush_logs (whose
    pause the test above measures), and Flower's stop afterwards is a no-op."""
    import types
    from queue import Queue

    from flwr.supercore import logger

    pushed: list[str] = []
    flowers_flush: list[object] = []

    class Client:  # the runtime client's one call the uploader makes
        def PushLogs(self, request):  # noqa: N802 (Flower's name)
            time.sleep(0.05)  # a round trip
            pushed.extend(request.logs)

    def flush_logs(*args, **kwargs):  # Flower's, with its pause: it must not be called
        flowers_flush.append(args)
        return logger.flush_logs(*args, **kwargs)

    runtime = types.SimpleNamespace(
        start_log_uploader=logger.start_log_uploader, flush_logs=flush_logs
    )
    flower.flush_logs_without_pause(runtime)
    queue: Queue[str | None] = Queue()
    uploader = runtime.start_log_uploader(queue, node_id=0, run_id=1, client=Client())
    for i in range(5):
        queue.put(f"line {i}\n")
    assert runtime.flush_logs(queue)
    assert pushed == [f"line {i}\n" for i in range(5)]  # every line, pushed, in order
    assert not uploader.is_alive()
    assert flowers_flush == []  # no pause: the wait was for the uploader, nothing more
    logger.stop_log_uploader(queue, uploader, timeout=0.1)  # Flower's stop: done


def test_the_parent_process_monitor_takes_a_pid():
    """start_parent_process_monitor(parent_pid) (flwr/supercore/app_utils.py)."""
    from flwr.supercore.app_utils import start_parent_process_monitor

    assert list(inspect.signature(start_parent_process_monitor).parameters) == ["parent_pid"]


def test_flowers_exit_handlers_run_in_two_phases_and_leave_the_list():
    """add_exit_handler(fn, run_before_force_exit=) appends to the module-level list
    registered_exit_handlers; run_exit_handlers runs both phases (early first) and the list
    is back where it was."""
    from flwr.supercore.exit import exit_handler

    assert flower.exit_handlers() is exit_handler.registered_exit_handlers
    before = len(flower.exit_handlers())
    ran: list[str] = []
    exit_handler.add_exit_handler(lambda: ran.append("late"), run_before_force_exit=False)
    exit_handler.add_exit_handler(lambda: ran.append("early"), run_before_force_exit=True)
    flower.run_exit_handlers()
    assert ran == ["early", "late"]
    assert len(flower.exit_handlers()) == before
