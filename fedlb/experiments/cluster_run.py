"""Cluster-mode experiments: one data-parallel job of N ranks on this machine (torchrun,
gloo), each rank emulating a machine of its own speed, balanced by a chosen policy.

`launch(scenario)` starts `torchrun --standalone --nproc-per-node N` on this module; every
rank runs `worker(scenario)` on its device (`device`: auto = cuda:LOCAL_RANK where there
are GPUs) with gradients on `backend` (auto = NCCL when every rank has a GPU of its own,
gloo otherwise); the coordinator's exchange is on gloo either way. Rank 0 writes
iterations.jsonl (one line per iteration and rank) and summary.json into the scenario's
`out` folder, and shows a table as it goes.
Every output names its clock: `measured` (real compute, sleep-padded to each rank's
profile).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fedlb.balance import SpeedEstimator, Tuner, ideal_round_time
from fedlb.cluster import (
    CLUSTER_POLICIES,
    DEFAULT_CLUSTER_POLICY,
    ClusterError,
    Exchange,
    LoadBalancer,
)
from fedlb.data import load_digits
from fedlb.models import build_model
from fedlb.training import (
    BASE_SPEED,
    DeviceError,
    choose_device,
    process_group_backend,
    tensor_dataset,
)

from .clocks import GpuLikeTime, ideal_split
from .load import CompetingLoad, MachineProbe
from .profiles import SpeedProfile, preset
from .scenario import scenario_arguments

log = logging.getLogger("fedlb.cluster")


class ClusterScenarioError(ValueError):
    """A cluster scenario setting that cannot run; the message names it."""


@dataclass
class ClusterScenario:
    """One job. `speeds`: relative speed per rank ('1,1,2,4': bigger is faster) times
    `base-speed` samples/s; `traces`: SpeedProfile traces over iterations, one for all or
    one per rank. For lb-gpu each rank's time per iteration is GPU-like: `launch` s plus
    max(B, `saturation`)/speed. `load` > 0 gives every rank a competing process that starts
    or stops with that probability every 0.1 s (see load.py): the rank slows while it runs,
    and its reports carry the competitor's real CPU and memory use."""

    name: str = "cluster"
    nproc: int = 4
    dataset: str = "digits"
    model: str = "mlp"
    iterations: int = 60
    batch_size: int = 32
    learning_rate: float = 0.05
    speeds: str = "1,1,2,4"
    base_speed: float = BASE_SPEED
    traces: str = "static"
    policy: str = DEFAULT_CLUSTER_POLICY
    narx_warmup: int = 500
    launch: float = 0.005
    saturation: int = 8
    load: float = 0.0
    seed: int = 0
    device: str = "auto"
    backend: str = "auto"
    out: str = ""

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> ClusterScenario:
        arguments = scenario_arguments(cls, values, "cluster scenario key", ClusterScenarioError)
        scenario = cls(**arguments)
        scenario.check()
        return scenario

    def to_mapping(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}

    def check(self) -> None:
        if min(self.nproc, self.iterations, self.batch_size) < 1:
            raise ClusterScenarioError("nproc, iterations and batch-size must be >= 1")
        if self.policy not in CLUSTER_POLICIES:
            raise ClusterScenarioError(
                f"policy must be one of {', '.join(CLUSTER_POLICIES)}, got {self.policy!r}"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ClusterScenarioError("learning-rate must be a finite number > 0")
        if not 0 <= self.load <= 1:
            raise ClusterScenarioError(f"load must be a probability in [0, 1], got {self.load}")
        self.placement()
        self.profiles()

    def placement(self, local_rank: int = 0) -> tuple[torch.device, str]:
        """(this rank's device, the gradients' backend); refuses what cannot run here."""
        try:
            device = choose_device(self.device, local_rank)
        except DeviceError as error:
            raise ClusterScenarioError(str(error)) from error
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        shared = math.ceil(self.nproc / gpus) if gpus else 1
        backend = process_group_backend(device, shared) if self.backend == "auto" else self.backend
        if backend not in ("gloo", "nccl"):
            raise ClusterScenarioError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise ClusterScenarioError(
                "backend nccl needs GPUs (device cuda or auto on a machine with GPUs); this "
                f"job's device is {device}: use backend gloo"
            )
        if backend == "nccl" and shared > 1:
            raise ClusterScenarioError(
                f"backend nccl needs a GPU per rank: {self.nproc} ranks, {gpus} GPU(s); use "
                "backend gloo (CUDA tensors over gloo) or nproc <= the GPUs"
            )
        return device, backend

    def profiles(self) -> list[SpeedProfile]:
        try:
            speeds = preset(self.speeds, self.base_speed)
            traces = [t.strip() for t in self.traces.split(",")]
            if len(traces) == 1:
                traces *= len(speeds)
            if len(speeds) != self.nproc or len(traces) != self.nproc:
                raise ClusterScenarioError(
                    f"speeds give {len(speeds)} ranks and traces {len(traces)}, "
                    f"not nproc = {self.nproc}"
                )
            return [
                SpeedProfile(v, 0.0, t, seed=self.seed + r)
                for r, (v, t) in enumerate(zip(speeds, traces, strict=True))
            ]
        except ValueError as error:
            raise ClusterScenarioError(str(error)) from error

    @property
    def gpu_like(self) -> bool:
        """The GPU policy (sizes one iteration late) runs on GPU-like time curves."""
        return CLUSTER_POLICIES[self.policy].asynchronous

    def tuner(self) -> Tuner:
        return CLUSTER_POLICIES[self.policy].make_tuner()

    def estimator(self) -> Callable[[], SpeedEstimator]:
        policy = CLUSTER_POLICIES[self.policy]
        return policy.make_estimator(self.narx_warmup if policy.estimator == "narx" else None)

    def ceiling(self) -> float:
        """BSP's mean iteration time over the ideal's, from the profiles (compute only)."""
        uniform = ideal = 0.0
        profiles = self.profiles()
        for iteration in range(1, self.iterations + 1):
            speeds = {str(r): p.speed_at(iteration) for r, p in enumerate(profiles)}
            uniform += max(self.batch_size / v for v in speeds.values())
            ideal += ideal_round_time(speeds, self.batch_size * self.nproc)
        return uniform / ideal


def _pace(scenario: ClusterScenario, rank: int, iteration: list[int], machine: list[float]) -> Any:
    """The rank's emulated time for a batch: its profile's speed this iteration, times the
    machine's state when the iteration began (machine[0], from the competing load)."""
    profile = scenario.profiles()[rank]

    def pace(real_s: float, batch: int) -> float:
        speed = profile.speed_at(iteration[0]) * machine[0]
        if scenario.gpu_like:
            gpu = GpuLikeTime(speed, launch=scenario.launch, saturation=scenario.saturation)
            return max(real_s, gpu.compute_s(batch))
        return max(real_s, batch / speed)

    return pace


def worker(scenario: ClusterScenario) -> None:
    """One rank of the job (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    torch.set_num_threads(1)  # N ranks share this machine's cores
    device, backend = scenario.placement(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    out = Path(scenario.out)
    if scenario.dataset != "digits":
        raise ClusterScenarioError("cluster experiments run on the embedded digits for now")
    data = load_digits()
    dataset = tensor_dataset(data.x, data.y)
    network = build_model(scenario.model, tuple(data.x.shape[1:]), data.num_classes, scenario.seed)
    model = DistributedDataParallel(
        network.to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=scenario.learning_rate)
    (out / f"rank-{rank}.pid").write_text(str(os.getpid()))
    iteration = [1]
    rows: list[dict[str, Any]] = []
    losses: list[float] = []
    iteration_s: list[float] = []

    def record(exchange: Exchange) -> None:
        speeds = {r.worker: r.speed for r in exchange.reports}
        slowest = max(r.compute_s for r in exchange.reports)
        total = sum(r.batch_size for r in exchange.reports)
        if scenario.gpu_like:  # t(B) is not linear: T* of the GPU-like curves
            models = {
                str(k): GpuLikeTime(
                    p.speed_at(exchange.iteration),
                    launch=scenario.launch,
                    saturation=scenario.saturation,
                )
                for k, p in enumerate(scenario.profiles())
            }
            ideal = ideal_split(models, total)[1]
        else:
            ideal = ideal_round_time(speeds, total)
        for r in exchange.reports:
            rows.append(
                {
                    "iteration": exchange.iteration,
                    "rank": int(r.worker),
                    "batch_size": r.batch_size,
                    "compute_s": r.compute_s,
                    "cpu": r.cpu,
                    "mem": r.mem,
                    "next_batch_size": exchange.sizes[int(r.worker)],
                    "slowest_compute_s": slowest,
                    "ideal_s": ideal,
                    "efficiency": ideal / slowest,
                    "policy": scenario.policy,
                    "device": device.type,
                    "backend": backend,
                    "clock": "measured (emulated speeds)",
                }
            )

    load = None
    machine = [1.0]  # the competing load's slowdown as the iteration began
    if scenario.load > 0:
        load = CompetingLoad(scenario.load, seed=scenario.seed * 100 + rank)
        load.start()
    balancer = LoadBalancer(
        model,
        dataset,
        scenario.batch_size,
        scenario.tuner(),
        scenario.estimator(),
        asynchronous=CLUSTER_POLICIES[scenario.policy].asynchronous,
        pace=_pace(scenario, rank, iteration, machine),
        seed=scenario.seed,
        on_exchange=record if rank == 0 else None,
        probe=MachineProbe(load.pid) if load else None,
    )
    started = time.perf_counter()
    try:
        last = time.perf_counter()
        for x, y in balancer.batches(scenario.iterations):
            # The load's state now, right after the boundary's resource sample, sets this
            # iteration's speed: resources measured at k drive iteration k + 1 (Sec. 3.2.2).
            machine[0] = load.slowdown() if load is not None else 1.0
            loss: torch.Tensor = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(loss.item())
            now = time.perf_counter()
            iteration_s.append(now - last)  # the BSP iteration as this rank lived it
            last = now
            iteration[0] += 1
            if rank == 0 and iteration[0] % 10 == 1:
                log.info(
                    "iteration %d: sizes %s, loss %.3f",
                    iteration[0] - 1,
                    balancer.coordinator.sizes,
                    losses[-1],
                )
        balancer.close()
    except ClusterError as error:
        print(f"fedlb cluster: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from error
    finally:
        if load is not None:
            load.stop()
    wall = time.perf_counter() - started
    if rank == 0:
        with (out / "iterations.jsonl").open("w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
        steady = [r["efficiency"] for r in rows if r["iteration"] > 10 and r["rank"] == 0]
        summary = {
            "scenario": dataclasses.asdict(scenario),
            "clock": "measured (emulated speeds)",
            "device": str(device),
            "backend": backend,
            "wall_s": wall,
            "mean_iteration_s": statistics.fmean(iteration_s[10:] or iteration_s),
            "ceiling": scenario.ceiling(),
            "steady_efficiency": statistics.fmean(steady) if steady else None,
            "final_sizes": balancer.coordinator.sizes,
            # rank 0: the manager's decisions, and whole exchanges (waits for ranks included)
            "controller_s_per_iteration": balancer.coordinator.step_s / scenario.iterations,
            "exchange_s_per_iteration": balancer.coordinator.exchange_s / scenario.iterations,
            "first_losses": losses[:10],
            "last_losses": losses[-10:],
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    # The DDP model (its reducer holds gloo work) goes before the group: one outliving its
    # process group can abort the rank at exit, failing a finished job.
    del balancer, model, optimizer
    dist.destroy_process_group()


def launch(scenario: ClusterScenario, out: Path, timeout: float | None = None) -> int:
    """Run the job with torchrun on this machine; returns its exit code (0: success)."""
    out.mkdir(parents=True, exist_ok=True)
    scenario = dataclasses.replace(scenario, out=str(out.resolve()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only: this is one machine
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={scenario.nproc}",
        "--module",
        "fedlb.experiments.cluster_run",
        json.dumps(scenario.to_mapping()),
    ]
    with (out / "torchrun.log").open("w") as log_file:
        process = subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        (out / "torchrun.pid").write_text(str(process.pid))
        try:
            return process.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            os.killpg(process.pid, 9)
            process.wait()
            raise


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: torch's gloo threads, destroyed during
    it, sometimes abort a rank that has finished ("terminate called without an active
    exception", about 1 run in 10 here), which would fail a job whose results are
    written. Everything that matters is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="fedlb cluster %(message)s")
    try:
        worker(ClusterScenario.from_mapping(json.loads(sys.argv[1])))
    except SystemExit as stop:
        _exit_now(stop.code if isinstance(stop.code, int) else 1)
    _exit_now(0)
