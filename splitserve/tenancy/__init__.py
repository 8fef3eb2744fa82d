"""Tenants: the tenants file (limits, weights, credentials), quota accounting and fair scheduling policy.

Everything here is pure and synchronous (no NATS, no engine): the router, the benchmarks and the tests run
the very same objects.
"""

from splitserve.tenancy.config import TenantLimits, TenantsConfig, TenantSpec, load_tenants

__all__ = ["TenantLimits", "TenantSpec", "TenantsConfig", "load_tenants"]
