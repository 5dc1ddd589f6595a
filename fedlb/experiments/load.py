"""A competing load for one emulated machine (LB-BSP Section 5.4.2): a process that, every
period, starts or stops with some probability; while it runs it burns a share of a core
and holds memory. The rank it shares the "machine" with slows down accordingly, and the
rank's resource probe sees the competitor's real CPU and memory use, so an estimator that
reads resources (NARX) has a real signal to learn from.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
import os
import random
import time
from typing import Any

import psutil

from fedlb.training import ResourceSample

SLICE_S = 0.02  # the busy loop's duty cycle is kept over slices this long
MACHINE_MEMORY_MB = 2048.0  # what an emulated machine has, for the memory fraction


def _competitor(
    running: Any, duty: Any, memory_mb: Any, switch_prob: float, period_s: float, seed: int
) -> None:
    rng = random.Random(seed)
    held: list[bytes] = []  # the memory it holds while it runs
    next_switch = time.monotonic() + period_s
    while True:
        now = time.monotonic()
        if now >= next_switch:
            next_switch = now + period_s
            if rng.random() < switch_prob:
                if running.value:
                    running.value, duty.value, memory_mb.value = False, 0.0, 0
                    held.clear()
                else:  # every episode has its own appetite; it takes its CPU share at
                    # once, and its memory over the allocation that follows
                    duty.value = rng.uniform(0.2, 0.75)
                    memory_mb.value = rng.randint(50, 400)
                    running.value = True
                    block = bytearray(memory_mb.value * 1024 * 1024)
                    block[::4096] = b"\x01" * len(range(0, len(block), 4096))  # resident
                    held.append(bytes(block))
        if running.value:
            busy_until = time.monotonic() + SLICE_S * duty.value
            while time.monotonic() < busy_until:
                pass
            time.sleep(SLICE_S * (1.0 - duty.value))
        else:
            time.sleep(SLICE_S)


class CompetingLoad:
    """Start with `start()`, read `slowdown()` (the factor the machine's speed is at),
    stop with `stop()` (by PID). `switch_prob`: chance per `period_s` that it starts or
    stops."""

    def __init__(self, switch_prob: float = 0.08, period_s: float = 0.1, seed: int = 0) -> None:
        if not 0 < switch_prob <= 1:
            raise ValueError(f"switch probability must be in (0, 1], got {switch_prob}")
        context = multiprocessing.get_context("spawn")
        self.running: Any = context.Value("b", False)
        self.duty: Any = context.Value("d", 0.0)
        self.memory_mb: Any = context.Value("i", 0)
        self.process = context.Process(
            target=_competitor,
            args=(self.running, self.duty, self.memory_mb, switch_prob, period_s, seed),
            daemon=True,
        )

    def start(self) -> None:
        self.process.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def slowdown(self) -> float:
        """Speed factor of the machine now: 1 - 0.8 x the competitor's CPU share (the
        relation of `fedlb.balance.competing_load_trace`)."""
        return 1.0 - 0.8 * float(self.duty.value) if self.running.value else 1.0

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


class MachineProbe:
    """Resource use of one emulated machine: this rank's process plus its competitor, as
    fractions of one core and of MACHINE_MEMORY_MB (a stand-in for `ResourceProbe`, which
    measures the whole host that all ranks share here)."""

    def __init__(self, competitor_pid: int) -> None:
        self.processes = [psutil.Process(os.getpid()), psutil.Process(competitor_pid)]
        for process in self.processes:
            process.cpu_percent(None)  # primes the counters

    def sample(self) -> ResourceSample:
        cpu = sum(p.cpu_percent(None) for p in self.processes) / 100.0
        memory = sum(p.memory_info().rss for p in self.processes) / 1024 / 1024
        return ResourceSample(
            cpu=min(1.0, cpu), mem=min(1.0, memory / MACHINE_MEMORY_MB), accel_mem=None
        )
