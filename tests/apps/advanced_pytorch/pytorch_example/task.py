# fedlb test fixture: Flower's examples/advanced-pytorch/pytorch_example/task.py
# at adap/flower commit fdef7afb1dca3030553be302366cfd285ed6632c (Apache-2.0, Flower Labs GmbH).
# Unchanged except this comment and data loading (marked `fedlb:`): the imports, torchvision's
# transforms redone in plain torch, and the section after apply_eval_transforms()
# (FederatedDataset, load_data): offline Fashion-MNIST instead of the Hugging Face hub; and
# UserConfig imported from flwr.app (flwr 1.42 no longer has it in flwr.common.typing).
# See tests/apps/README.md.
"""pytorch-example: A Flower / PyTorch app."""

import json
import math  # fedlb: math, os, numpy, Dataset, fedlb.data (was: flwr_datasets, torchvision)
import os
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from flwr.app import UserConfig  # fedlb: flwr 1.42 has it here only (was: flwr.common.typing)
from torch.utils.data import DataLoader, Dataset

from fedlb.data import load_fashion_mnist, partition_dirichlet

# ---- fedlb: torchvision.transforms' Compose, Normalize, RandomCrop, RandomHorizontalFlip and
# ToTensor in plain torch, on (1, 28, 28) uint8 tensors (torchvision gets PIL images of the same
# bytes). The random ones draw from torch's global RNG with torchvision's own calls, per sample
# when it is read: torch.randint for the crop's corner, torch.rand(1) < p for the flip.


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img):
        for transform in self.transforms:
            img = transform(img)
        return img


class RandomCrop:
    """A random `size` x `size` crop after padding each side with `padding` zeros."""

    def __init__(self, size, padding=0):
        self.size, self.padding = size, padding

    def __call__(self, img):
        img = F.pad(img, [self.padding] * 4)  # fill 0, torchvision's default
        height, width = img.shape[-2:]
        if (height, width) == (self.size, self.size):
            return img
        i = torch.randint(0, height - self.size + 1, size=(1,)).item()
        j = torch.randint(0, width - self.size + 1, size=(1,)).item()
        return img[..., i : i + self.size, j : j + self.size]


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img):
        return img.flip(-1) if torch.rand(1) < self.p else img


class ToTensor:
    """uint8 -> float32 in [0, 1]."""

    def __call__(self, img):
        return img.to(torch.float32).div(255)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, tensor):
        return (tensor - self.mean) / self.std


# ---- fedlb: end of the transforms; the rest is upstream up to apply_eval_transforms() -------

FM_NORMALIZATION = ((0.1307,), (0.3081,))
EVAL_TRANSFORMS = Compose([ToTensor(), Normalize(*FM_NORMALIZATION)])
TRAIN_TRANSFORMS = Compose(
    [
        RandomCrop(28, padding=4),
        RandomHorizontalFlip(),
        ToTensor(),
        Normalize(*FM_NORMALIZATION),
    ]
)


class Net(nn.Module):
    """Model (simple CNN adapted for Fashion-MNIST)"""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["image"]
            labels = batch["label"]
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()

    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy


def apply_train_transforms(batch):
    """Apply transforms to the partition from FederatedDataset."""
    batch["image"] = [TRAIN_TRANSFORMS(img) for img in batch["image"]]
    return batch


def apply_eval_transforms(batch):
    """Apply transforms to the partition from FederatedDataset."""
    batch["image"] = [EVAL_TRANSFORMS(img) for img in batch["image"]]
    return batch


# ---- fedlb: offline Fashion-MNIST, replacing the FederatedDataset section -------------------
# The IDX files of Debian's dataset-fashion-mnist (fedlb.data.load_fashion_mnist): the 60,000
# train images partitioned by label with Dirichlet(1.0), seed 42 (fedlb.data's
# partition_dirichlet, at least 10 samples each as DirichletPartitioner's
# min_partition_size), each partition split 80/20 as `train_test_split(test_size=0.2,
# seed=42)` does; t10k is the server's test set (`load_split("test")`). Samples are dicts
# {"image", "label"}, transformed when read as `datasets.Dataset.with_transform` does.

fds = None  # Cache: the partitions (indices into the train split)
_splits = {}  # Cache: "train" and "test" splits, untransformed


class FashionMNIST(Dataset):
    """(n, 1, 28, 28) uint8 images and int64 labels; `transform` gets a batch of one,
    {"image": [img], "label": [label]}, like a `with_transform` one."""

    def __init__(self, images, labels, transform=None):
        self.images, self.labels, self.transform = images, labels, transform

    def with_transform(self, transform):
        return FashionMNIST(self.images, self.labels, transform)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        batch = {"image": [self.images[index]], "label": [self.labels[index]]}
        if self.transform is not None:
            batch = self.transform(batch)
        return {key: values[0] for key, values in batch.items()}


def load_split(split: str) -> FashionMNIST:
    """Fashion-MNIST's "train" (60,000) or "test" (t10k, 10,000) split, untransformed."""
    if not _splits:
        folder = os.environ.get("FEDLB_APP_FASHION_DIR") or None  # tests: small IDX files
        for name, data in zip(("train", "test"), load_fashion_mnist(folder), strict=True):
            images = np.rint(data.x * 255).astype(np.uint8)  # the files' bytes again
            _splits[name] = FashionMNIST(torch.from_numpy(images), torch.from_numpy(data.y))
    return _splits[split]


def load_data(partition_id: int, num_partitions: int):
    """Load partition FashionMNIST data."""
    # Only partition once
    global fds
    train = load_split("train")
    if fds is None:
        fds = partition_dirichlet(
            train.labels.numpy(), num_partitions, alpha=1.0, seed=42, min_size=10
        )
    partition = fds[partition_id]
    # Divide data on each node: 80% train, 20% test (test: the first ceil(20%) of a
    # permutation seeded 42, train: the rest, as `train_test_split(test_size=0.2, seed=42)`)
    permutation = np.random.default_rng(42).permutation(len(partition))
    n_test = math.ceil(0.2 * len(partition))
    train_idx = torch.from_numpy(partition[permutation[n_test:]])
    test_idx = torch.from_numpy(partition[permutation[:n_test]])

    train_partition = FashionMNIST(
        train.images[train_idx], train.labels[train_idx], apply_train_transforms
    )
    test_partition = FashionMNIST(
        train.images[test_idx], train.labels[test_idx], apply_eval_transforms
    )
    trainloader = DataLoader(train_partition, batch_size=32, shuffle=True)
    testloader = DataLoader(test_partition, batch_size=32)
    return trainloader, testloader


# ---- fedlb: end of the offline data section; the rest is upstream ----------------------------


def create_run_dir(config: UserConfig) -> tuple[Path, str]:
    """Create a directory where to save results from this run."""
    # Create output directory given current timestamp
    current_time = datetime.now()
    run_dir = current_time.strftime("%Y-%m-%d/%H-%M-%S")
    # Save path is based on the current directory
    save_path = Path.cwd() / f"outputs/{run_dir}"
    save_path.mkdir(parents=True, exist_ok=False)

    # Save run config as json
    with open(f"{save_path}/run_config.json", "w", encoding="utf-8") as fp:
        json.dump(config, fp)

    return save_path, run_dir
