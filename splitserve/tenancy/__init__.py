"""Tenants: the tenants file (limits, weights, credentials), quota accounting and fair scheduling policy.

Everything here is pure and synchronous (no NATS, no engine): the router, the benchmarks and the tests run
the very same objects.
"""

from splitserve.tenancy.config import (
    MAX_REQUEST_CACHE_SALT,
    TenantLimits,
    TenantsConfig,
    TenantSlo,
    TenantSpec,
    combine_cache_salt,
    load_tenants,
)

__all__ = [
    "MAX_REQUEST_CACHE_SALT",
    "TenantLimits",
    "TenantSlo",
    "TenantSpec",
    "TenantsConfig",
    "combine_cache_salt",
    "load_tenants",
]
