"""The warm path's forking processes keep torch fork-safe (fedlb.deploy.fork_safety).

On a GPU machine with a CUDA build of torch every forked ClientApp failed: `CUDA error:
initialization error` on the GPU silo, "Unable to handle autograd's threading in
combination with fork-based multiprocessing" on the CPU silos, because the warm server
ran a backward pass before it forked them (../shared/notes/gpu-h200-federation.md). This
machine's CPU-only torch never starts autograd's device threads, so that failure cannot
show here. These tests check its cause instead: that a forking process never runs
autograd or initialises CUDA (an outside witness, tests/fork_audit, records every call
in every process of a real federation), that the tripwire stops and names any attempt in
the forking process only, and that a silo whose forking process did it anyway runs its
ClientApps cold instead of losing them. One failure a CPU build does show is checked
directly: a child forked after its parent ran torch's intra-op (OpenMP) threads hangs.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedlb.deploy import fork_safety
from fedlb.deploy.federation import Federation
from fedlb.deploy.fork_safety import NVML_CHECK, ForkSafetyError
from fedlb.deploy.forked import Forked
from fedlb.deploy.warm_tasks import COLD
from tests.test_warm_silo import run_settings

AUDIT_DIR = Path(__file__).with_name("fork_audit")
TRAINS_AT_IMPORT = """\
import torch

weight = torch.ones(2, requires_grad=True)
(weight * 3).sum().backward()  # line 4: what a careless --preload module does
"""


FRESH = "FEDLB_TEST_FRESH_INTERPRETER"


def in_a_fresh_interpreter(test):
    """Run `test` in a pytest of its own. What these tests fork must be a process whose
    threads are known: by the time they run in the suite, pytest's own process may hold
    threads of other tests' libraries (TenSEAL's, torch's intra-op pool), and a child
    forked from it then crashes or hangs for reasons that are not the code's."""

    @functools.wraps(test)
    def fresh(*args, **kwargs):
        if os.environ.get(FRESH) == "1":
            return test(*args, **kwargs)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-x",
                f"{__file__}::{test.__name__}",
            ],
            env={**os.environ, FRESH: "1"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        return None

    return fresh


def in_a_child(check, capfd, timeout: float = 60) -> None:
    """Run `check` in a forked child: arming changes torch for its whole process, which
    must not be pytest's. Fails with the child's traceback."""
    child = Forked(check, "fedlb-test")
    try:
        code = child.wait(timeout)
    finally:
        child.kill()
    assert code == 0, capfd.readouterr().err


@in_a_fresh_interpreter
def test_the_tripwire_raises_in_the_forking_process_and_not_in_its_children(capfd):
    def check() -> int:
        threads, environment = torch.get_num_threads(), os.environ.get(NVML_CHECK)
        fork_safety.arm()
        fork_safety.warm_up_for_forks()  # the warm server's own warm-up: no trip
        assert fork_safety.hazards() == []
        assert torch.get_num_threads() == 1
        assert os.environ[NVML_CHECK] == "1"  # is_available() asks NVML, no cuInit
        weight = torch.ones(2, requires_grad=True)
        here = r"test_warm_fork_safety\.py:\d+"
        with pytest.raises(ForkSafetyError, match=rf"autograd's backward at \S*{here}"):
            (weight * 3).sum().backward()
        with pytest.raises(ForkSafetyError, match="autograd's backward"):
            torch.autograd.grad((weight * 3).sum(), weight)
        with pytest.raises(ForkSafetyError, match=rf"CUDA's initialisation at \S*{here}"):
            torch.zeros(1, device="cuda")  # a tensor's first CUDA use, through C++
        with pytest.raises(ForkSafetyError, match="CUDA's initialisation"):
            torch.cuda.get_rng_state()  # torch.cuda.random's own reference to _lazy_init
        assert weight.grad is None  # stopped before the engine ran
        hazards = fork_safety.hazards()
        assert len(hazards) == 4, hazards
        assert "tripped by autograd's backward at" in fork_safety.state()

        def child() -> int:  # a forked task: torch as a fresh process has it
            assert not fork_safety.armed()
            grown = torch.ones(2, requires_grad=True)
            (grown * 3).sum().backward()
            assert grown.grad is not None
            assert grown.grad.tolist() == [3.0, 3.0]
            (gradient,) = torch.autograd.grad((grown * 2).sum(), grown)
            assert gradient.tolist() == [2.0, 2.0]
            for module in (torch.cuda, torch.cuda.random):  # torch's own CUDA start
                assert module._lazy_init.__module__ == "torch.cuda", module
            assert torch.get_num_threads() == threads
            assert os.environ.get(NVML_CHECK) == environment
            # what its parent had done is known to it (a forked server inherits that)
            inherited = fork_safety.hazards()
            assert len(inherited) == 4, inherited
            assert all("(in the process this one was forked from)" in h for h in inherited)
            return 0

        assert Forked(child, "fedlb-test-task").wait(60) == 0
        with pytest.raises(ForkSafetyError):  # the parent is still armed
            (weight * 3).sum().backward()
        return 0

    in_a_child(check, capfd)


@in_a_fresh_interpreter
def test_a_forking_process_starts_no_intra_op_threads_for_its_children_to_hang_on(capfd):
    """GNU OpenMP has no fork handler: a child forked after its parent ran a parallel op
    hangs at its own first one (seen here: a LeNet forward in the parent hung every
    child). Armed, the parent runs torch on one intra-op thread, and a child gets its
    threads back."""

    def check() -> int:
        torch.set_num_threads(2)  # a team of two threads even on a machine of one core
        fork_safety.arm()
        conv = torch.nn.Conv2d(1, 6, 5)
        with torch.no_grad():  # a --preload module's forward at import, say
            conv(torch.randn(64, 1, 28, 28))

        def child() -> int:
            assert torch.get_num_threads() == 2
            with torch.no_grad():
                conv(torch.randn(64, 1, 28, 28))
            return 0

        task = Forked(child, "fedlb-test-task")
        try:
            assert task.wait(30) == 0  # TimeoutExpired: the child hung
        finally:
            task.kill()
        torch.set_num_threads(3)  # set again after arming: said, not trusted
        assert any("intra-op threads were set to 3" in h for h in fork_safety.hazards())
        return 0

    in_a_child(check, capfd, timeout=90)


@in_a_fresh_interpreter
def test_a_module_that_trains_at_import_is_remembered_not_raised(tmp_path, capfd):
    (tmp_path / "trains_at_import.py").write_text(TRAINS_AT_IMPORT)

    def check() -> int:
        sys.path.insert(0, str(tmp_path))
        fork_safety.arm()
        fork_safety.import_modules(["json", "trains_at_import"])
        (hazard,) = fork_safety.hazards()
        assert re.search(r"autograd's backward at \S*trains_at_import\.py:4 ", hazard), hazard
        fork_safety.import_modules(["trains_at_import"])  # remembered: not tried again
        assert len(fork_safety.hazards()) == 1
        with pytest.raises(ModuleNotFoundError):  # an import's own error is the caller's
            fork_safety.import_modules(["no_such_module_here"])
        return 0

    in_a_child(check, capfd)


@pytest.fixture(scope="module")
def witnessed(tmp_path_factory):
    """A real federation, every process watched by tests/fork_audit: a warm SuperLink,
    silo-0 warm, silo-1 warm with a --preload module that runs backward at import; one
    run of two rounds. (outcome, workdir, the witness's lines)."""
    folder = tmp_path_factory.mktemp("witnessed")
    (folder / "modules").mkdir()
    (folder / "modules" / "trains_at_import.py").write_text(TRAINS_AT_IMPORT)
    audit = folder / "audit.txt"
    audit.touch()
    python_path = os.pathsep.join(
        [str(AUDIT_DIR), str(folder / "modules"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    configs = {
        f"silo-{i}": {"partition-id": i, "num-partitions": 2, "emulated-speed": 400.0}
        for i in range(2)
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", python_path)  # every process of the federation's
        patch.setenv("FEDLB_FORK_AUDIT", str(audit))
        with Federation(folder / "procs") as federation:
            federation.add_silos({"silo-0": configs["silo-0"]}, warm=True, resident="off")
            federation.add_silos(
                {"silo-1": configs["silo-1"]},
                warm=True,
                preload=["trains_at_import"],
                resident="off",
            )
            outcome = federation.run(run_settings(folder / "out"), timeout=240)
    return outcome, folder / "procs", audit.read_text().splitlines()


@pytest.mark.slow
def test_forking_processes_never_touch_autograd_or_cuda(witnessed):
    """The launchers and warm servers of a silo and of the SuperLink never ran backward
    nor initialised CUDA (the witness), their tripwires were armed before they served and
    never tripped, CUDA was not initialised at any fork (their logs); their forked tasks
    did train (the witness is not blind)."""
    outcome, procs, audit = witnessed
    assert outcome.status == "finished:completed", outcome.problem()
    calls = [line.split() for line in audit]
    forking = ("fedlb-launcher", "fedlb-warm")
    task_pids = {pid for pid, role, _ in calls if role == "fedlb-task"}
    assert task_pids, audit  # forked ClientApps ran backward: the witness sees
    for log_name in ("silo-0.log", "superlink.log"):
        log = (procs / log_name).read_text()
        started = [line for line in log.splitlines() if "torch warmed up for forks" in line]
        forks = [line for line in log.splitlines() if "(forked; " in line]
        assert len(started) == 1, log[-2000:]
        assert len(forks) >= (2 if log_name == "silo-0.log" else 1), log[-2000:]  # per task
        for line in started + forks:
            assert line.endswith(
                "tripwire armed, tripped by nothing, CUDA initialised: no, intra-op threads: 1)"
            ), line
        assert COLD not in log
    # silo-1's forking processes: the tripwire stopped its module's backward before the
    # engine ran, so the witness has nothing of theirs either
    touched = [" ".join(call) for call in calls if call[1] in forking]
    assert touched == [], touched


@pytest.mark.slow
def test_a_preload_that_trains_at_import_runs_the_silo_cold_and_loses_nothing(witnessed):
    outcome, procs, audit = witnessed
    assert outcome.status == "finished:completed", outcome.problem()
    for record in outcome.records:  # every round had both silos' updates
        assert sorted(s.silo for s in record.silos) == ["silo-0", "silo-1"], record
        assert not record.failed, record.failed
    log = (procs / "silo-1.log").read_text()
    (said,) = [line for line in log.splitlines() if COLD in line]
    assert "Flower's own flwr-clientapp process per task" in said
    assert re.search(r"autograd's backward at \S*trains_at_import\.py:4 ", said), said
    assert "not at import or in a --preload module" in said
    cold = re.findall(r"warm: task \d+ runs cold in pid (\d+) \((\S+)\)", log)
    assert len(cold) >= 2, log[-3000:]
    assert all(Path(script).name == "flwr-clientapp" for _, script in cold)
    assert "(forked; " not in log
    # the cold ClientApps (Flower's own processes) trained: both rounds' train messages
    trained = {pid for pid, role, what in (line.split() for line in audit) if what == "backward"}
    assert len({pid for pid, _ in cold} & trained) >= 2, (cold, audit)
    (started,) = [line for line in log.splitlines() if "torch warmed up for forks" in line]
    assert "(not trains_at_import: unsafe to import in a forking process)" in started
    assert "forked from a process that had: autograd's backward at" in started


def test_the_witness_sees_what_it_should(tmp_path):
    """tests/fork_audit records backward and CUDA's initialisation in a process started
    with it on PYTHONPATH (so an empty record above means nothing happened)."""
    audit = tmp_path / "audit.txt"
    program = textwrap.dedent(
        """
        import torch
        weight = torch.ones(1, requires_grad=True)
        weight.sum().backward()
        try:
            torch.zeros(1, device="cuda")
        except Exception:
            pass
        """
    )
    environment = {
        **os.environ,
        "FEDLB_FORK_AUDIT": str(audit),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(AUDIT_DIR), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([sys.executable, "-c", program], env=environment, check=True, timeout=120)
    assert [line.split()[1:] for line in audit.read_text().splitlines()] == [
        ["other", "backward"],
        ["other", "cuda-init"],
    ]
