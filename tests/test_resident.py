"""A warm silo's resident worker (fedlb.deploy.resident) and its resident model
(fedlb.deploy.model_cache): on this CPU machine with the worker forced on, several
rounds are served by one worker process; a worker killed mid-task loses only that task
(failed at once) and the next task gets a fresh worker; the warm server never runs
autograd nor initialises CUDA (tests/fork_audit witnesses every process); a model kept
between messages trains to the same bits as a fresh one."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlb.data import LabelledData
from fedlb.deploy import RunConfig, model_cache
from fedlb.deploy.federation import Federation
from fedlb.deploy.resident import RESIDENT_NAME, RUNS_IN, STARTED, run_task, wanted
from fedlb.deploy.task import model_for
from fedlb.training import train_epoch
from tests.test_warm_fork_safety import AUDIT_DIR
from tests.test_warm_silo import run_settings, silo_config, warm_server

WORKER_LINE = re.compile(r"resident: task (\d+) runs in worker pid (\d+) \(its task (\d+); CUDA")


def small_data(samples: int = 64) -> LabelledData:
    generator = np.random.default_rng(3)
    x = generator.normal(size=(samples, 1, 28, 28)).astype(np.float32)
    y = generator.integers(0, 10, size=samples)
    return LabelledData(x, y, 10, "synthetic")


def one_round(model: torch.nn.Module, data: LabelledData, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    order = torch.randperm(len(y))
    batches = [(x[order[i : i + 16]], y[order[i : i + 16]]) for i in range(0, len(y), 16)]
    train_epoch(model, batches, lr=0.05, momentum=0.9)
    return {name: tensor.clone() for name, tensor in model_cache.cpu_state(model).items()}


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_resident_model_trains_to_the_same_bits_as_a_fresh_one(model):
    """The kept model, the next message's weights copied into it, trains exactly as a
    model built afresh with those weights (SGD's momentum is made per round)."""
    model_cache.forget()
    config = RunConfig(model=model, seed=7)
    data = small_data()
    cpu = torch.device("cpu")
    weights = {k: v.clone() for k, v in model_for(config, data).state_dict().items()}
    built, reused = model_cache.COUNTS.built, model_cache.COUNTS.reused
    with model_cache.resident_model(config, data, cpu, weights) as first:
        after_first = one_round(first, data, seed=11)
    with model_cache.resident_model(config, data, cpu, after_first) as second:
        assert second is first  # kept: the second message's weights copied in
        after_second = one_round(second, data, seed=12)
    assert (model_cache.COUNTS.built, model_cache.COUNTS.reused) == (built + 1, reused + 1)

    fresh = model_for(config, data)
    fresh.load_state_dict(weights)
    assert all(torch.equal(after_first[k], v) for k, v in one_round(fresh, data, 11).items())
    fresh = model_for(config, data)
    fresh.load_state_dict(after_first)
    expected = one_round(fresh, data, 12)
    assert expected.keys() == after_second.keys()
    assert all(torch.equal(after_second[k], v) for k, v in expected.items())
    # the reply's copy is its own: the next message's weights do not reach it
    with model_cache.resident_model(config, data, cpu, weights) as third:
        assert third is first
    assert not all(torch.equal(after_second[k], v) for k, v in weights.items())


def test_a_model_that_failed_its_message_is_not_kept_and_another_runs_model_replaces_it():
    model_cache.forget()
    data = small_data(8)
    cpu = torch.device("cpu")
    config = RunConfig(model="mlp")
    weights = model_for(config, data).state_dict()
    with pytest.raises(RuntimeError), model_cache.resident_model(config, data, cpu, weights):
        raise RuntimeError("the app failed")
    with model_cache.resident_model(config, data, cpu, weights) as built:
        pass
    with model_cache.resident_model(config, data, cpu, weights) as kept:
        assert kept is built
    other = RunConfig(model="cnn")
    with model_cache.resident_model(other, data, cpu, model_for(other, data).state_dict()):
        pass
    with model_cache.resident_model(config, data, cpu, weights) as again:
        assert again is not built  # one model kept at a time: the cnn replaced it
    model_cache.forget()


def test_when_a_silo_is_resident(monkeypatch):
    assert wanted("on", "cpu")
    assert not wanted("off", "cuda")
    assert wanted("auto", "cuda")
    assert wanted("auto", "cuda:1")
    assert not wanted("auto", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert wanted("auto", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not wanted("auto", "auto")
    with pytest.raises(ValueError, match="auto, on, off"):
        wanted("yes", "cpu")


def test_a_task_ends_back_in_the_worker_with_flowers_exit_handlers_run_once():
    """Flower's runtime registers its exit handlers and signal handlers per task and ends
    with flwr_exit: in the worker, the handlers run (both phases), control comes back,
    and the handler list is where it was (task after task)."""
    import types

    from flwr.supercore.exit import exit_handler, register_signal_handlers
    from flwr.supercore.telemetry import EventType

    from fedlb.deploy.resident import _task_ended

    ran: list[str] = []

    def run_clientapp(**kwargs) -> None:  # Flower's shape: handlers, then flwr_exit
        assert kwargs["parent_pid"] is None
        register_signal_handlers(
            event_type=EventType.FLWR_CLIENTAPP_RUN_LEAVE,
            exit_message="Task stopped.",
            exit_handlers=[lambda: ran.append(kwargs["token"])],
        )
        exit_handler.add_exit_handler(lambda: ran.append("early"), run_before_force_exit=True)
        if kwargs["token"] == "boom":
            raise OSError("outside Flower's try")
        runtime.flwr_exit(code=0 if kwargs["token"] != "bad" else 102)

    runtime = types.SimpleNamespace(run_clientapp=run_clientapp, flwr_exit=_task_ended)
    before = len(exit_handler.registered_exit_handlers)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)}
    try:
        assert run_task(runtime, "127.0.0.1:9", "one") == 0
        assert run_task(runtime, "127.0.0.1:9", "bad") == 102
        assert run_task(runtime, "127.0.0.1:9", "boom") == 1  # its handlers ran all the same
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert ran == ["early", "one", "early", "bad", "early", "boom"]
    assert len(exit_handler.registered_exit_handlers) == before


def worker_lines(log: str) -> list[tuple[int, int, int]]:
    """(task id, worker pid, its task number) of each task the silo's worker ran."""
    return [tuple(map(int, match)) for match in WORKER_LINE.findall(log)]


@pytest.fixture(scope="module")
def resident_run(tmp_path_factory):
    """A real federation, every process witnessed (tests/fork_audit): silo-0 warm and
    resident (forced on: this machine has no GPU), silo-1 warm with a fork per message
    (off); one run of three rounds."""
    folder = tmp_path_factory.mktemp("resident")
    audit = folder / "audit.txt"
    audit.touch()
    python_path = os.pathsep.join([str(AUDIT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", python_path)
        patch.setenv("FEDLB_FORK_AUDIT", str(audit))
        with Federation(folder / "procs") as federation:
            federation.add_silos({"silo-0": silo_config(0)}, warm=True, resident="on")
            federation.add_silos({"silo-1": silo_config(1)}, warm=True, resident="off")
            settings = run_settings(folder / "out", **{"num-rounds": 3, "evaluate-every": 1})
            outcome = federation.run(settings, timeout=240)
    return outcome, folder / "procs", audit.read_text().splitlines()


@pytest.mark.slow
def test_a_resident_silo_serves_every_round_from_one_worker(resident_run):
    outcome, procs, _ = resident_run
    assert outcome.status == "finished:completed", outcome.problem()
    assert [r.round for r in outcome.records] == [1, 2, 3]
    for record in outcome.records:
        assert sorted(s.silo for s in record.silos) == ["silo-0", "silo-1"], record
        assert not record.failed, record.failed
        for silo in record.silos:
            assert silo.start_s is not None
            assert 0 <= silo.start_s < 3.0
    log = (procs / "silo-0.log").read_text()
    ran = worker_lines(log)
    assert len(ran) >= 3, log[-3000:]  # three rounds' training (and evaluations)
    assert len({pid for _, pid, _ in ran}) == 1, ran  # one worker for all of them
    assert [number for _, _, number in ran] == list(range(1, len(ran) + 1))
    assert log.count(STARTED) == 1
    assert len(re.findall(rf"task \d+ {RUNS_IN} \d+", log)) == len(ran)
    assert "(forked; " not in log  # no task forked on its own
    assert "dropped" not in log  # Flower's exit handlers did not pile up
    ended = re.findall(r"resident: task \d+ ended with code 0 .* reused (\d+)\)", log)
    assert len(ended) == len(ran)
    assert int(ended[-1]) >= len(ran) - 1
    assert "CUDA initialised: yes" not in log
    other = (procs / "silo-1.log").read_text()
    assert RUNS_IN not in other
    assert "(forked; " in other
    assert "resident worker" not in other


@pytest.mark.slow
def test_the_warm_server_of_a_resident_silo_never_touches_autograd_or_cuda(resident_run):
    """The witness saw the resident worker train (backward) and no launcher or warm
    server run backward or initialise CUDA; the server's tripwire never tripped."""
    outcome, procs, audit = resident_run
    assert outcome.status == "finished:completed", outcome.problem()
    calls = [line.split() for line in audit]
    assert any(role == RESIDENT_NAME and what == "backward" for _, role, what in calls), audit
    touched = [call for call in calls if call[1] in ("fedlb-launcher", "fedlb-warm")]
    assert touched == [], touched
    log = (procs / "silo-0.log").read_text()
    (started,) = [line for line in log.splitlines() if "torch warmed up for forks" in line]
    assert started.endswith(
        "tripwire armed, tripped by nothing, CUDA initialised: no, intra-op threads: 1)"
    ), started


@pytest.mark.slow
def test_a_worker_killed_mid_task_fails_that_task_at_once_and_a_fresh_one_serves_next(
    tmp_path,
):
    """Round 2's task is killed in the worker (SIGKILL): that round ends without silo-0
    (an error at once, not after a heartbeat timeout), round 3 is served by a new worker
    forked from the same warm server, and the silo's log says what happened."""
    kills: dict[str, float] = {}
    ended: dict[int, float] = {}

    def kill(node, log_path: Path) -> None:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            ran = worker_lines(log_path.read_text())
            if len(ran) >= 2:  # the worker's second task (round 2's training) started
                time.sleep(1.0)
                kills["pid"] = ran[-1][1]
                kills["at"] = time.monotonic()
                os.kill(ran[-1][1], signal.SIGKILL)
                return
            time.sleep(0.05)

    with Federation(tmp_path / "procs") as federation:
        configs = {f"silo-{i}": {**silo_config(i), "emulated-speed": 20.0} for i in range(2)}
        (node,) = federation.add_silos({"silo-0": configs["silo-0"]}, warm=True, resident="on")
        federation.add_silos({"silo-1": configs["silo-1"]}, warm=True, resident="off")
        server = warm_server(node)
        killer = threading.Thread(target=kill, args=(node, node.log_path), daemon=True)
        killer.start()
        settings = {"num-rounds": 3, "local-steps": 10, "evaluate-every": 5, "round-timeout": 300.0}
        outcome = federation.run(
            run_settings(tmp_path / "out", **settings),
            on_round=lambda record: ended.setdefault(record.round, time.monotonic()),
            timeout=400,
        )
        killer.join(5)
        assert warm_server(node).pid == server.pid  # the server lived on
        workers = [c for c in server.children() if c.name() == RESIDENT_NAME]
    assert outcome.status == "finished:completed", outcome.problem()
    assert "pid" in kills
    taking_part = {r.round: sorted(s.silo for s in r.silos) for r in outcome.records}
    assert taking_part == {1: ["silo-0", "silo-1"], 2: ["silo-1"], 3: ["silo-0", "silo-1"]}
    (failure,) = outcome.records[1].failed
    assert "ClientApp failed" in failure, failure
    assert ended[2] - kills["at"] < 30  # not the round's timeout, nor a heartbeat's
    log = node.log_path.read_text()
    ran = worker_lines(log)
    pids = [pid for _, pid, _ in ran]
    assert pids[:2] == [kills["pid"]] * 2, ran
    assert len(set(pids)) == 2, ran
    fresh = [number for _, pid, number in ran if pid != kills["pid"]]
    assert fresh == list(range(1, len(fresh) + 1)), ran  # round 3's task its first
    assert f"the resident worker (pid {kills['pid']}) was killed by SIGKILL during task" in log, (
        log[-3000:]
    )
    assert log.count(STARTED) == 2
    assert [w.pid for w in workers] == [pids[-1]] or workers == []
