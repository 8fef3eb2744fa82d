"""Engine micro-benchmark: load time, prefill throughput, single-stream and batched decode throughput.

    python -m splitserve.engines.bench [--model PATH] [--dtype float32] [--threads 2] [--json]

Also times the plain transformers `DynamicCache` (grown by torch.cat every step) on the same batch, as the
baseline the engine's in-place buffers are measured against.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from splitserve.engines.base import Sampling
from splitserve.engines.hf import HfEngine

TEXT = (
    "Disaggregated serving runs the prompt pass and the token-by-token pass of a language model on "
    "different workers, so that long prompts never stall the streams of short ones. "
)


def prompt_ids(engine: HfEngine, n: int, salt: int = 0) -> list[int]:
    base = engine.encode(f"{salt} {TEXT}" * (n // 20 + 2))
    return base[:n]


def time_prefill(engine: HfEngine, n: int, repeats: int = 2) -> float:
    ids = prompt_ids(engine, n)
    engine.prefill(ids[:16], Sampling())  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        engine.prefill(ids, Sampling())
        best = min(best, time.perf_counter() - started)
    return n / best


def _best_rate(step: Callable[[], object], batch: int, steps: int, chunks: int = 3) -> float:
    """Tokens/s of the fastest of `chunks` runs of `steps` steps (the machine is shared: take the best)."""
    step()  # warm-up; includes one-off work such as a re-layout
    best = float("inf")
    for _ in range(chunks):
        started = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, time.perf_counter() - started)
    return batch * steps / best


def time_decode(engine: HfEngine, batch: int, prompt_len: int, steps: int) -> float:
    """Aggregate generated tokens/s with `batch` sequences of slightly different lengths in one batch."""
    for i in range(batch):
        result = engine.prefill(prompt_ids(engine, prompt_len + 7 * i, salt=i), Sampling())
        engine.add_sequence(f"b{i}", result.kv, result.first_token, Sampling())
    rate = _best_rate(engine.step, batch, steps)
    for i in range(batch):
        engine.remove_sequence(f"b{i}", keep_kv=False)
    return rate


def time_join_leave(engine: HfEngine, batch: int, prompt_len: int) -> tuple[float, float]:
    """ms to add one sequence to / remove one (with its KV) from a running batch of `batch`."""
    kvs = [engine.prefill(prompt_ids(engine, prompt_len + 7 * i, salt=i), Sampling()).kv for i in range(batch)]
    for i, kv in enumerate(kvs[:-1]):
        engine.add_sequence(f"j{i}", kv, 1, Sampling())
    engine.step()
    joins, leaves = [], []
    for _ in range(3):
        started = time.perf_counter()
        engine.add_sequence("joiner", kvs[-1], 1, Sampling())
        joins.append(time.perf_counter() - started)
        engine.step()
        started = time.perf_counter()
        engine.remove_sequence("joiner")
        leaves.append(time.perf_counter() - started)
    for i in range(batch - 1):
        engine.remove_sequence(f"j{i}", keep_kv=False)
    return min(joins) * 1e3, min(leaves) * 1e3


def time_decode_dynamic_cache(engine: HfEngine, batch: int, prompt_len: int, steps: int) -> float:
    """Baseline: the same batch left-padded in a stock DynamicCache (grows by torch.cat), stock SDPA."""
    kvs, lengths = [], []
    for i in range(batch):
        ids = prompt_ids(engine, prompt_len + 7 * i, salt=i)
        kvs.append(engine.prefill(ids, Sampling()).kv)
        lengths.append(len(ids))
    width, info = max(lengths), engine.info
    padded = torch.zeros((info.num_layers, 2, batch, info.num_kv_heads, width, info.head_dim))
    for row, (kv, n) in enumerate(zip(kvs, lengths, strict=True)):
        padded[:, :, row, :, width - n :] = kv
    state: dict[str, Any] = {
        "cache": DynamicCache(ddp_cache_data=[(layer[0], layer[1]) for layer in padded], config=engine.model.config),
        "mask": torch.tensor([[0] * (width - n) + [1] * n for n in lengths]),
        "positions": torch.tensor(lengths).unsqueeze(1),
        "tokens": torch.ones((batch, 1), dtype=torch.long),
    }

    def step() -> None:
        state["mask"] = torch.cat([state["mask"], torch.ones((batch, 1), dtype=torch.long)], dim=1)
        with torch.inference_mode():
            logits = engine.model(
                input_ids=state["tokens"],
                position_ids=state["positions"],
                attention_mask=state["mask"],
                past_key_values=state["cache"],
                use_cache=True,
            ).logits[:, -1]
        state["tokens"] = logits.argmax(-1, keepdim=True)
        state["positions"] = state["positions"] + 1

    implementation = engine.model.config._attn_implementation
    engine.model.set_attn_implementation("sdpa")
    try:
        return _best_rate(step, batch, steps)
    finally:
        engine.model.set_attn_implementation(implementation)


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = HfEngine.load(args.model, dtype=args.dtype, num_threads=args.threads)
    results: dict[str, Any] = {
        "model": engine.info.name,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "load_s": round(engine.load_seconds or 0.0, 2),
    }
    for n in args.prefill:
        results[f"prefill_{n}_tok_s"] = round(time_prefill(engine, n), 1)
    for batch in args.batches:
        results[f"decode_b{batch}_tok_s"] = round(time_decode(engine, batch, args.prompt_len, args.steps), 1)
    results["join_ms"], results["leave_ms"] = (
        round(x, 1) for x in time_join_leave(engine, max(args.batches), args.prompt_len)
    )
    if args.baseline:
        batch = max(args.batches)
        rate = time_decode_dynamic_cache(engine, batch, args.prompt_len, args.steps)
        results[f"decode_b{batch}_dynamiccache_tok_s"] = round(rate, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefill", type=int, nargs="*", default=[512, 2000])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed chunk (3 chunks)")
    parser.add_argument("--baseline", action="store_true", help="also time a stock DynamicCache batch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        print(json.dumps(results))
    else:
        for key, value in results.items():
            print(f"{key:32} {value}")


if __name__ == "__main__":
    main()
