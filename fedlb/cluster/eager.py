"""eager-SGD's partial all-reduce (Li et al., PPoPP'20) on torch.distributed process groups.

Every rank keeps a send buffer. When a rank has its gradient it adds it to the buffer and
waits for the next collective. A collective is started by an *initiator*: in `solo` mode
the first rank that has a gradient, in `majority` mode a rank drawn at random for that
collective (the same draw on every rank), so that on average about half are ready when it
starts. Every rank's background progress thread then joins the same all-reduce with
whatever its buffer holds: a rank still computing contributes zeros, or the gradients it
finished after the previous collective. Its late gradient is not lost: it goes into the
buffer when ready and is summed into a later collective (the paper's stale-gradient
accumulation). Every rank applies every collective's result, in order, so the replicas
stay identical. At the end a last, blocking all-reduce flushes what is still in the
buffers: the sum of all results equals the sum of all gradients computed.

The activation (who starts collective t) travels through the job's key-value store
(`go/t`), as eager-SGD's activation message does; the data through gloo's all-reduce on a
group of the job (NCCL works too where gradients live on GPUs). No transport of fedlb's own.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from .coordinator import ClusterError

EAGER_MODES = ("solo", "majority")
POLL_S = 0.002  # how often a waiting progress thread looks for another rank's activation


@dataclass
class EagerLog:
    """One rank's record: per collective, how many fresh gradients went into it (the same
    on every rank); this rank's gradients deposited, and the seconds it waited."""

    contributors: list[int] = field(default_factory=list)
    deposited: int = 0
    wait_s: float = 0.0
    deposited_sum: torch.Tensor | None = None  # Σ of this rank's gradients (for checks)
    applied_sum: torch.Tensor | None = None  # Σ of all results (world × mean), all ranks


class PartialAllreduce:
    """One rank's side of eager-SGD.

    Args:
        size: elements of the flattened gradient.
        mode: solo or majority.
        collectives: partial all-reduces in the job (then one flush).
        store: the job's key-value store (torchrun's TCPStore; a FileStore in tests).
        group: the process group of the all-reduces (default: the whole job).
        seed: the majority mode's draw of initiators.
        timeout_s: how long to wait for another rank before the job is declared dead.
    """

    def __init__(
        self,
        size: int,
        mode: str,
        collectives: int,
        store: Store,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        timeout_s: float = 120.0,
    ) -> None:
        if mode not in EAGER_MODES:
            raise ValueError(f"mode must be one of {', '.join(EAGER_MODES)}, got {mode!r}")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.mode = mode
        self.collectives = collectives
        self.store = PrefixStore("fedlb-eager/", store)
        self.store.set_timeout(timedelta(seconds=timeout_s))
        self.group = group
        self.timeout_s = timeout_s
        self._initiators = random.Random(seed)
        self.log = EagerLog(
            deposited_sum=torch.zeros(size, dtype=torch.float64),
            applied_sum=torch.zeros(size, dtype=torch.float64),
        )
        self._buffer = torch.zeros(size)
        self._fresh = 0  # gradients in the buffer
        self._deposits = 0  # gradients ever deposited
        self._consumed = 0  # deposits taken by a collective
        self._results: list[torch.Tensor] = []
        self._taken = 0  # results handed to the main thread
        self._stopping = False  # the partial collectives are over
        self._final = threading.Event()  # the main thread computes no more
        self._finished = False  # the flush is done
        self._error: BaseException | None = None
        self._arrived = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="fedlb-eager", daemon=True)
        self._thread.start()

    # ---- the main thread ----------------------------------------------------------------

    def exchange(self, gradient: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
        """Deposit this iteration's gradient (flattened, the mean over the batch) and wait
        until a collective has taken it. Returns (the results not yet returned, each the
        sum over ranks divided by the world size, to apply in order; whether the job goes
        on). Once the partial collectives are over it returns at once with False."""
        began = time.perf_counter()
        with self._cond:
            self._buffer += gradient
            self._fresh += 1
            self._deposits += 1
            self.log.deposited += 1
            assert self.log.deposited_sum is not None
            self.log.deposited_sum += gradient.double()
            mine = self._deposits
            self._arrived.set()
            self._wait(lambda: self._consumed >= mine or self._stopping)
            results = self._results[self._taken :]
            self._taken = len(self._results)
            going_on = not self._stopping
        self.log.wait_s += time.perf_counter() - began
        return results, going_on

    def finish(self) -> list[torch.Tensor]:
        """No more gradients from this rank: join the flush and return the results not
        yet returned (the flush's last)."""
        self._final.set()
        with self._cond:
            self._wait(lambda: self._finished)
            results = self._results[self._taken :]
            self._taken = len(self._results)
        self._thread.join(self.timeout_s)
        return results

    def _wait(self, condition: object) -> None:
        ok = self._cond.wait_for(
            lambda: self._error is not None or condition(),  # type: ignore[operator]
            self.timeout_s * 2,
        )
        if self._error is not None:
            raise ClusterError(
                f"rank {self.rank}: the eager all-reduce failed ({self._error}); a rank has "
                "probably died, so the job stops"
            )
        if not ok:
            raise ClusterError(
                f"rank {self.rank}: no collective for {self.timeout_s * 2:.0f} s; a rank has "
                "probably died or hangs, so the job stops"
            )

    # ---- the progress thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            for t in range(1, self.collectives + 1):
                self._activate(t)
                self._collective()
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._final.wait()
            self._collective()  # the flush: every rank has stopped computing
            with self._cond:
                self._finished = True
                self._cond.notify_all()
        except BaseException as error:
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _activate(self, t: int) -> None:
        """Wait until collective t is started: by this rank (its initiator's turn and a
        gradient in hand) or by another (its key in the store)."""
        key = f"go/{t}"
        initiator = self._initiators.randrange(self.world) if self.mode == "majority" else None
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            ready = self._arrived.is_set()
            if ready and (initiator is None or initiator == self.rank):
                self.store.set(key, str(self.rank))
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"collective {t} was not started in {self.timeout_s:.0f} s")
            if ready:
                time.sleep(POLL_S)
            else:
                self._arrived.wait(POLL_S)

    def _collective(self) -> None:
        with self._cond:
            send = torch.cat([self._buffer, torch.tensor([float(self._fresh)])])
            self._buffer = torch.zeros_like(self._buffer)
            self._fresh = 0
            self._arrived.clear()
            consumed = self._deposits
        dist.all_reduce(send, group=self.group)
        total = send[:-1]
        with self._cond:
            assert self.log.applied_sum is not None
            self.log.applied_sum += total.double()
            self.log.contributors.append(round(float(send[-1])))
            self._results.append(total / self.world)
            self._consumed = consumed
            self._cond.notify_all()
