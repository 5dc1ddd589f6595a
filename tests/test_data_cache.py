"""The on-disk partition cache: a silo's part built once, reused by later processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fedlb.deploy.task as task
from fedlb.data import LabelledData, cached_partition, dataset_fingerprint, partition_cache_dir
from fedlb.data.cache import entry_path
from fedlb.deploy import RunConfig
from tests.test_data_files import make_mnist_folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("FEDLB_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def builds(monkeypatch):
    """How many times silo_data really loaded and split the dataset."""
    calls = []
    real = task.federation_data

    def counting(config):
        calls.append(config)
        return real(config)

    monkeypatch.setattr(task, "federation_data", counting)
    return calls


def fashion(tmp_path, **changes):
    folder = tmp_path / "fashion"
    if not folder.exists():
        make_mnist_folder(folder, n_train=120, n_test=20)
    settings = {"dataset": "fashion-mnist", "data_dir": str(folder), "num_silos": 3, **changes}
    return RunConfig(**settings)


def entries(folder):
    return sorted(folder.glob("partition-*.npz"))


def same(a, b):
    return (
        np.array_equal(a.x, b.x)
        and np.array_equal(a.y, b.y)
        and a.num_classes == b.num_classes
        and a.name == b.name
        and a.x.dtype == b.x.dtype
    )


def test_second_call_is_read_from_disk_and_equals_a_fresh_build(
    tmp_path, cache, builds, monkeypatch
):
    config = fashion(tmp_path)
    first = task.silo_data(config, 1, 3)
    assert len(builds) == 1
    assert len(entries(cache)) == 1
    again = task.silo_data(config, 1, 3)
    assert len(builds) == 1  # served from the cache
    monkeypatch.setenv("FEDLB_CACHE_DIR", "off")
    fresh = task.silo_data(config, 1, 3)
    assert len(builds) == 2
    for got in (first, again):
        assert same(got.train, fresh.train)
        assert same(got.test, fresh.test)
    assert not list(cache.glob(".tmp-*"))  # nothing half-written left behind


def test_everything_that_defines_a_partition_is_in_the_key(tmp_path, cache, builds):
    base = fashion(tmp_path)
    task.silo_data(base, 0, 3)
    variants = [
        (fashion(tmp_path, seed=1), 0, 3),
        (fashion(tmp_path, partition="classes:2"), 0, 3),
        (fashion(tmp_path, silo_test_fraction=0.3), 0, 3),
        (fashion(tmp_path, server_test_fraction=0.3), 0, 3),
        (fashion(tmp_path, num_silos=4), 0, 3),
        (base, 1, 3),
        (base, 0, 2),
    ]
    for count, (config, partition_id, num_partitions) in enumerate(variants, start=2):
        task.silo_data(config, partition_id, num_partitions)
        assert len(entries(cache)) == count, (config, partition_id, num_partitions)
    assert len(builds) == 1 + len(variants)


def test_a_touched_dataset_file_invalidates_its_entries(tmp_path, cache, builds):
    config = fashion(tmp_path)
    task.silo_data(config, 0, 3)
    images = tmp_path / "fashion" / "train-images-idx3-ubyte.gz"
    before = dataset_fingerprint("fashion-mnist", config.data_dir)
    stat = images.stat()
    os.utime(images, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert dataset_fingerprint("fashion-mnist", config.data_dir) != before
    task.silo_data(config, 0, 3)
    assert len(builds) == 2
    assert len(entries(cache)) == 2


def test_a_corrupt_entry_is_rebuilt_with_a_warning(tmp_path, cache, builds, caplog):
    config = fashion(tmp_path)
    good = task.silo_data(config, 2, 3)
    (entry,) = entries(cache)
    entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="fedlb.data"):
        rebuilt = task.silo_data(config, 2, 3)
    assert "unreadable" in caplog.text
    assert len(builds) == 2
    assert same(rebuilt.train, good.train)
    assert same(rebuilt.test, good.test)
    task.silo_data(config, 2, 3)  # the rewritten entry serves again
    assert len(builds) == 2


def test_off_disables_and_the_folder_follows_the_environment(tmp_path, monkeypatch, builds):
    monkeypatch.setenv("FEDLB_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert partition_cache_dir() is None
    config = fashion(tmp_path)
    task.silo_data(config, 0, 3)
    task.silo_data(config, 0, 3)
    assert len(builds) == 2
    assert not (tmp_path / "xdg").exists()
    monkeypatch.setenv("FEDLB_CACHE_DIR", "")  # empty: unset
    assert partition_cache_dir() == tmp_path / "xdg" / "fedlb" / "partitions"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert partition_cache_dir() == tmp_path / "home" / ".cache" / "fedlb" / "partitions"


def test_an_unwritable_folder_only_skips_the_store(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    part = LabelledData(np.ones((4, 2), np.float32), np.arange(4), 4, "toy")
    with caplog.at_level(logging.WARNING, logger="fedlb.data"):
        train, _ = cached_partition({"k": 1}, lambda: (part, part), folder=blocker / "cache")
    assert train is part
    assert "could not store" in caplog.text


def test_groups_survive_and_the_oldest_entries_are_evicted(tmp_path, monkeypatch):
    roles = np.array(["hamlet/HAMLET", "lear/LEAR"] * 50)
    part = LabelledData(np.zeros((100, 80), np.int64), np.arange(100) % 7, 7, "text", roles)
    split = (part, part.subset(np.arange(3)))
    train, test = cached_partition({"k": "g"}, lambda: split, tmp_path)
    train, test = cached_partition({"k": "g"}, lambda: pytest.fail("rebuilt"), tmp_path)
    assert np.array_equal(train.groups, roles)
    assert np.array_equal(test.groups, roles[:3])
    assert train.groups is not None
    assert train.groups.dtype.kind == "U"
    size = entry_path(tmp_path, {"k": "g"}).stat().st_size
    monkeypatch.setenv("FEDLB_CACHE_MAX_MB", str(2.5 * size / 2**20))
    keys = [{"k": "g"}] + [{"k": k} for k in range(4)]
    for order, key in enumerate(keys):
        cached_partition(key, lambda: split, tmp_path)
        os.utime(entry_path(tmp_path, key), ns=(10**18, 10**18 + order))  # written in order
    assert entries(tmp_path) == sorted(entry_path(tmp_path, key) for key in keys[-2:])


def test_a_fresh_process_gets_the_partition_from_the_cache(tmp_path, cache):
    config = fashion(tmp_path)
    built = task.silo_data(config, 0, 3)
    (entry,) = entries(cache)
    written = entry.stat().st_mtime_ns
    code = textwrap.dedent(
        """
        import json, logging, sys
        import fedlb.deploy.task as task
        from fedlb.deploy import RunConfig

        def refuse(*args, **kwargs):
            raise AssertionError("the dataset was loaded")

        task.federation_data = refuse
        task._load = refuse
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(message)s")
        data = task.silo_data(RunConfig(**json.loads(sys.argv[1])), 0, 3)
        print("samples", len(data.train), len(data.test), float(data.train.x.sum()))
        """
    )
    settings = {"dataset": config.dataset, "data_dir": config.data_dir, "num_silos": 3}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FEDLB_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr
    assert f"partition from cache {entry}" in done.stdout
    expected = f"samples {len(built.train)} {len(built.test)} {float(built.train.x.sum())}"
    assert expected in done.stdout
    assert entry.stat().st_mtime_ns == written
    assert entries(cache) == [entry]
