"""What "default" means, one place for every entry point: fedlb's run settings and
LoadBalancedFedAvg, `fedlb experiment`, `fedlb tune`, `fedlb cluster`, cluster scenarios,
LoadBalancer, and the manager service. Each takes its tuner and estimator from here, so a
user comparing modes compares one controller.

- FL (run settings, `LoadBalancedFedAvg`, experiments): `TUNER` with `ESTIMATOR`, and
  the stability guard on (fedlb.balance.StabilityGuard: small batches at the app's own
  learning rate can blow a model up).
- Cluster (`fedlb cluster` and its scenarios, `LoadBalancer`, the manager service): the
  same controller (policy "lb"), no guard: aggregation weighted by batch size keeps every
  sample's weight, as in LB-BSP.
- `fedlb tune` (what-if): `TUNER`, shown beside `TUNE_ALSO`, with `ESTIMATOR`.

Why these: the curve tuner is the pooled tuner (LB-BSP's Algorithm 1 on speeds pooled
across workers whose reports cannot be told apart, and across all of them while the
reports favour their being alike, so measurement noise does not move sizes) until a
worker's measured step times show that one speed cannot describe it (a GPU, a CPU at its
per-step floor); then it splits X on the measured curves (docs/balance.md, "Curves");
the change-point estimator keeps the mean since a worker's last significant change, so it
averages noise away yet follows a real change within a few reports.
"""

from __future__ import annotations

TUNER = "curve"
ESTIMATOR = "change-point"
TUNE_ALSO = ("pooled", "proportional", "deadband")  # what `fedlb tune` compares the default with


def controller() -> str:
    """The default controller in words, as the entry points report it."""
    return f"{TUNER} tuner, {ESTIMATOR} estimator"
