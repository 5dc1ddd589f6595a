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
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import vector_to_parameters
from torch.utils.data import DataLoader, TensorDataset

from fedlb.balance import SpeedEstimator, Tuner, ideal_round_time
from fedlb.cluster import (
    DEFAULT_CLUSTER_POLICY,
    ClusterError,
    DataPartitionManager,
    Shard,
    Snapshot,
    parse_policy,
)
from fedlb.data import DATASETS, LabelledData, federation_pool, parse_partition, partition
from fedlb.models import MODELS, build_model
from fedlb.training import (
    BASE_SPEED,
    DeviceError,
    Pace,
    ResizableBatchSampler,
    choose_device,
    evaluate,
    process_group_backend,
    tensor_dataset,
)

from .clocks import GpuLikeTime
from .cluster_jobs import (
    MEASURED,
    JobOutcome,
    bsp_job,
    eager_job,
    job_store,
    local_job,
    ps_job,
)
from .load import CompetingLoad
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
    data_dir: str = ""
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
    snapshot_s: float = 1.0
    eval_samples: int = 2000
    target_accuracy: float = 0.0
    batch_sizes: str = ""
    shards: str = ""
    partition_manager: bool = False
    partition_threshold: float = 2.0
    partition_check: int = 10
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
        try:
            name, policy, parameter = parse_policy(self.policy)
        except ValueError as error:
            raise ClusterScenarioError(str(error)) from error
        if name == "backup" and parameter is not None and parameter >= self.nproc:
            raise ClusterScenarioError(
                f"{self.policy}: K backup workers must be fewer than the {self.nproc} workers"
            )
        if policy.engine != "bsp" and self.backend == "nccl":
            raise ClusterScenarioError(
                f"{self.policy} runs on the CPU for now (backend gloo / RPC): drop backend nccl"
            )
        if self.dataset not in DATASETS:
            raise ClusterScenarioError(
                f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}"
            )
        if self.model not in MODELS:
            raise ClusterScenarioError(
                f"model must be one of {', '.join(MODELS)}, got {self.model!r}"
            )
        if self.snapshot_s <= 0 or self.eval_samples < 1 or not 0 <= self.target_accuracy <= 1:
            raise ClusterScenarioError(
                "snapshot-s must be > 0, eval-samples >= 1, target-accuracy in [0, 1]"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ClusterScenarioError("learning-rate must be a finite number > 0")
        if not 0 <= self.load <= 1:
            raise ClusterScenarioError(f"load must be a probability in [0, 1], got {self.load}")
        self.placement()
        self.profiles()
        sizes = self.initial_sizes()
        if len(sizes) != self.nproc or min(sizes) < 1:
            raise ClusterScenarioError(
                f"batch-sizes needs one size >= 1 per rank ({self.nproc}), got {self.batch_sizes!r}"
            )
        if self.shards:
            try:
                parse_partition(self.shards)
            except ValueError as error:
                raise ClusterScenarioError(f"shards: {error}") from error
            if policy.engine != "bsp":
                raise ClusterScenarioError(
                    f"shards (rank-local data) run with the BSP policies, not {self.policy}"
                )
        if self.partition_manager and not self.shards:
            raise ClusterScenarioError("partition-manager needs shards (e.g. classes:2)")
        if not self.partition_threshold > 0 or self.partition_check < 1:
            raise ClusterScenarioError("partition-threshold must be > 0, partition-check >= 1")

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
        return parse_policy(self.policy)[1].asynchronous

    def initial_sizes(self) -> list[int]:
        """Every rank's first batch size: batch-sizes, or batch-size for each."""
        if not self.batch_sizes:
            return [self.batch_size] * self.nproc
        try:
            return [int(b) for b in self.batch_sizes.split(",")]
        except ValueError as error:
            raise ClusterScenarioError(
                f"batch-sizes must be whole numbers, got {self.batch_sizes!r}"
            ) from error

    @property
    def processes(self) -> int:
        """torchrun's processes: the workers, and a parameter server's own process."""
        return self.nproc + (parse_policy(self.policy)[1].engine == "ps")

    def tuner(self) -> Tuner:
        return parse_policy(self.policy)[1].make_tuner()

    def estimator(self) -> Callable[[], SpeedEstimator]:
        policy = parse_policy(self.policy)[1]
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


def _pace(scenario: ClusterScenario, worker: int, machine: Callable[[], float]) -> Pace:
    """Worker `worker`'s emulated time for a batch: its profile's speed at its current
    iteration (each call is one iteration), times the machine's state (`machine()`: the
    competing load's slowdown, 1 without one)."""
    profile = scenario.profiles()[worker]
    iteration = [0]

    def pace(real_s: float, batch: int) -> float:
        iteration[0] += 1
        speed = profile.speed_at(iteration[0]) * machine()
        if scenario.gpu_like:
            gpu = GpuLikeTime(speed, launch=scenario.launch, saturation=scenario.saturation)
            return max(real_s, gpu.compute_s(batch))
        return max(real_s, batch / speed)

    return pace


def _batches(
    dataset: TensorDataset, batch_size: int, seed: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches drawn from the whole dataset, seeded per worker."""
    sampler = ResizableBatchSampler(dataset, batch_size, seed=seed)
    for x, y in DataLoader(dataset, batch_sampler=sampler):
        yield x.to(device), y.to(device)


def evaluate_snapshots(
    model: nn.Module, snapshots: list[Snapshot], test: TensorDataset
) -> list[dict[str, float]]:
    """Each snapshot's test accuracy and loss (after the job: the timed run paid none)."""
    curve = []
    for snap in snapshots:
        vector_to_parameters(snap.weights, model.parameters())
        loss, accuracy = evaluate(model, test)
        curve.append(
            {
                "seconds": snap.seconds,
                "updates": snap.updates,
                "samples": snap.samples,
                "accuracy": accuracy,
                "loss": loss,
            }
        )
    return curve


def to_target(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first point of the curve at or above `target` accuracy (None: never)."""
    return next((point for point in curve if point["accuracy"] >= target), None)


def _shard_manager(
    scenario: ClusterScenario, rank: int, dataset: TensorDataset
) -> Callable[[], DataPartitionManager]:
    """This rank's own shard of the data (`shards`: iid or classes:K), behind a partition
    manager; without `partition-manager` it never moves a sample (only counts)."""

    def make() -> DataPartitionManager:
        x, y = dataset.tensors
        parts = partition(y.numpy(), scenario.nproc, scenario.shards, scenario.seed)
        index = torch.as_tensor(parts[rank], dtype=torch.long)
        threshold = scenario.partition_threshold if scenario.partition_manager else math.inf
        return DataPartitionManager(
            Shard(x[index], y[index], index),
            scenario.initial_sizes()[rank],
            threshold=threshold,
            check_every=scenario.partition_check,
            seed=scenario.seed,
        )

    return make


def worker(scenario: ClusterScenario) -> None:
    """One rank of the job (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    torch.set_num_threads(1)  # N ranks share this machine's cores
    rank = int(os.environ["RANK"])
    device, backend = scenario.placement(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(scenario.out)
    (out / f"rank-{rank}.pid").write_text(str(os.getpid()))
    train, test = federation_pool(scenario.dataset, scenario.data_dir, 0, 0.2, scenario.seed)
    dataset = tensor_dataset(train.x, train.y)
    network = build_model(
        scenario.model, tuple(train.x.shape[1:]), train.num_classes, scenario.seed
    )
    name, policy, parameter = parse_policy(scenario.policy)
    # the parameter server is rank 0 of a ps job; its workers are ranks 1..nproc
    worker_index = rank - 1 if policy.engine == "ps" else rank
    load = None
    if scenario.load > 0 and worker_index >= 0:
        load = CompetingLoad(scenario.load, seed=scenario.seed * 100 + worker_index)
        load.start()
    slowdown = [1.0]  # bsp: the load's state as the iteration began (its loop sets it)

    def machine() -> float:
        if policy.engine == "bsp":
            return slowdown[0]
        return load.slowdown() if load is not None else 1.0

    pace = _pace(scenario, worker_index, machine) if worker_index >= 0 else None
    batches = _batches(dataset, scenario.batch_size, scenario.seed * 1009 + rank, device)
    try:
        if policy.engine == "bsp":
            data = _shard_manager(scenario, rank, dataset) if scenario.shards else dataset
            outcome = bsp_job(
                scenario, rank, network.to(device), data, device, backend, pace, load, slowdown
            )
        elif policy.engine == "ps":
            kind = name
            updates = scenario.iterations * (scenario.nproc if kind != "backup" else 1)
            outcome = ps_job(
                scenario.policy,
                kind,
                parameter,
                rank,
                scenario.nproc + 1,
                network,
                batches,
                scenario.learning_rate,
                updates,
                scenario.snapshot_s,
                pace,
                scenario.batch_size,
            )
        else:  # local SGD and eager-SGD: collectives on the job's process group
            dist.init_process_group(backend)
            model = network.to(device)
            lr, snapshot_s, batch = scenario.learning_rate, scenario.snapshot_s, scenario.batch_size
            if policy.engine == "local":
                assert parameter is not None
                outcome = local_job(
                    scenario.policy, parameter, rank, model, batches, lr,
                    scenario.iterations, snapshot_s, pace, batch,
                )  # fmt: skip
            else:
                mode = name.removeprefix("eager-")
                outcome = eager_job(
                    scenario.policy, mode, rank, model, batches, lr, scenario.iterations,
                    snapshot_s, pace, batch, job_store(), scenario.seed,
                )  # fmt: skip
            dist.barrier()
            dist.destroy_process_group()
    except (ClusterError, RuntimeError) as error:  # RPC's failures are RuntimeErrors
        reason = str(error) if isinstance(error, ClusterError) else f"rank {rank}: {error}"
        print(f"fedlb cluster: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(1) from error
    finally:
        if load is not None:
            load.stop()
    with (out / f"iterations-rank-{rank}.jsonl").open("w") as handle:
        for row in outcome.rows:
            handle.write(json.dumps({**row, "device": device.type, "backend": backend}) + "\n")
    if rank == 0:
        _summarise(scenario, outcome, network.to("cpu"), test, device, backend)


def _summarise(
    scenario: ClusterScenario,
    outcome: JobOutcome,
    network: nn.Module,
    test: LabelledData,
    device: torch.device,
    backend: str,
) -> None:
    """summary.json: the job's hardware side (time per update) and statistical side
    (accuracy over time and updates, from the snapshots)."""
    held_out = tensor_dataset(test.x[: scenario.eval_samples], test.y[: scenario.eval_samples])
    curve = evaluate_snapshots(network, outcome.snapshots, held_out)
    target = to_target(curve, scenario.target_accuracy) if scenario.target_accuracy else None
    summary = {
        "scenario": dataclasses.asdict(scenario),
        "clock": MEASURED,
        "device": str(device),
        "backend": backend,
        "wall_s": outcome.wall_s,
        "updates": outcome.updates,
        "mean_update_s": outcome.wall_s / outcome.updates if outcome.updates else None,
        "ceiling": scenario.ceiling(),
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "target_accuracy": scenario.target_accuracy or None,
        "time_to_target_s": None if target is None else target["seconds"],
        "updates_to_target": None if target is None else target["updates"],
        "samples_to_target": None if target is None else target["samples"],
        "accuracy": curve,
        "first_losses": outcome.losses[:10],
        "last_losses": outcome.losses[-10:],
        **outcome.extra,
    }
    (Path(scenario.out) / "summary.json").write_text(json.dumps(summary, indent=2))


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
        f"--nproc-per-node={scenario.processes}",
        "--module",
        "fedlb.experiments.cluster_run",
        json.dumps(scenario.to_mapping()),
    ]
    with (out / "torchrun.log").open("w") as log_file:
        process = subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        (out / "torchrun.pid").write_text(str(process.pid))
        replaced = None
        if threading.current_thread() is threading.main_thread():
            # stopped by SIGTERM (a scheduler, `timeout`): the job goes too, not left running
            replaced = signal.signal(signal.SIGTERM, _interrupt)
        try:
            code = process.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            _stop(process, out)
            raise
        finally:
            if replaced is not None:
                signal.signal(signal.SIGTERM, replaced)
    parts = sorted(out.glob("iterations-rank-*.jsonl"), key=lambda p: int(p.stem.split("-")[-1]))
    with (out / "iterations.jsonl").open("w") as merged:
        for part in parts:
            merged.write(part.read_text())
            part.unlink()
    return code


def _stop(process: subprocess.Popen[bytes], out: Path) -> None:
    """Stop a job: torchrun first (it stops its ranks, which run in sessions of their
    own), then whatever is left, by the PIDs the ranks wrote (only processes that are
    still this module's ranks)."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for pid_file in out.glob("rank-*.pid"):
        pid = int(pid_file.read_text())
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone
        if b"fedlb.experiments.cluster_run" in command:
            os.kill(pid, signal.SIGKILL)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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
