# fedlb: not part of Flower's examples/advanced-pytorch. An offline stand-in for the two
# `wandb` calls strategy.py makes (`wandb.init(project=..., name=...)`, `wandb.log(data,
# step=...)`): they are kept in memory here instead of going to W&B. See tests/apps/README.md.
"""Offline stand-in for wandb.init / wandb.log."""

runs = []  # the keyword arguments of each init()
logged = []  # (step, data) of each log()


def init(**kwargs):
    runs.append(kwargs)


def log(data, step=None):
    logged.append((step, dict(data)))
