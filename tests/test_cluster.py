"""Cluster mode on real gloo process groups (CPU): the weighted all-reduce is exact, the
coordinator balances emulated heterogeneous ranks, a dead rank stops the job."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fedlb.cluster import weighted_allreduce_hook
from fedlb.cluster.hook import WeightedState

SIZES = (5, 11, 16)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(sum(SIZES), 8, generator=generator), torch.randint(
        0, 3, (sum(SIZES),), generator=generator
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _init(rank: int, world: int, store: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _one_step(rank: int, store: str, out: str, weighted: bool) -> None:
    _init(rank, len(SIZES), store)
    x, y = _data()
    start = sum(SIZES[:rank])
    model = DistributedDataParallel(_model())
    if weighted:
        state = WeightedState(weight=SIZES[rank] / sum(SIZES))
        model.register_comm_hook(state, weighted_allreduce_hook)
    loss = nn.functional.cross_entropy(
        model(x[start : start + SIZES[rank]]), y[start : start + SIZES[rank]]
    )
    loss.backward()
    if rank == 0:
        torch.save([p.grad for p in model.parameters()], out)
    # All ranks done, then the DDP model (and its gloo work) gone before the group: a DDP
    # reducer outliving its process group can abort the process at exit.
    dist.barrier()
    del model
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo threads can abort at interpreter teardown (cluster_run.py)


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [True, False])
def test_weighted_aggregation_equals_one_process_on_the_union(tmp_path, weighted):
    out = tmp_path / "grads.pt"
    mp.spawn(_one_step, args=(str(tmp_path / "store"), str(out), weighted), nprocs=len(SIZES))
    distributed = torch.load(out)
    x, y = _data()
    model = _model()
    nn.functional.cross_entropy(model(x), y).backward()
    union = [p.grad for p in model.parameters()]
    close = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(distributed, union, strict=True))
    # the hook: exactly the gradient of the union batch; DDP's plain average: not
    assert close is weighted


@pytest.mark.slow
def test_four_ranks_converge_to_their_speeds_under_torchrun(tmp_path):
    """torchrun, 4 gloo ranks at speeds 1 : 1 : 2 : 4 (sleep-padded): sizes follow the
    speeds with X kept, the loss goes down, every process is gone afterwards."""
    import json

    from fedlb.experiments import ClusterScenario, launch

    scenario = ClusterScenario.from_mapping(
        {"iterations": 40, "speeds": "1,1,2,4", "policy": "lb-ema", "learning-rate": 0.1}
    )
    code = launch(scenario, tmp_path, timeout=240)
    assert code == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_sizes"] == [16, 16, 32, 64]
    assert summary["steady_efficiency"] > 0.9
    first, last = summary["first_losses"], summary["last_losses"]
    assert sum(last) / len(last) < sum(first) / len(first)
    rows = [json.loads(line) for line in (tmp_path / "iterations.jsonl").read_text().splitlines()]
    by_iteration: dict[int, int] = {}
    for row in rows:
        by_iteration[row["iteration"]] = by_iteration.get(row["iteration"], 0) + row["batch_size"]
    assert set(by_iteration.values()) == {128}  # X = 4 x 32 in every iteration
    for pid_file in tmp_path.glob("rank-*.pid"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lb-ema", "asp", "eager-solo"])
def test_a_rank_that_dies_fails_the_job_with_a_clear_message(tmp_path, policy):
    """BSP, the parameter server and eager-SGD alike: a killed worker stops the job with
    its reason, no rank hangs or is left behind."""
    import signal
    import subprocess
    import sys
    import time

    command = [
        sys.executable,
        "-m",
        "fedlb.cli",
        "cluster",
        "--policies",
        policy,
        "--iterations",
        "100000",
        "--out",
        str(tmp_path),
    ]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim = tmp_path / policy / "rank-2.pid"
        deadline = time.monotonic() + 120
        while not victim.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # well into training
        os.kill(int(victim.read_text()), signal.SIGKILL)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, output
    flat = " ".join(output.split())  # the console wraps long lines
    assert "the job failed" in flat
    # torchrun's root cause, or a surviving rank's own report of the lost peer
    assert "rank 2 was killed by signal 9" in flat or "has probably died" in flat, flat
    for pid_file in (tmp_path / policy).glob("rank-*.pid"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


@pytest.mark.slow
def test_the_adoption_example_runs_under_torchrun(tmp_path):
    """examples/cluster_train.py: a plain training script plus the lines marked fedlb."""
    import subprocess
    import sys

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "examples/cluster_train.py",
            "--iterations",
            "30",
            "--slowdowns",
            "1,3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    final = [line for line in result.stdout.splitlines() if line.startswith("final sizes")]
    assert final == ["final sizes [48, 16] (X = 64)"], result.stdout


@pytest.mark.slow
def test_the_competing_load_runs_and_sleeps_and_is_measured():
    import time

    from fedlb.experiments import CompetingLoad, MachineProbe

    load = CompetingLoad(switch_prob=1.0, period_s=0.3, seed=1)  # toggles every 0.3 s
    load.start()
    try:
        probe = MachineProbe(load.pid)
        seen = set()
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            seen.add(load.slowdown() < 1.0)
            time.sleep(0.05)
        assert seen == {True, False}  # it ran and it slept
        sample = probe.sample()
        assert 0 <= sample.cpu <= 1
        assert 0 < sample.mem <= 1
        assert all(0.4 <= load.slowdown() <= 1.0 for _ in range(5))
    finally:
        load.stop()
    assert not load.process.is_alive()


def test_the_shipped_cluster_scenarios_parse():
    from pathlib import Path

    from fedlb.deploy import read_toml
    from fedlb.experiments import ClusterScenario

    for path in sorted(Path("scenarios/cluster").glob("*.toml")):
        values = read_toml(path, "cluster scenario")
        for policy in str(values.pop("policies")).split(","):
            assert ClusterScenario.from_mapping({**values, "policy": policy}).nproc >= 1


@pytest.mark.slow
def test_stopping_fedlb_cluster_stops_its_job(tmp_path):
    """SIGTERM to `fedlb cluster` (a scheduler, `timeout`) takes the torchrun job with it:
    its ranks run in sessions of their own, so they are stopped by their PIDs too."""
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "fedlb.cli", "cluster", "--policies", "asp"]
    command += ["--iterations", "100000", "--out", str(tmp_path)]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        folder = tmp_path / "asp"
        deadline = time.monotonic() + 120
        while len(list(folder.glob("rank-*.pid"))) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    pids = [int(p.read_text()) for p in (tmp_path / "asp").glob("rank-*.pid")]
    assert len(pids) == 5  # the parameter server and 4 workers
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_reason_given_for_a_failed_job_is_its_root_cause(tmp_path):
    """torchrun names as root cause the first rank to report, often a survivor that lost
    its peer; a rank killed by a signal is the reason, fedlb's own message next, then
    torchrun's root cause. SIGTERM is torchrun stopping the rest, never the cause."""
    from fedlb.cli.cluster import _failure

    def entry(rank: int, code: str) -> str:
        return f"  time      : t\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code}\n"

    log = tmp_path / "torchrun.log"
    lost = "fedlb cluster: rank 0: [pair.cc:553] Connection closed by peer\n"
    root = "Root Cause (first observed failure):\n[0]:\n"
    log.write_text(lost + "failed (exitcode: 1) local_rank: 0\nFailures:\n[1]:\n")
    log.write_text(log.read_text() + entry(2, "-9 (pid: 7)  (SIGKILL)") + root + entry(0, "1"))
    assert _failure(log) == "rank 2 was killed by signal 9; the job stopped"
    log.write_text("fedlb cluster: rank 1: bad batch size\n" + root + entry(1, "1"))
    assert _failure(log) == "rank 1: bad batch size"
    log.write_text("Failures:\n" + entry(0, "-15 (SIGTERM)") + root + entry(3, "2"))
    assert _failure(log) == "rank 3 exited with 2; the job stopped"
    log.unlink()
    assert _failure(log) == "see the log"


@pytest.mark.slow
def test_ranks_on_measured_step_time_curves_under_torchrun(tmp_path):
    """Two gloo ranks emulating the H200 and one CPU thread on the mlp's curves (× 50, so
    sleep dominates this machine's compute): each iteration lasts at least its curve's
    time, T* is over the curves, and every output names them."""
    import json

    from fedlb.experiments import ClusterScenario, launch
    from fedlb.training import step_curve

    scenario = ClusterScenario.from_mapping(
        {"nproc": 2, "iterations": 12, "speeds": "curve:h200/mlp*50,curve:cpu1/mlp*50"}
    )
    code = launch(scenario, tmp_path, timeout=240)
    assert code == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    label = "measured (curves: rank-0 h200/mlp*50, rank-1 cpu1/mlp*50)"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["clock"] == label
    curves = [step_curve("h200/mlp*50"), step_curve("cpu1/mlp*50")]
    best = min(max(curves[0].seconds(a), curves[1].seconds(64 - a)) for a in range(1, 64))
    rows = [json.loads(line) for line in (tmp_path / "iterations.jsonl").read_text().splitlines()]
    assert {row["clock"] for row in rows} == {label}
    for row in rows:
        assert row["compute_s"] >= curves[row["rank"]].seconds(row["batch_size"]) * 0.999
        if "ideal_s" in row:
            assert row["ideal_s"] == pytest.approx(best)
            assert row["efficiency"] <= 1.0 + 1e-9
