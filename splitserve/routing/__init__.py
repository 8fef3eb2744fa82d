"""Pure routing policy: strategies, the shared load-aware cost, the disaggregation rule, the Router.

No NATS, asyncio, torch or engine imports: the live router service, the benchmarks and the simulator run
these very objects. See :mod:`splitserve.routing.router` for the order of a decision.
"""

from splitserve.routing.base import (
    DECODE,
    DIRECT,
    DISAGGREGATED,
    PREFILL,
    Candidate,
    Decision,
    NoWorkers,
    Role,
    RoutingRequest,
    Selection,
    Strategy,
    WorkerView,
)
from splitserve.routing.context import ContextPools
from splitserve.routing.cost import CostConfig, CostModel
from splitserve.routing.disagg import DisaggPolicy, RouteChoice
from splitserve.routing.kvaware import KvAwareStrategy
from splitserve.routing.pending import PendingLoad
from splitserve.routing.predictor import LatencyPredictor, PredictorConfig, SloEstimate
from splitserve.routing.prefixaware import PrefixAwareStrategy
from splitserve.routing.registry import available, make_strategy, register
from splitserve.routing.roundrobin import RoundRobinStrategy
from splitserve.routing.router import Router
from splitserve.routing.session import HashRing, SessionStrategy
from splitserve.routing.slo import SloStrategy

__all__ = [
    "DECODE",
    "DIRECT",
    "DISAGGREGATED",
    "PREFILL",
    "Candidate",
    "ContextPools",
    "CostConfig",
    "CostModel",
    "Decision",
    "DisaggPolicy",
    "HashRing",
    "KvAwareStrategy",
    "LatencyPredictor",
    "NoWorkers",
    "PendingLoad",
    "PredictorConfig",
    "PrefixAwareStrategy",
    "Role",
    "RoundRobinStrategy",
    "RouteChoice",
    "Router",
    "RoutingRequest",
    "Selection",
    "SessionStrategy",
    "SloEstimate",
    "SloStrategy",
    "Strategy",
    "WorkerView",
    "available",
    "make_strategy",
    "register",
]
