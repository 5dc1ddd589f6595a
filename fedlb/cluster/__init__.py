"""fedlb.cluster: load-balanced BSP inside one datacenter on torch.distributed.

`weighted_allreduce_hook` (a DDP comm hook: g = Σ x_r g_r / X), `Coordinator` (reports
gathered to rank 0, sizes broadcast; blocking on CPU, one iteration late on GPU), and
`LoadBalancer`, which puts both into a user's own training loop; the same manager as a
gRPC service (`serve`, `ManagerClient`) for workers of any framework. The straggler
schemes LB-BSP is compared with: a parameter server on torch.distributed.rpc
(`ParameterServer`, `serve_parameters`, `work`: asp, ssp, backup) and eager-SGD's
partial all-reduce (`PartialAllreduce`); local SGD (`LocalSGD`) and Orchestra's barrier
search and agent (`lcm_barrier`, `BarrierAgent`). For ranks that hold only
a local shard, `DataPartitionManager` keeps the shards traversed at one pace.
"""

from .balancer import LoadBalancer
from .coordinator import ClusterError, Coordinator, Exchange, exchange_backend
from .eager import PartialAllreduce
from .hook import weighted_allreduce_hook
from .local import LocalSGD
from .orchestra import Barrier, BarrierAgent, barrier_steps, lcm_barrier
from .partition import DataPartitionManager, Shard
from .policies import (
    CLUSTER_POLICIES,
    DEFAULT_CLUSTER_POLICY,
    parse_policy,
)
from .ps import (
    ParameterServer,
    Snapshot,
    init_ps_rpc,
    timed_gradient,
    work,
)
from .ps import serve as serve_parameters
from .service import ManagerClient, ManagerService, ServiceLimits, serve, start_manager
from .service_auth import ManagerSetupError
from .service_requests import RequestError

__all__ = [
    "CLUSTER_POLICIES",
    "DEFAULT_CLUSTER_POLICY",
    "Barrier",
    "BarrierAgent",
    "ClusterError",
    "Coordinator",
    "DataPartitionManager",
    "Exchange",
    "LoadBalancer",
    "LocalSGD",
    "ManagerClient",
    "ManagerService",
    "ManagerSetupError",
    "ParameterServer",
    "PartialAllreduce",
    "RequestError",
    "ServiceLimits",
    "Shard",
    "Snapshot",
    "barrier_steps",
    "exchange_backend",
    "init_ps_rpc",
    "lcm_barrier",
    "parse_policy",
    "serve",
    "serve_parameters",
    "start_manager",
    "timed_gradient",
    "weighted_allreduce_hook",
    "work",
]
