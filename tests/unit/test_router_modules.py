"""The router is split by concern (issue 25): no module of ``services/router`` grows past ~400 lines, and every
part is a mixin over ``RouterCore`` that ``RouterService`` puts together (a part left out would leave its
handlers unsubscribed or its steps raising NotImplementedError)."""

from __future__ import annotations

import inspect
from pathlib import Path

from splitserve.services.router import admin, core, direct, dispatch, intake, migration, peers, queued_ends, warmstart
from splitserve.services.router.service import RouterService

ROUTER = Path(__file__).resolve().parents[2] / "services" / "router"
MAX_LINES = 400


def test_no_router_module_is_over_the_bound() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in ROUTER.glob("*.py")}
    assert sizes and {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_every_part_is_in_the_service_and_every_declared_step_is_provided() -> None:
    parts = [intake.Intake, direct.DirectDispatch, dispatch.Dispatch, migration.Migration, queued_ends.QueuedEnds,
             peers.Peers, admin.Admin, warmstart.IndexFeed]
    assert all(issubclass(p, core.RouterCore) for p in parts)
    assert all(p in RouterService.__mro__ for p in parts)
    # the steps core declares for the parts resolve to a part's implementation, not the declaration
    declared = [n for n, f in vars(core.RouterCore).items()
                if inspect.iscoroutinefunction(f) and "raise NotImplementedError" in inspect.getsource(f)]
    assert declared
    for name in declared:
        impl = getattr(RouterService, name)
        assert impl is not getattr(core.RouterCore, name), name
