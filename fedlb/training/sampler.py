"""A batch sampler whose batch size can change between iterations.

LB-BSP changes a worker's batch size at iteration (or round) boundaries; PyTorch's
BatchSampler fixes it at construction. This one reads the size at every batch, so a
DataLoader built once keeps working while the balancer retunes it:

    sampler = ResizableBatchSampler(len(dataset), batch_size=32, seed=7)
    loader = DataLoader(dataset, batch_sampler=sampler)
    batches = iter(loader)
    ...
    sampler.batch_size = 57      # the next batch drawn has 57 samples

With `num_workers > 0` the DataLoader prefetches `prefetch_factor` batches per worker at the
old size; a new size then shows after those. Use `num_workers=0` (the default) when every
iteration must use the newest size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler


class ResizableBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices, `batch_size` of them, read afresh at every batch.

    Args:
        data: the dataset (anything with len()) or its number of samples.
        batch_size: samples per batch, changeable at any time. Must be >= 1.
        shuffle: draw a fresh permutation every epoch (default True); else index order.
        seed: the permutation of epoch e depends only on (seed, e): reproducible.
        endless: True (default): an endless stream of batches, each epoch a permutation
            of all samples; every sample is used once per epoch. False: one epoch per
            iter(), the last batch short unless `drop_last`.
        span_epochs: with endless=True (default True): a batch runs on into the next epoch
            when the current one has fewer samples left than it needs, so every batch has
            exactly `batch_size` samples, which is what a τ-iteration round needs. False:
            each epoch's last batch is short, as from a DataLoader iterated afresh whenever
            it runs out (FLamby's DataLoaderWithMemory).
        drop_last: with endless=False, drop a short last batch. Default False.
        epoch_order: where each epoch's order comes from instead of (seed, epoch): called
            when an epoch starts, it returns that epoch's indices. Pass the app's own
            sampler (`lambda: iter(loader.sampler)`) and the stream draws exactly what the
            app's DataLoader would: a RandomSampler draws its seed from torch's RNG (or its
            generator) when the epoch starts, so the same torch seed gives the same batches.
            `state_dict` then holds the rest of the current epoch's order. Default None.
    """

    def __init__(
        self,
        data: Sized | int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        endless: bool = True,
        span_epochs: bool = True,
        drop_last: bool = False,
        epoch_order: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.num_samples = data if isinstance(data, int) else len(data)
        if self.num_samples < 1:
            raise ValueError(f"the dataset is empty: {self.num_samples} samples")
        self.shuffle = shuffle
        self.seed = seed
        self.endless = endless
        self.span_epochs = span_epochs
        self.drop_last = drop_last
        self.epoch_order = epoch_order
        self.batch_size = batch_size  # validated by the setter
        self.epoch = 0
        self.position = 0  # next index into the current epoch's order
        # With epoch_order the first epoch is drawn when the first batch is, as a
        # DataLoader's sampler is (its seed comes from torch's RNG at that moment).
        self._order = self._permutation(0) if epoch_order is None else None

    @property
    def _epoch_size(self) -> int:
        return self.num_samples if self._order is None else len(self._order)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {value!r}")
        self._batch_size = int(value)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self.epoch_order is not None:
            order = np.fromiter((int(i) for i in self.epoch_order()), dtype=np.int64)
            if order.size == 0:
                raise ValueError("the sampler giving each epoch's order gave no index")
            return order
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = self._permutation(self.epoch)

    def _current(self) -> np.ndarray:
        if self._order is None:  # epoch_order's first epoch, drawn on first use
            self._order = self._permutation(self.epoch)
        elif self.position >= len(self._order):
            self._next_epoch()
        assert self._order is not None
        return self._order

    def _take(self, count: int) -> list[int]:
        taken: list[int] = []
        while len(taken) < count:
            order = self._current()
            end = min(len(order), self.position + count - len(taken))
            taken.extend(int(i) for i in order[self.position : end])
            self.position = end
        return taken

    def _left(self) -> int:
        return len(self._current()) - self.position

    def __iter__(self) -> Iterator[list[int]]:
        if self.endless and self.span_epochs:
            while True:
                yield self._take(self.batch_size)
        elif self.endless:
            while True:
                yield self._take(min(self.batch_size, self._left()))
        else:
            self._current()
            while self.position < self._epoch_size:
                left = self._left()
                if left < self.batch_size and self.drop_last:
                    self.position = self._epoch_size
                    break
                yield self._take(min(self.batch_size, left))

    def __len__(self) -> int:
        """Batches left in the current epoch at the current size (endless=False only)."""
        if self.endless:
            raise TypeError("an endless ResizableBatchSampler has no length")
        size = self._epoch_size
        left = size - self.position if self.position < size else size
        return left // self.batch_size if self.drop_last else -(-left // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: restoring it continues with the very same indices."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }
        if self.epoch_order is not None:  # the order is not recomputable: keep what is left
            rest = [] if self._order is None else self._order[self.position :].tolist()
            state["position"] = 0
            state["order"] = rest
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples, this dataset has "
                f"{self.num_samples}"
            )
        self.seed = int(state["seed"])
        self.batch_size = int(state["batch_size"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        if "order" in state:
            rest = np.asarray([int(i) for i in state["order"]], dtype=np.int64)
            if rest.size:
                self._order = rest
            else:  # an epoch used up exactly: the next batch draws a fresh one
                if self.epoch_order is None:
                    raise ValueError("this sampler state needs epoch_order (saved with one)")
                self._order = None
                self.epoch += 1
        else:
            self._order = self._permutation(self.epoch)
