"""The resizable batch sampler and the resource probe."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from fedlb.training import ResizableBatchSampler, ResourceProbe


def draw(sampler, sizes):
    stream = iter(sampler)
    batches = []
    for b in sizes:
        sampler.batch_size = b
        batches.append(next(stream))
    return batches


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=40),
    sizes=st.lists(st.integers(min_value=1, max_value=25), min_size=1, max_size=30),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_every_epoch_is_a_permutation_and_every_batch_full(n, sizes, seed):
    sampler = ResizableBatchSampler(n, 1, seed=seed)
    batches = draw(sampler, sizes)
    assert [len(b) for b in batches] == sizes
    stream = [i for b in batches for i in b]
    for start in range(0, len(stream) - n + 1, n):  # whole epochs: each index exactly once
        assert sorted(stream[start : start + n]) == list(range(n))
    tail = stream[len(stream) - len(stream) % n :]
    assert len(set(tail)) == len(tail)  # within the unfinished epoch: no repeats


def test_same_seed_same_stream_other_seed_other_stream_and_epochs_reshuffle():
    sizes = [7, 3, 9, 5, 11, 2, 8]
    a = draw(ResizableBatchSampler(20, 1, seed=42), sizes)
    b = draw(ResizableBatchSampler(20, 1, seed=42), sizes)
    c = draw(ResizableBatchSampler(20, 1, seed=43), sizes)
    assert a == b
    assert a != c
    flat = [i for batch in a for i in batch]
    assert flat[:20] != flat[20:40]  # epoch 1 is another permutation than epoch 0


def test_dataloader_keeps_working_while_the_size_changes():
    data = TensorDataset(torch.arange(100).float().unsqueeze(1), torch.arange(100))
    sampler = ResizableBatchSampler(data, batch_size=4, seed=0)
    loader = DataLoader(data, batch_sampler=sampler)
    batches = iter(loader)
    seen = []
    for size in (4, 4, 13, 1, 60, 60):
        sampler.batch_size = size
        x, y = next(batches)
        assert x.shape == (size, 1)
        assert y.shape == (size,)
        seen.append(size)
    assert sampler.epoch == 1  # 142 samples: the stream ran into the second epoch


def test_state_dict_resumes_the_same_indices():
    original = ResizableBatchSampler(30, 4, seed=9)
    draw(original, [4, 6, 11])
    copy = ResizableBatchSampler(30, 1, seed=0)
    copy.load_state_dict(original.state_dict())
    assert draw(original, [5, 9, 8]) == draw(copy, [5, 9, 8])
    with pytest.raises(ValueError, match="is for 30 samples"):
        ResizableBatchSampler(31, 4).load_state_dict(original.state_dict())


def test_epoch_mode_has_a_length_and_a_short_last_batch():
    sampler = ResizableBatchSampler(10, 4, shuffle=False, endless=False)
    assert len(sampler) == 3
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropping = ResizableBatchSampler(10, 4, shuffle=False, endless=False, drop_last=True)
    assert len(dropping) == 2
    assert [len(b) for b in dropping] == [4, 4]
    with pytest.raises(TypeError, match="endless"):
        len(ResizableBatchSampler(10, 4))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_batch_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        ResizableBatchSampler(10, bad)
    sampler = ResizableBatchSampler(10, 2)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        sampler.batch_size = bad
    with pytest.raises(ValueError, match="empty"):
        ResizableBatchSampler(0, 2)


def test_resource_probe_reports_fractions():
    probe = ResourceProbe()
    busy = sum(i * i for i in range(200_000))  # some CPU so the next reading is not empty
    sample = probe.sample()
    assert busy > 0
    assert 0.0 <= sample.cpu <= 1.0
    assert 0.0 < sample.mem <= 1.0
    if not torch.cuda.is_available():
        assert sample.accel_mem is None
    else:
        assert sample.accel_mem is not None
        assert 0.0 <= sample.accel_mem <= 1.0


def test_an_endless_stream_that_does_not_span_epochs_ends_each_epoch_short():
    """span_epochs=False: a DataLoader iterated afresh whenever it runs out (FLamby's
    DataLoaderWithMemory): 10 samples at B=4 give 4, 4, 2, then the next epoch's 4, 4, 2;
    every epoch a permutation; the state carries the stream into a new sampler."""
    sampler = ResizableBatchSampler(10, 4, seed=3, span_epochs=False)
    stream = iter(sampler)
    batches = [next(stream) for _ in range(7)]
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2, 4]
    epoch_1 = [i for batch in batches[:3] for i in batch]
    epoch_2 = [i for batch in batches[3:6] for i in batch]
    assert sorted(epoch_1) == sorted(epoch_2) == list(range(10))
    assert epoch_1 != epoch_2  # a fresh permutation
    again = ResizableBatchSampler(10, 4, seed=99, span_epochs=False)
    again.load_state_dict(sampler.state_dict())
    assert [next(iter(again)) for _ in range(2)] == [next(stream) for _ in range(2)]
