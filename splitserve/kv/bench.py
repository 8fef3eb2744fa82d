"""KV push bandwidth per transport, beside a plain memory copy of the same bytes (the machine's ceiling).

``python -m splitserve.kv.bench`` prints a table for both transports at a long-prompt size (2,000 tokens of
the bundled model, ~92 MB) and a short one (128 tokens, ~5.9 MB), plus the idle CPU of a NIXL receiver
process with stock and with our progress-thread settings.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from splitserve.kv.layout import SMOLLM2_135M, KvLayout
from splitserve.kv.peer import ReceiverProcess, pool_digest
from splitserve.kv.pool import BlockPool
from splitserve.kv.transport import TRANSPORTS, make_sender


def memcpy_bandwidth(nbytes: int, repeats: int = 5, threads: int = 1) -> dict[str, Any]:
    """A torch tensor copy of ``nbytes``: the ceiling for any in-host KV move.

    One thread by default, like a transport's copy (CMA, a socket): on a busy 2-core box torch's default
    two-thread copy was slower for small sizes (~7 ms for 5.9 MB: it waits for the second core).
    """
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {
        "transport": "memcpy",
        "bytes": nbytes,
        "seconds_median": statistics.median(times),
        "gbps_median": nbytes / statistics.median(times) / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
    }


async def measure_push_bandwidth(
    transport: str,
    nbytes: int,
    *,
    repeats: int = 5,
    layout: KvLayout = SMOLLM2_135M,
    fragmented: bool = False,
    **opts: Any,
) -> dict[str, Any]:
    """Push ``nbytes`` (rounded up to whole blocks) from this process into a receiver in another process.

    ``fragmented`` scatters the target blocks so no two are adjacent: one region per block and layer, the
    worst case for a busy paged pool. Returns timings, GB/s and whether the bytes arrived intact.
    """
    num_blocks = layout.blocks_for_tokens(max(1, -(-nbytes // layout.bytes_per_token)))
    t0 = time.perf_counter()
    sender = make_sender(transport, BlockPool(layout, num_blocks), **opts)
    sender_setup = time.perf_counter() - t0
    spare = num_blocks if fragmented else 0
    try:
        with ReceiverProcess(transport, layout, num_blocks + spare, **opts) as peer:
            src = sender.pool.allocate(num_blocks)
            sender.pool.tensor.uniform_()
            dst = peer.allocate(num_blocks + spare)
            if fragmented:
                dst = random.Random(0).sample(dst[::2], num_blocks)
            desc = peer.descriptor(dst)
            first = await sender.push("bench-first", src, desc)
            stats = [await sender.push(f"bench-{i}", src, desc) for i in range(repeats)]
            tids = ["bench-first"] + [f"bench-{i}" for i in range(repeats)]
            waited = peer.wait(tids, 30)
            verified = all(v is None for v in waited.values()) and peer.digest(dst) == pool_digest(
                sender.pool, src
            )
            receiver_setup = peer.setup_seconds
    finally:
        sender.close()
    seconds = [s.seconds for s in stats]
    moved = first.bytes
    return {
        "transport": transport,
        "bytes": moved,
        "tokens": num_blocks * layout.block_size,
        "blocks": num_blocks,
        "fragmented": fragmented,
        "sender_setup_s": sender_setup,
        "receiver_setup_s": receiver_setup,
        "first_push_s": first.seconds,
        "seconds_median": statistics.median(seconds),
        "gbps_median": moved / statistics.median(seconds) / 1e9,
        "gbps_best": moved / min(seconds) / 1e9,
        "verified": verified,
    }


def idle_cpu_percent(transport: str, seconds: float = 3.0, **opts: Any) -> float:
    """CPU use of an otherwise idle receiver process (percent of one core)."""
    with ReceiverProcess(transport, SMOLLM2_135M, 4, **opts) as peer:
        proc = psutil.Process(peer.pid)
        time.sleep(0.5)  # let start-up settle
        proc.cpu_percent(None)
        time.sleep(seconds)
        return float(proc.cpu_percent(None))


def _row(r: dict[str, Any]) -> str:
    size = f"{r['bytes'] / 1e6:8.1f} MB"
    first = f"{r['first_push_s'] * 1e3:9.1f}" if "first_push_s" in r else " " * 9
    ok = "" if "verified" not in r else ("yes" if r["verified"] else "NO")
    name = r["transport"] + (" (frag)" if r.get("fragmented") else "")
    return (
        f"{name:<14}{size}  {first}  {r['seconds_median'] * 1e3:9.2f}  {r['gbps_median']:7.2f}  "
        f"{r['gbps_best']:7.2f}  {ok}"
    )


async def _main(
    tokens: Sequence[int], transports: Sequence[str], repeats: int, fragmented: bool, idle: bool
) -> None:
    head = ("transport", "size", "first ms", "median ms", "GB/s", "best")
    print(f"{head[0]:<14}{head[1]:>11}  {head[2]:>9}  {head[3]:>9}  {head[4]:>7}  {head[5]:>7}  intact")
    for t in tokens:
        nbytes = t * SMOLLM2_135M.bytes_per_token
        print(_row(memcpy_bandwidth(nbytes, repeats)))
        for name in transports:
            print(_row(await measure_push_bandwidth(name, nbytes, repeats=repeats)))
            if fragmented:
                print(_row(await measure_push_bandwidth(name, nbytes, repeats=repeats, fragmented=True)))
    if idle and "nixl" in transports:
        stock = idle_cpu_percent("nixl", progress_delay_us=0)
        tuned = idle_cpu_percent("nixl")
        print(f"idle NIXL receiver process CPU: stock {stock:.0f} %, progress_delay_us=10000 {tuned:.0f} %")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 128],
                        help="KV sizes in tokens of the bundled model (46,080 B each)")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fragmented", action="store_true", help="also push into non-adjacent blocks")
    parser.add_argument("--no-idle", dest="idle", action="store_false", help="skip the idle CPU check")
    args = parser.parse_args(argv)
    asyncio.run(_main(args.tokens, args.transports, args.repeats, args.fragmented, args.idle))


if __name__ == "__main__":
    main()
