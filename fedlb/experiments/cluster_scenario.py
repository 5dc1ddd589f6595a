"""A cluster job's settings (`fedlb cluster`, cluster scenario files): ranks and their
emulated speeds, the policy, data and model, placement (device, backend), what to record,
and shard-local data. Checked whole before anything starts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedlb.balance import SpeedEstimator, StepCurve, Tuner, ideal_round_time
from fedlb.cluster import DEFAULT_CLUSTER_POLICY, parse_policy
from fedlb.data import DATASETS, parse_partition
from fedlb.models import MODELS
from fedlb.training import (
    BASE_SPEED,
    DeviceError,
    choose_device,
    model_dataset_problem,
    process_group_backend,
)

from .clocks import CurveTime, GpuLikeTime, LinearTime, TimeModel, ideal_split
from .profiles import SpeedProfile, clock_label, silo_speeds
from .scenario import scenario_arguments


class ClusterScenarioError(ValueError):
    """A cluster scenario setting that cannot run; the message names it."""


@dataclass
class ClusterScenario:
    """One job. `speeds`: relative speed per rank ('1,1,2,4': bigger is faster) times
    `base-speed` samples/s, or 'curve:NAME' for a rank whose iterations follow a measured
    step-time curve ('curve:h200/cnn', 'curve:cpu1/cnn*20': fedlb.training's STEP_CURVES,
    the job's model's); `traces`: SpeedProfile traces over iterations, one for all or one
    per rank. For lb-gpu each rank's time per iteration is GPU-like: `launch` s plus
    max(B, `saturation`)/speed (a rank on a curve: its curve). `load` > 0 gives every rank
    a competing process that starts or stops with that probability every 0.1 s (see
    load.py): the rank slows while it runs, and its reports carry the competitor's real CPU
    and memory use.

    name: the job's name (a file's: its stem).
    data_dir: where the dataset's files are ('' : its default place; see datasets/).
    learning_rate: η, SGD's learning rate on every rank, whatever its batch size.
    policy: the policy this job runs, a name of fedlb.cluster.CLUSTER_POLICIES with its
        parameter where it takes one ('ssp:3', 'backup:1', 'orchestra:4'). A scenario
        file names several as `policies` (default 'bsp,lb'; --policies wins), and
        `fedlb cluster` runs one job per policy.
    narx_warmup: lb-narx's reports before NARX predicts (an EMA before).
    launch, saturation: lb-gpu's GPU-like time per iteration: launch seconds plus
        max(B, saturation)/speed.
    seed: seed of the data order, the model and the ranks' speed traces.
    snapshot_s: seconds between snapshots of the weights, evaluated after the job (the
        accuracy over wall time in summary.json; the timed run pays no evaluation).
    eval_samples: test samples each snapshot is evaluated on.
    batch_sizes: every rank's first batch size, one per rank ('64,96,128': the paper's
        fixed unequal sizes, kept under bsp); '' : batch_size for each.
    shards: each rank holds only its own shard of the data, split by a partitioner of
        fedlb.data ('iid', 'classes:2'); '' : every rank samples the whole dataset.
    partition_manager: with shards, LB-BSP's data-partition manager moves samples so no
        shard is traversed much more often than another (DataPartitionManager).
    partition_threshold: the most- and least-traversed shards' passes may differ by this
        factor before samples move (the paper's 2).
    partition_check: iterations between the ranks' exchanges of their passes.
    """

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
        pairing = model_dataset_problem(self.model, self.dataset)
        if pairing is not None:
            raise ClusterScenarioError(pairing)
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
            if policy.engine not in ("bsp", "orchestra"):
                raise ClusterScenarioError(
                    f"shards (rank-local data) run with the BSP policies and orchestra, not "
                    f"{self.policy}"
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
            speeds = silo_speeds(self.speeds, self.base_speed)
            traces = [t.strip() for t in self.traces.split(",")]
            if len(traces) == 1:
                traces *= len(speeds)
            if len(speeds) != self.nproc or len(traces) != self.nproc:
                raise ClusterScenarioError(
                    f"speeds give {len(speeds)} ranks and traces {len(traces)}, "
                    f"not nproc = {self.nproc}"
                )
            for r, v in enumerate(speeds):
                if isinstance(v, StepCurve) and v.model != self.model:
                    # a curve times its own model only
                    raise ClusterScenarioError(
                        f"rank {r}'s step-time curve {v.name} was measured on model {v.model}, "
                        f"but the job trains {self.model}: give it a {self.model} curve, or "
                        f'model = "{v.model}"'
                    )
            return [
                SpeedProfile.on_curve(v, 0.0, t, seed=self.seed + r)
                if isinstance(v, StepCurve)
                else SpeedProfile(v, 0.0, t, seed=self.seed + r)
                for r, (v, t) in enumerate(zip(speeds, traces, strict=True))
            ]
        except ValueError as error:
            raise ClusterScenarioError(str(error)) from error

    def clock_label(self) -> str:
        """Its clock as every output names it: "measured (emulated speeds)", or with the
        ranks' curves, "measured (curves: rank-0 h200/cnn, rank-1 cpu1/cnn)"."""
        profiles = self.profiles()
        if all(p.curve is None for p in profiles):
            return "measured (emulated speeds)"
        return clock_label("measured", profiles, who="rank")

    def time_models(self, iteration: int, measured: Mapping[str, float]) -> dict[str, TimeModel]:
        """Each rank's compute in `iteration` as a time model (by rank, as text): its curve,
        else GPU-like (lb-gpu), else linear at the speed `measured` for it."""
        models: dict[str, TimeModel] = {}
        for rank, profile in enumerate(self.profiles()):
            curve = profile.curve_at(iteration)
            if curve is not None:
                models[str(rank)] = CurveTime(curve)
            elif self.gpu_like:
                models[str(rank)] = GpuLikeTime(
                    profile.speed_at(iteration), launch=self.launch, saturation=self.saturation
                )
            else:
                models[str(rank)] = LinearTime(measured[str(rank)])
        return models

    def ideal_s(self, iteration: int, total: int, measured: Mapping[str, float]) -> float:
        """T* of one iteration's compute, X = `total`: over the speeds `measured` (rank ->
        samples/s) where t(B) is linear, else over the ranks' curves and GPU-like times."""
        if not self.gpu_like and all(p.curve is None for p in self.profiles()):
            return ideal_round_time(measured, total)
        return ideal_split(self.time_models(iteration, measured), total)[1]

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
        curves = any(p.curve is not None for p in profiles)
        for iteration in range(1, self.iterations + 1):
            speeds = {str(r): p.speed_at(iteration) for r, p in enumerate(profiles)}
            if not curves:
                uniform += max(self.batch_size / v for v in speeds.values())
                ideal += ideal_round_time(speeds, self.batch_size * self.nproc)
                continue
            models = {str(r): p.time_model(iteration) for r, p in enumerate(profiles)}
            uniform += max(m.compute_s(self.batch_size) for m in models.values())
            ideal += ideal_split(models, self.batch_size * self.nproc)[1]
        return uniform / ideal
