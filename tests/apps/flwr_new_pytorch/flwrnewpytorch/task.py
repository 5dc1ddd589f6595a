# fedlb test fixture: what `flwr new flwrnewpytorch --framework PyTorch --username fedlb`
# writes with flwr 1.24.0, from templates/app/code/task.pytorch.py.tpl
# (Apache-2.0, Flower Labs GmbH). Unchanged except this comment and data loading (imports,
# the section between Net and train(), marked `fedlb:`): offline data instead of CIFAR-10.
# See tests/apps/README.md.
"""flwrnewpytorch: A Flower / PyTorch app."""

import itertools  # fedlb: offline data (was: flwr_datasets, torchvision)
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from fedlb.data import load_digits, load_fashion_mnist, partition


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


# ---- fedlb: offline data, replacing the FederatedDataset / CIFAR-10 section ----------------
# Digits embedded in fedlb (default) or, with FEDLB_APP_DATA=fashion-mnist, Fashion-MNIST,
# as 3x32x32 images normalised like the original transform, served as dict batches
# {"img", "label"}. FEDLB_APP_PARTITION_WEIGHTS="1,2,3" gives IID partitions of unequal sizes;
# FEDLB_APP_PARTITION="dirichlet:0.5" or "classes:2" non-IID ones (Flower Datasets'
# DirichletPartitioner / PathologicalPartitioner's job, done by fedlb.data.partition).

fds = None  # Cache: (partition pool, central test set), each (images, labels)


class _DictDataset(Dataset):
    """Samples as {"img": (3, 32, 32) float tensor, "label": int64} like the original."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"img": self.images[index].expand(3, -1, -1), "label": self.labels[index]}


def _offline_data():
    """(pool, central test set): 1x32x32 images in [-1, 1] and int64 labels."""
    global fds
    if fds is None:
        source = os.environ.get("FEDLB_APP_DATA", "digits")
        if source == "digits":  # 8x8 -> 32x32; 20% held out as the central test set
            digits = load_digits()
            x = F.interpolate(torch.from_numpy(digits.x), size=32)
            y = torch.from_numpy(digits.y)
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(42))
            held, rest = order[: len(y) // 5], order[len(y) // 5 :]
            pool, central = (x[rest], y[rest]), (x[held], y[held])
        elif source == "fashion-mnist":  # 28x28 padded to 32x32; t10k is the central test set
            pool, central = (
                (F.pad(torch.from_numpy(d.x), (2, 2, 2, 2)), torch.from_numpy(d.y))
                for d in load_fashion_mnist()
            )
        else:
            raise ValueError(f"FEDLB_APP_DATA={source!r}: use digits or fashion-mnist")
        fds = tuple(((x - 0.5) / 0.5, y) for x, y in (pool, central))
    return fds


def _load_partition(partition_id: int, num_partitions: int):
    """IID partition `partition_id` (sizes by FEDLB_APP_PARTITION_WEIGHTS), or a non-IID
    one (FEDLB_APP_PARTITION), split 80/20."""
    (x, y), _ = _offline_data()
    scheme = os.environ.get("FEDLB_APP_PARTITION", "iid")
    if scheme != "iid":  # label skew, seed 0 like the IID permutation
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition {partition_id} of {num_partitions}")
        parts = partition(y.numpy(), num_partitions, scheme, seed=0)
        part = torch.from_numpy(parts[partition_id]).long()
    else:
        weights = os.environ.get("FEDLB_APP_PARTITION_WEIGHTS")
        w = [float(v) for v in weights.split(",")] if weights else [1.0] * num_partitions
        if len(w) != num_partitions or not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition {partition_id} of {num_partitions}, weights {w}")
        ends = [round(len(y) * c / sum(w)) for c in itertools.accumulate(w)]
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        part = order[[0, *ends][partition_id] : ends[partition_id]]
    part = part[torch.randperm(len(part), generator=torch.Generator().manual_seed(42))]
    n_test = math.ceil(0.2 * len(part))  # as Dataset.train_test_split(test_size=0.2)
    train, test = part[n_test:], part[:n_test]
    return _DictDataset(x[train], y[train]), _DictDataset(x[test], y[test])


def load_data(partition_id: int, num_partitions: int):
    """Load partition data (fedlb: offline, see above)."""
    train_set, test_set = _load_partition(partition_id, num_partitions)
    trainloader = DataLoader(train_set, batch_size=32, shuffle=True)
    testloader = DataLoader(test_set, batch_size=32)
    return trainloader, testloader


# ---- fedlb: end of the offline data section; the rest is upstream ----------------------------


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
