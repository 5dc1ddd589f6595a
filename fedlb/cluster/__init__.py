"""fedlb.cluster: load-balanced BSP inside one datacenter on torch.distributed.

`weighted_allreduce_hook` (a DDP comm hook: g = Σ x_r g_r / X), `Coordinator` (reports
gathered to rank 0, sizes broadcast; blocking on CPU, one iteration late on GPU), and
`LoadBalancer`, which puts both into a user's own training loop; the same manager as a
gRPC service (`serve`, `ManagerClient`) for workers of any framework.
"""

from .balancer import LoadBalancer
from .coordinator import ClusterError, Coordinator, Exchange, exchange_backend
from .hook import WeightedState, weighted_allreduce_hook
from .policies import (
    BALANCING_POLICIES,
    CLUSTER_POLICIES,
    DEFAULT_CLUSTER_POLICY,
    ClusterPolicy,
    parse_policy,
)
from .service import ManagerClient, ManagerService, RequestError, serve

__all__ = [
    "BALANCING_POLICIES",
    "CLUSTER_POLICIES",
    "DEFAULT_CLUSTER_POLICY",
    "ClusterError",
    "ClusterPolicy",
    "Coordinator",
    "Exchange",
    "LoadBalancer",
    "ManagerClient",
    "ManagerService",
    "RequestError",
    "WeightedState",
    "exchange_backend",
    "parse_policy",
    "serve",
    "weighted_allreduce_hook",
]
