"""Loaders of data a user already has, tested on small files made in the real formats."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from fedlb.data import load_cifar10, load_fashion_mnist, load_idx_folder
from fedlb.data.images import read_idx


def write_idx(path, array, gz=True):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path, "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)


def make_mnist_folder(folder, n_train=12, n_test=5, gz=True):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(
            folder / f"{split}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), gz
        )
        write_idx(folder / f"{split}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, n), gz)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_folders_load_as_images_in_zero_one(tmp_path, gz):
    make_mnist_folder(tmp_path / "mnist", gz=gz)
    train, test = load_idx_folder(tmp_path / "mnist")
    assert train.x.shape == (12, 1, 28, 28)
    assert test.x.shape == (5, 1, 28, 28)
    assert train.x.dtype == np.float32
    assert float(train.x.min()) >= 0.0
    assert float(train.x.max()) <= 1.0
    raw = read_idx(tmp_path / "mnist" / f"train-labels-idx1-ubyte{'.gz' if gz else ''}")
    np.testing.assert_array_equal(train.y, raw)


def test_broken_idx_files_are_explained(tmp_path):
    bad = tmp_path / "bad"
    make_mnist_folder(bad)
    (bad / "train-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(b"\x00\x00\x08\x03" + struct.pack(">3I", 12, 28, 28) + b"\x00" * 10)
    )
    with pytest.raises(ValueError, match="header says"):
        load_idx_folder(bad)
    (bad / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"GIF89a"))
    with pytest.raises(ValueError, match="not an IDX file"):
        load_idx_folder(bad)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_idx_folder(tmp_path / "nowhere")


def test_fashion_mnist_says_how_to_install_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path / "absent")


def write_cifar_batch(path, n, seed):
    rng = np.random.default_rng(seed)
    batch = {
        b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
        b"labels": rng.integers(0, 10, n).tolist(),
        b"batch_label": b"x",
    }
    path.write_bytes(pickle.dumps(batch))


def test_cifar10_python_batches_load(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        write_cifar_batch(folder / f"data_batch_{i}", 4, i)
    write_cifar_batch(folder / "test_batch", 3, 9)
    train, test = load_cifar10(folder)
    assert train.x.shape == (20, 3, 32, 32)
    assert test.x.shape == (3, 3, 32, 32)
    assert float(train.x.max()) <= 1.0


def test_cifar10_refuses_a_pickle_that_runs_code_and_missing_batches(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    for i in range(1, 6):
        write_cifar_batch(folder / f"data_batch_{i}", 2, i)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (folder / "test_batch").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(ValueError, match=r"refusing to load builtins\.print"):
        load_cifar10(folder)
    (folder / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="missing CIFAR-10 python batches"):
        load_cifar10(folder)


HEART_HEADER = (
    "id,age,sex,dataset,cp,trestbps,chol,fbs,restecg,thalch,exang,oldpeak,slope,ca,thal,num"
)
HEART_ROWS = [
    "1,63,Male,Cleveland,typical angina,145,233,TRUE,lv hypertrophy,150,FALSE,2.3,"
    "downsloping,0,fixed defect,0",
    "2,67,Male,Cleveland,asymptomatic,160,286,FALSE,lv hypertrophy,108,TRUE,1.5,flat,3,normal,2",
    "3,54,Female,Hungary,atypical angina,130,,FALSE,normal,150,FALSE,0,,,,0",
    "4,59,Male,Switzerland,asymptomatic,,0,,st-t abnormality,120,TRUE,1.2,flat,,,3",
    "5,48,Female,VA Long Beach,non-anginal,140,250,FALSE,normal,130,FALSE,0.5,upsloping,,normal,1",
]


def test_heart_disease_table_features_labels_and_hospitals(tmp_path):
    from fedlb.data import load_heart_disease, partition_by_id

    path = tmp_path / "heart_disease_uci.csv"
    path.write_text("\n".join([HEART_HEADER, *HEART_ROWS]) + "\n")
    data = load_heart_disease(path)
    assert data.x.shape[0] == 5
    assert data.x.dtype == np.float32
    assert np.isfinite(data.x).all()  # gaps filled, with 'was missing' flags
    assert data.y.tolist() == [0, 1, 0, 1, 1]
    assert data.num_classes == 2
    parts = partition_by_id(data.groups)
    assert {k: len(v) for k, v in parts.items()} == {
        "Cleveland": 2,
        "Hungary": 1,
        "Switzerland": 1,
        "VA Long Beach": 1,
    }
    sub = data.subset(parts["Cleveland"])
    assert set(sub.groups.tolist()) == {"Cleveland"}


def test_heart_disease_refuses_other_tables(tmp_path):
    from fedlb.data import load_heart_disease

    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not the UCI Heart Disease table"):
        load_heart_disease(other)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_heart_disease(tmp_path / "absent.csv")


PLAY = """THE TEMPEST

SCENE 2

[Enter PROSPERO and MIRANDA]

MIRANDA.
If by your art, my dearest father, you have
Put the wild waters in this roar, allay them.

PROSPERO.
Be collected: [Aside] no more amazement.
Tell your piteous heart there's no harm done.

MIRANDA.
O! woe the day!
"""


def test_shakespeare_roles_become_groups_of_next_character_samples(tmp_path):
    from fedlb.data import load_shakespeare
    from fedlb.data.text import VOCABULARY, speeches

    said = speeches(PLAY)
    assert set(said) == {"MIRANDA", "PROSPERO"}
    assert said["PROSPERO"].startswith("Be collected:  no more amazement.")
    assert said["MIRANDA"].endswith("O! woe the day!")
    (tmp_path / "tempest_gut.txt").write_text(PLAY)
    data = load_shakespeare(tmp_path, roles=2, sequence=10, per_role=20)
    assert data.x.shape[1] == 10
    assert data.x.dtype == np.int64
    assert set(data.groups.tolist()) == {"tempest/MIRANDA", "tempest/PROSPERO"}
    assert data.num_classes == len(VOCABULARY)
    first = data.x[0]  # a window of MIRANDA's text, and the character after it
    text = "".join(VOCABULARY[i] for i in first)
    assert text in said["MIRANDA"] or text in said["PROSPERO"]
    with pytest.raises(ValueError, match="only 2 roles"):
        load_shakespeare(tmp_path, roles=3, sequence=10)
    with pytest.raises(FileNotFoundError, match="no play texts"):
        load_shakespeare(tmp_path / "empty")


def test_shakespeare_is_a_run_dataset_with_one_role_per_silo(tmp_path):
    """dataset shakespeare + partition natural: silo i trains on role i's lines only."""
    from fedlb.deploy import RunConfig
    from fedlb.deploy.task import federation_data, model_for, silo_data

    speech = "Now is the winter of our discontent made glorious summer by this sun. " * 4
    play = "".join(f"{name}.\n{speech}{name.lower()}\n\n" * 6 for name in ("ANNE", "RICHARD"))
    (tmp_path / "richard_iii_gut.txt").write_text(play)
    config = RunConfig.from_mapping(
        {
            "dataset": "shakespeare",
            "data-dir": str(tmp_path),
            "model": "lstm",
            "partition": "natural",
            "num-silos": 2,
        }
    )
    pool, test = federation_data(config)
    assert pool.x.shape[1] == 80
    assert len(test) > 0
    roles = [set(silo_data(config, i, 2).train.groups.tolist()) for i in range(2)]
    assert roles == [{"richard_iii/ANNE"}, {"richard_iii/RICHARD"}]
    logits = model_for(config, pool)(torch.as_tensor(pool.x[:3]))
    assert logits.shape == (3, pool.num_classes)
