"""KV-transfer cost: bytes per token of a model, and the time to move them over a fabric.

``transfer_s = latency + bytes / bandwidth``. With ``layerwise`` pushes (each layer sent as soon as it is
computed, as splitserve's prefillers do) only what is left after the prefill's own compute is exposed:
``max(latency + bytes/bandwidth - compute, latency + bytes/bandwidth/layers)`` (the last layer always waits).

Bandwidths are per GPU (one prefill instance to one decode instance), each direction:

* ``nvlink``  - NVLink within a node: 300 GB/s (A100 NVLink3, 600 GB/s bidirectional); ``nvlink-h100`` 450 GB/s;
* ``efa``     - AWS EFA, 3,200 Gbps per p5 node over 8 GPUs: 50 GB/s per GPU (~90% achievable);
* ``tcp100``  - 100 GbE TCP: 12.5 GB/s line rate, ~70% achieved by one TCP stream;
* ``local``   - this machine's KV push (NIXL/UCX over shared memory, measured 2.6-3.9 GB/s; DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FABRICS", "MODELS", "Fabric", "ModelSpec", "fabric", "model_spec"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_context: int = 1 << 20

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


MODELS = {
    "opt-13b": ModelSpec("opt-13b", 40, 40, 128, 2, 2048),
    "opt-66b": ModelSpec("opt-66b", 64, 72, 128, 2, 2048),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8, 128, 2, 4096),
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 8, 128, 2, 131072),
    "llama-3.3-70b": ModelSpec("llama-3.3-70b", 80, 8, 128, 2, 131072),
    "bloom-176b": ModelSpec("bloom-176b", 70, 112, 128, 2, 2048),
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 3, 64, 4, 8192),
}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


@dataclass(frozen=True, slots=True)
class Fabric:
    name: str
    bandwidth_gbs: float  # GB/s achieved, per transfer
    latency_s: float = 20e-6
    layerwise: bool = True

    def transfer_s(self, nbytes: int, compute_s: float = 0.0, layers: int = 1) -> float:
        if nbytes <= 0:
            return 0.0
        whole = self.latency_s + nbytes / (self.bandwidth_gbs * 1e9)
        if not self.layerwise or compute_s <= 0:
            return whole
        return max(whole - compute_s, self.latency_s + nbytes / (self.bandwidth_gbs * 1e9) / max(1, layers))


FABRICS = {
    "nvlink": Fabric("nvlink", 300.0, 5e-6),
    "nvlink-h100": Fabric("nvlink-h100", 450.0, 5e-6),
    "efa": Fabric("efa", 50.0 * 0.9, 20e-6),
    "tcp100": Fabric("tcp100", 12.5 * 0.7, 50e-6),
    "local": Fabric("local", 3.0, 2e-3),
    "none": Fabric("none", float("inf"), 0.0),
}


def fabric(name: str) -> Fabric:
    if name not in FABRICS:
        raise ValueError(f"unknown fabric {name!r}; known: {', '.join(FABRICS)}")
    return FABRICS[name]
