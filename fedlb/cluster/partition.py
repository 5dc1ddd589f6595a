"""LB-BSP's data-partition manager (Section 7, footnote 13) for ranks that hold only a local
shard of the data.

Under LB-BSP a faster rank draws bigger batches, so where each rank can read only its own
shard, the fast ranks' samples are visited more often than the slow ranks': on a shard
that is not a fair sample of the data (2 classes per rank, say) that biases the model.
The manager counts each shard's traversals (samples drawn / shard size since the last
reset). Every `check_every` iterations the ranks exchange those counts; when the most- and
the least-traversed shards are more than `threshold` traversals apart, samples move from
the least-traversed rank's shard (the slower) to the most-traversed one's (the faster): as
many as make their shard sizes proportional to their batch sizes, so that both go on at
the same pace. The move runs in the background on torch.distributed point-to-point
(isend/irecv on a gloo group) while training goes on; at the next check it is applied and
every rank's traversal counts (and its sampler) start afresh. No sample is lost or
duplicated: the sender removes exactly what the receiver adds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("fedlb.cluster")


@dataclass
class Shard:
    """A rank's local data: samples, labels and each sample's global id."""

    x: torch.Tensor
    y: torch.Tensor
    ids: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class _Move:
    source: int
    target: int
    count: int
    works: list[Any] = field(default_factory=list)
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    taken: torch.Tensor | None = None  # the sender's positions of the moving samples


@dataclass
class MoveRecord:
    """One move: at which check, from whom to whom, how many samples, how many bytes."""

    check: int
    source: int
    target: int
    count: int
    bytes: int


class DataPartitionManager:
    """One rank's side. Draw batches with `batches()`; call `step(batch_size)` after every
    iteration with the batch size the rank will use next.

    Args:
        shard: this rank's samples.
        batch_size: its first batch size.
        threshold: traversal gap that triggers a move. Default 2 (the paper's).
        check_every: iterations between exchanges of the counts. Default 10.
        group: a gloo group of all ranks for the counts and the moves (default: a new one).
        seed: the samplers' and the moves' randomness.
    """

    def __init__(
        self,
        shard: Shard,
        batch_size: int,
        threshold: float = 2.0,
        check_every: int = 10,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0 traversals, got {threshold}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        if len(shard) < 1:
            raise ValueError("a rank's shard must hold at least one sample")
        self.shard = shard
        self.batch_size = batch_size
        self.threshold = threshold
        self.check_every = check_every
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.seed = seed
        self.drawn = 0  # samples drawn since the last reset
        self.iteration = 0
        self.checks = 0
        self.gaps: list[float] = []  # the traversal gap seen at each check
        self.moves: list[MoveRecord] = []
        self._pending: _Move | None = None
        self._generator = torch.Generator().manual_seed(seed * 7919 + self.rank)
        self._order = torch.randperm(len(shard), generator=self._generator)
        self._position = 0

    @property
    def traversals(self) -> float:
        """Passes over this rank's shard since the last reset."""
        return self.drawn / len(self.shard)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` samples of the shard, in a fresh random order on every pass."""
        picked = []
        needed = self.batch_size
        while needed:
            if self._position == len(self._order):
                self._order = torch.randperm(len(self.shard), generator=self._generator)
                self._position = 0
            take = self._order[self._position : self._position + needed]
            self._position += len(take)
            needed -= len(take)
            picked.append(take)
        index = torch.cat(picked)
        self.drawn += len(index)
        return self.shard.x[index], self.shard.y[index]

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def step(self, batch_size: int) -> None:
        """An iteration is over; the next one draws `batch_size` samples. Every
        `check_every` iterations: finish the move in flight, then exchange the counts
        and start a move if the gap calls for one."""
        self.batch_size = batch_size
        self.iteration += 1
        if self.iteration % self.check_every:
            return
        self.checks += 1
        if self._pending is not None:
            self._finish(self._pending)
            self._pending = None
            self._reset()
        stats = torch.tensor([self.traversals, float(len(self.shard)), float(batch_size)])
        everyone = [torch.zeros(3) for _ in range(self.world)]
        dist.all_gather(everyone, stats, group=self.group)
        traversed = [float(s[0]) for s in everyone]
        gap = max(traversed) - min(traversed)
        self.gaps.append(gap)
        if gap <= self.threshold:
            return
        # every rank decides the same from the same numbers: no broadcast needed
        target = max(range(self.world), key=lambda r: traversed[r])
        source = min(range(self.world), key=lambda r: traversed[r])
        size_s, size_t = float(everyone[source][1]), float(everyone[target][1])
        batch_s, batch_t = float(everyone[source][2]), float(everyone[target][2])
        # shard sizes proportional to batch sizes: (S_s - m)/B_s = (S_t + m)/B_t
        count = int((batch_t * size_s - batch_s * size_t) / (batch_s + batch_t))
        count = min(count, int(size_s) - 1)
        if count < 1:
            return
        move = _Move(source, target, count)
        self._start(move)
        self._pending = move

    def _start(self, move: _Move) -> None:
        shape = self.shard.x.shape[1:]
        if self.rank == move.source:
            positions = torch.randperm(len(self.shard), generator=self._generator)[: move.count]
            move.taken = positions
            payload = (
                self.shard.x[positions].contiguous(),
                self.shard.y[positions].contiguous(),
                self.shard.ids[positions].contiguous(),
            )
            move.works = [dist.isend(t, move.target, group=self.group) for t in payload]
            move.buffers = payload
        elif self.rank == move.target:
            move.buffers = (
                torch.empty((move.count, *shape), dtype=self.shard.x.dtype),
                torch.empty(move.count, dtype=self.shard.y.dtype),
                torch.empty(move.count, dtype=self.shard.ids.dtype),
            )
            move.works = [dist.irecv(t, move.source, group=self.group) for t in move.buffers]
        size = move.count * (
            self.shard.x[0].numel() * self.shard.x.element_size()
            + self.shard.y.element_size()
            + self.shard.ids.element_size()
        )
        self.moves.append(MoveRecord(self.checks, move.source, move.target, move.count, size))
        if self.rank == 0:
            log.info(
                "data partitions: moving %d samples from rank %d to rank %d (%d bytes)",
                move.count,
                move.source,
                move.target,
                size,
            )

    def _finish(self, move: _Move) -> None:
        for work in move.works:
            work.wait()
        if self.rank == move.source and move.taken is not None:
            keep = torch.ones(len(self.shard), dtype=torch.bool)
            keep[move.taken] = False
            self.shard = Shard(self.shard.x[keep], self.shard.y[keep], self.shard.ids[keep])
        elif self.rank == move.target and move.buffers is not None:
            x, y, ids = move.buffers
            self.shard = Shard(
                torch.cat([self.shard.x, x]),
                torch.cat([self.shard.y, y]),
                torch.cat([self.shard.ids, ids]),
            )

    def _reset(self) -> None:
        """A move landed: every rank's counts and its sampler start afresh."""
        self.drawn = 0
        self._order = torch.randperm(len(self.shard), generator=self._generator)
        self._position = 0

    def rebalance(self, shares: Sequence[float]) -> None:
        """Make the shard sizes proportional to `shares` (one per rank, the same on every
        rank: a collective), e.g. Orchestra's Data Partition Controller's speeds. Moves
        go from ranks with more than their share to ranks with less, largest first, each
        finished before the next; the counts and samplers restart."""
        self.close()
        if len(shares) != self.world or min(shares) <= 0:
            raise ValueError(f"need one share > 0 per rank ({self.world}), got {list(shares)}")
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(self.shard)]), group=self.group)
        held = [int(n.item()) for n in sizes]
        total, weight = sum(held), sum(shares)
        wanted = [max(1, math.floor(total * w / weight)) for w in shares]
        wanted[max(range(self.world), key=lambda r: shares[r])] += total - sum(wanted)
        surplus = [h - w for h, w in zip(held, wanted, strict=True)]
        while max(surplus) > 0:
            source = max(range(self.world), key=lambda r: surplus[r])
            target = min(range(self.world), key=lambda r: surplus[r])
            count = min(surplus[source], -surplus[target])
            move = _Move(source, target, count)
            self._start(move)
            self._finish(move)
            surplus[source] -= count
            surplus[target] += count
        self._reset()

    def close(self) -> None:
        """Finish a move in flight (every rank must call it: the peers wait on it)."""
        if self._pending is not None:
            self._finish(self._pending)
            self._pending = None
            self._reset()

    @property
    def bytes_moved(self) -> int:
        return sum(m.bytes for m in self.moves)
