"""Latency models: how long one engine step takes, from published measurements or from this machine.

Every model is a :class:`StepFit` (the form DistServe's simulator uses, per model and TP degree):

* prefill ms = a + b * sum(tokens) + c * sum(tokens^2)            (a batch of prompts, each computed whole)
* decode ms  = a + b * sum(context tokens) + c * batch            (one token for each of ``batch`` streams;
                                                                   small- and large-batch fits apart)

Every step may also carry a worker overhead: ``overhead_ms`` plus ``overhead_per_token_ms`` for each context
token the step touches (the prompts' tokens for a prefill, the streams' context for a decode; DistServe's
simulator adds 2 ms + 1e-4 ms per context token to every step for its Ray workers, see :func:`distserve`).

A mixed step (chunked prefill: decodes riding along with prefill chunks) costs the prefill of the
chunks plus the decode terms beyond the fixed per-pass cost (one pass reads the weights once). A chunk of
``n`` tokens after ``p`` already-computed tokens costs ``b*n + c*(2*n*p + n^2)``, so the chunks of a prompt
add up to the whole prompt's ``b*L + c*L^2``.

Sources (``../shared/data/calib/``, see its README):

* :func:`distserve` - DistServe's A100-80G fits per model (OPT-13B/66B) and TP degree;
* :func:`splitwise` - Splitwise's measured ``perf_model.csv`` (llama2-70b, bloom-176b on A100 and H100, TP 2/4/8),
  fitted here by least squares to the same form;
* :func:`calibrated` / :func:`measure_hf` - this machine: the hf engine's measured prefill and decode speeds.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from splitserve.sim.workload import DATA_DIR

__all__ = ["CALIB_DIR", "StepFit", "calibrated", "distserve", "latency_model", "measure_hf", "splitwise"]

CALIB_DIR = DATA_DIR / "calib"


@dataclass(frozen=True, slots=True)
class StepFit:
    name: str
    prefill: tuple[float, float, float]
    decode_small: tuple[float, float, float]
    decode_large: tuple[float, float, float] | None = None
    large_batch: int = 95  # batches of at least this many streams use ``decode_large``
    overhead_ms: float = 0.0  # added to every step (scheduling, sampling, RPC)
    overhead_per_token_ms: float = 0.0  # added per context token of the step (its prompts' or streams' tokens)

    def prefill_ms(self, lengths: Sequence[int]) -> float:
        a, b, c = self.prefill
        s = 0
        s2 = 0
        for n in lengths:
            s += n
            s2 += n * n
        return a + b * s + c * s2 + self.overhead_ms + self.overhead_per_token_ms * s

    def chunk_ms(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Prefill of chunks given as (tokens, tokens already computed before the chunk)."""
        a, b, c = self.prefill
        t = a + self.overhead_ms
        k = self.overhead_per_token_ms
        for n, p in chunks:
            t += (b + k) * n + c * (2 * n * p + n * n)
        return t

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        a, b, c = self.decode_large if (self.decode_large and batch >= self.large_batch) else self.decode_small
        return a + b * context_tokens + c * batch + self.overhead_ms + self.overhead_per_token_ms * context_tokens

    def mixed_ms(self, chunks: Sequence[tuple[int, int]], batch: int, context_tokens: int) -> float:
        if not chunks:
            return self.decode_ms(batch, context_tokens) if batch else 0.0
        t = self.chunk_ms(chunks)
        if batch:
            a, b, c = self.decode_large if (self.decode_large and batch >= self.large_batch) else self.decode_small
            t += (b + self.overhead_per_token_ms) * context_tokens + c * batch
        return t

    def prefill_tokens_per_s(self, tokens: int = 512) -> float:
        return 1000.0 * tokens / self.prefill_ms([tokens])

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def scaled(self, factor: float, name: str | None = None) -> StepFit:
        """Every time multiplied by ``factor`` (e.g. a faster GPU generation)."""
        def m(t: tuple[float, float, float]) -> tuple[float, float, float]:
            return (t[0] * factor, t[1] * factor, t[2] * factor)
        return StepFit(name or f"{self.name}x{factor:g}", m(self.prefill), m(self.decode_small),
                       m(self.decode_large) if self.decode_large else None, self.large_batch,
                       self.overhead_ms * factor, self.overhead_per_token_ms * factor)


_MODEL_ALIASES = {"opt-13b": "facebook/opt-13b", "opt-66b": "facebook/opt-66b"}


def distserve(model: str = "opt-13b", tp: int = 1, path: Path | None = None, worker_overhead: bool = False) -> StepFit:
    """DistServe's A100-80G fit for ``model`` at TP ``tp``, as its estimator applies it
    (``simdistserve/estimators/time_estimator.py``: ``get_prefill_time`` adds 1 ms per pipeline stage).
    ``worker_overhead``: also the 2 ms + 1e-4 ms per context token its simulated worker adds to every prefill and
    decode step (``simdistserve/base/worker.py``, ``Worker.add_ray_overhead``, called by ``do_prefill`` and
    ``do_decode``)."""
    data = json.loads((path or CALIB_DIR / "profiler-a100-80g.distserve.json").read_text())
    key = _MODEL_ALIASES.get(model, model)
    if key not in data:
        raise ValueError(f"no DistServe fit for {model!r}; have {', '.join(data)}")
    per_tp = data[key]
    if str(tp) not in per_tp:
        raise ValueError(f"no DistServe fit for {model} at TP {tp}; have TP {', '.join(per_tp)}")
    d = per_tp[str(tp)]
    a, b, c = d["prefill"]
    # DistServe's estimator adds 1 ms per pipeline stage to a prefill step (none to a decode step)
    return StepFit(f"distserve/{model}/a100/tp{tp}" + ("+worker" if worker_overhead else ""), (a + 1.0, b, c),
                   tuple(d["decoding_smallbs"]), tuple(d["decoding_largebs"]),
                   int(d["decoding_large_small_bs_threshold"]), overhead_ms=2.0 if worker_overhead else 0.0,
                   overhead_per_token_ms=1e-4 if worker_overhead else 0.0)


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(ys, dtype=float), rcond=None)
    return [float(x) for x in coef]


def splitwise(model: str = "llama2-70b", gpu: str = "h100", tp: int = 8, path: Path | None = None) -> StepFit:
    hw = {"a100": "a100-80gb", "h100": "h100-80gb"}.get(gpu, gpu)
    pre_x: list[list[float]] = []
    pre_y: list[float] = []
    dec_x: list[list[float]] = []
    dec_y: list[float] = []
    with open(path or CALIB_DIR / "perf_model.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["model"] != model or r["hardware"] != hw or int(r["tensor_parallel"]) != tp:
                continue
            p, b, o = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
            # prompt_time of one prompt by its length (the batched rows of the table are not monotonic in the
            # batch size - some large batches ran faster than smaller ones - so they would skew the fit)
            if b == 1:
                pre_x.append([1.0, p, p * p])
                pre_y.append(float(r["prompt_time"]))
            dec_x.append([1.0, b * (p + o / 2), b])  # mean context over the generation
            dec_y.append(float(r["token_time"]))
    if not pre_y:
        raise ValueError(f"no Splitwise measurements for {model} on {hw} at TP {tp}")
    # The quadratic (attention) term is not fitted freely: three points up to 8k tokens cannot pin it down, and
    # a free fit (10x the attention FLOPs here) made a 38k-token Mooncake prompt take ~10 s at TP8. It is tied
    # to the linear term by the FLOP ratio: causal attention costs 2*d_model*layers FLOPs per token^2 against
    # 2*params per token, so prefill ms = a + b * (L + r * L^2) with r = d_model * layers / params.
    ratio = _ATTN_RATIO.get(model)
    if ratio is None:
        pa, pb, pc = _lstsq(pre_x, pre_y)
    else:
        pa, pb = _lstsq([[1.0, x[1] + ratio * x[2]] for x in pre_x], pre_y)
        pc = pb * ratio
    da, db, dc = _lstsq(dec_x, dec_y)
    return StepFit(f"splitwise/{model}/{gpu}/tp{tp}", (pa, max(pb, 0.0), max(pc, 0.0)),
                   (da, max(db, 0.0), max(dc, 0.0)))


_ATTN_RATIO = {"llama2-70b": 8192 * 80 / 69e9, "bloom-176b": 14336 * 70 / 176e9}


def calibrated(prefill_points: Sequence[tuple[int, float]], decode_points: Sequence[tuple[int, int, float]],
               name: str = "calibrated", overhead_ms: float = 0.0) -> StepFit:
    """A fit from measurements: ``prefill_points`` (tokens, ms) and ``decode_points`` (batch, total context
    tokens, step ms)."""
    if len(prefill_points) < 2 or len(decode_points) < 2:
        raise ValueError("calibration needs at least two prefill and two decode measurements")
    pa, pb, pc = _lstsq([[1.0, n, n * n] for n, _ in prefill_points], [ms for _, ms in prefill_points])
    if len(prefill_points) < 3 or pc < 0:
        pa, pb = _lstsq([[1.0, n] for n, _ in prefill_points], [ms for _, ms in prefill_points])
        pc = 0.0
    if len({ctx for _, ctx, _ in decode_points}) > 2:
        da, db, dc = _lstsq([[1.0, ctx, b] for b, ctx, _ in decode_points], [ms for *_, ms in decode_points])
    else:
        da, dc = _lstsq([[1.0, b] for b, _, _ in decode_points], [ms for *_, ms in decode_points])
        db = 0.0
    return StepFit(name, (max(pa, 0.0), max(pb, 0.0), max(pc, 0.0)), (max(da, 0.0), max(db, 0.0), max(dc, 0.0)),
                   overhead_ms=overhead_ms)


def measure_hf(threads: int = 1, prefill: Sequence[int] = (128, 512, 1024), batches: Sequence[int] = (1, 4, 8),
               prompt_len: int = 200, model: str | None = None) -> StepFit:
    """Time the bundled model on this machine with the hf engine (``threads`` torch threads, as a worker
    pinned to that many cores runs it) and fit the step model. Loads the model (~15 s)."""
    from splitserve.engines import bench as eb
    from splitserve.engines.hf import HfEngine

    engine = HfEngine.load(model, dtype="float32", num_threads=threads)
    pre = [(n, 1000.0 * n / eb.time_prefill(engine, n, repeats=3)) for n in prefill]
    dec = []
    # one long single stream too, so the context term is not confounded with the batch term
    for b, plen in [(1, 4 * prompt_len)] + [(b, prompt_len) for b in batches]:
        tok_s = eb.time_decode(engine, b, plen, steps=8)
        ctx = sum(plen + 7 * i for i in range(b))
        dec.append((b, ctx, 1000.0 * b / tok_s))
    return calibrated(pre, dec, name=f"calibrated/hf/{threads}thr")


def latency_model(spec: str) -> StepFit:
    """A model by name: ``distserve:opt-13b:tp2``, ``splitwise:llama2-70b:h100:tp8``, or a JSON file
    written by ``StepFit.describe()`` (e.g. a saved calibration)."""
    parts = spec.split(":")
    try:
        if parts[0] == "distserve":
            return distserve(parts[1] if len(parts) > 1 else "opt-13b", int(parts[2].lstrip("tp")) if len(parts) > 2
                             else 1)
        if parts[0] == "splitwise":
            return splitwise(parts[1] if len(parts) > 1 else "llama2-70b", parts[2] if len(parts) > 2 else "h100",
                             int(parts[3].lstrip("tp")) if len(parts) > 3 else 8)
    except (IndexError, ValueError) as exc:
        raise ValueError(f"bad latency model {spec!r}: {exc}") from exc
    p = Path(spec)
    if p.exists():
        d = json.loads(p.read_text())
        return StepFit(d.get("name", p.stem), tuple(d["prefill"]), tuple(d["decode_small"]),
                       tuple(d["decode_large"]) if d.get("decode_large") else None, int(d.get("large_batch", 95)),
                       float(d.get("overhead_ms", 0.0)), float(d.get("overhead_per_token_ms", 0.0)))
    raise ValueError(f"unknown latency model {spec!r}: distserve:MODEL:tpN, splitwise:MODEL:GPU:tpN or a JSON file")
