"""Engine batching on the hf engine: does sharing one forward between requests pay, against the unbatched path?

* prefill: N short prompts of different lengths, prefilled one at a time (``engine.prefill`` each, the
  baseline) and together (``engine.prefill_batch``: one right-padded forward); ms per prompt and the speedup;
* decode: tokens/s of one stream alone (the baseline) and of S streams stepped together (one batched forward
  per step); the ratio.

Both sides of each comparison run in the same process on the same engine, in alternating rounds (the machine
may be shared: anything else running loads both alike); each figure is the median over rounds, and the best
round is printed too. The bundled SmolLM2-135M unless --model.

    python -m bench.engine_batching [--prompts 8] [--streams 8] [--rounds 5] [--steps 16] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from splitserve.engines import PrefillRequest, Sampling
from splitserve.engines.hf import HfEngine

QUESTIONS = (
    "Hi!",
    "What is 2+2? Answer briefly.",
    "Tell me about Paris.",
    "Name three rivers in Europe.",
    "Write one sentence about the sea, the wind and the sky.",
    "Translate 'good morning' into French, German and Spanish.",
    "Why is the sky blue? Explain it to a child in two sentences.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
)
GREEDY = Sampling()


def prompts(engine: HfEngine, n: int, kind: str = "chat") -> list[list[int]]:
    """n prompts of different lengths: chat (the model's template adds a ~30-token system prompt) or raw
    (the bare questions, 2-17 tokens). The questions repeat, numbered, past eight."""
    texts = [QUESTIONS[i % len(QUESTIONS)] + (f" ({i})" if i >= len(QUESTIONS) else "") for i in range(n)]
    if kind == "raw":
        return [engine.encode(t) for t in texts]
    return [engine.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _alternating(rounds: int, base: Callable[[], float], other: Callable[[], float]) -> tuple[list[float], list[float]]:
    """Each measurement ``rounds`` times, their order swapped every round so drift on a shared machine hits both
    alike: (base's figures, other's)."""
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(base())
            b.append(other())
        else:
            b.append(other())
            a.append(base())
    return a, b


def bench_prefill(engine: HfEngine, ids: list[list[int]], rounds: int) -> dict[str, Any]:
    requests = [PrefillRequest(p, GREEDY) for p in ids]
    engine.prefill(ids[0], GREEDY)  # warm-up, both paths
    engine.prefill_batch(requests[:2])
    alone, together = _alternating(
        rounds, lambda: _timed(lambda: [engine.prefill(p, GREEDY) for p in ids]) * 1e3 / len(ids),
        lambda: _timed(lambda: engine.prefill_batch(requests)) * 1e3 / len(ids))
    a, t = statistics.median(alone), statistics.median(together)
    return {
        "prompts": len(ids),
        "prompt_tokens": [len(p) for p in ids],
        "alone_ms_per_prompt": round(a, 1),
        "batched_ms_per_prompt": round(t, 1),
        "speedup": round(a / t, 2),
        "best_alone_ms_per_prompt": round(min(alone), 1),
        "best_batched_ms_per_prompt": round(min(together), 1),
        "best_speedup": round(min(alone) / min(together), 2),
    }


def _decode_rate(engine: HfEngine, ids: list[list[int]], steps: int) -> float:
    """Generated tokens/s of len(ids) streams stepped together (KV set up first, not timed)."""
    for i, p in enumerate(ids):
        res = engine.prefill(p, GREEDY)
        engine.add_sequence(f"d{i}", res.kv, res.first_token, GREEDY)
    engine.step()  # warm-up (one-off buffer work)
    elapsed = _timed(lambda: [engine.step() for _ in range(steps)])
    for i in range(len(ids)):
        engine.remove_sequence(f"d{i}", keep_kv=False)
    return len(ids) * steps / elapsed


def bench_decode(engine: HfEngine, ids: list[list[int]], rounds: int, steps: int) -> dict[str, Any]:
    one, many = _alternating(rounds, lambda: _decode_rate(engine, ids[:1], steps),
                             lambda: _decode_rate(engine, ids, steps))
    o, m = statistics.median(one), statistics.median(many)
    return {
        "streams": len(ids),
        "steps": steps,
        "one_stream_tok_s": round(o, 1),
        "batched_tok_s": round(m, 1),
        "ratio": round(m / o, 2),
        "best_one_stream_tok_s": round(max(one), 1),
        "best_batched_tok_s": round(max(many), 1),
        "best_ratio": round(max(many) / max(one), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = HfEngine.load(args.model, dtype=args.dtype, num_threads=args.threads)
    out: dict[str, Any] = {"model": engine.info.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                           "rounds": args.rounds}
    out["prefill"] = bench_prefill(engine, prompts(engine, args.prompts), args.rounds)
    out["prefill_raw"] = bench_prefill(engine, prompts(engine, args.prompts, "raw"), args.rounds)
    out["decode"] = bench_decode(engine, prompts(engine, args.streams), args.rounds, args.steps)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    ap.add_argument("--prompts", type=int, default=8, help="short prompts prefilled together")
    ap.add_argument("--streams", type=int, default=8, help="decode streams stepped together")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    d = out["decode"]
    print(f"{out['model']} {out['dtype']}, {out['threads']} thread(s), median of {out['rounds']} alternating rounds")
    for key, kind in (("prefill", "chat"), ("prefill_raw", "raw")):
        p = out[key]
        tokens = f"{min(p['prompt_tokens'])}-{max(p['prompt_tokens'])} tokens"
        print(f"prefill, {p['prompts']} short {kind} prompts ({tokens}):")
        print(f"  one at a time (baseline): {p['alone_ms_per_prompt']:8.1f} ms/prompt"
              f"   (best {p['best_alone_ms_per_prompt']})")
        print(f"  one batched forward:      {p['batched_ms_per_prompt']:8.1f} ms/prompt"
              f"   (best {p['best_batched_ms_per_prompt']})")
        print(f"  speedup x{p['speedup']} (best rounds x{p['best_speedup']})")
    print(f"decode, {d['steps']} steps per run:")
    print(f"  1 stream (baseline):      {d['one_stream_tok_s']:8.1f} tok/s   (best {d['best_one_stream_tok_s']})")
    print(f"  {d['streams']} streams batched:       {d['batched_tok_s']:8.1f} tok/s   (best {d['best_batched_tok_s']})")
    print(f"  ratio x{d['ratio']} (best rounds x{d['best_ratio']})")


if __name__ == "__main__":
    main()
