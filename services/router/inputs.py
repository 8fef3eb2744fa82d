"""What the routing policy decides on for one request: its :class:`RoutingRequest` (prompt, tenant, session, cache
salt, the tenant's SLO targets) and the views of the live workers of its model (adapter affinity applied). One
place for both of the router's questions to the policy: where a request goes (``RouterCore._decide``) and whether
it can meet its SLO at all (SLO admission, :mod:`.slo_gate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.proto import GenerateRequest
from splitserve.routing import RoutingRequest, WorkerView
from splitserve.routing.adapters import adapter_views

if TYPE_CHECKING:
    from splitserve.services.router.core import RouterCore


def routing_inputs(core: RouterCore, req: GenerateRequest, token_ids: list[int], salt: str, now: float,
                   pin: str | None = None) -> tuple[RoutingRequest, list[WorkerView], str, dict[str, str]]:
    """(request, worker views, model, adapter affinity) for ``req`` over ``token_ids`` (its prompt, or prompt +
    tokens so far when it moves) among the workers live now; ``pin``: only that decoder, if it is one of them."""
    model = core.models.served(req.model).name
    decoders, prefillers = core._live("decode", model, now, req.lora), core._live("prefill", model, now, req.lora)
    decoders = [hb for hb in decoders if hb.worker_id == pin] or decoders  # (a preemption's freed slot)
    views, affinity = adapter_views([core._view(hb) for hb in decoders], [core._view(hb) for hb in prefillers],
                                    {hb.worker_id for hb in decoders + prefillers if req.lora in hb.adapters},
                                    req.lora is not None and core.lora_affinity)
    slo = core.tenants.slo(req.tenant)
    rreq = RoutingRequest(request_id=req.key, tenant=req.tenant, token_ids=token_ids, session_key=req.session_id,
                          force_route=None if req.route == "auto" else req.route, cache_salt=salt,
                          ttft_slo_ms=slo.ttft_p99_ms if slo is not None else None,
                          itl_slo_ms=slo.itl_p99_ms if slo is not None else None)
    return rreq, views, model, affinity
