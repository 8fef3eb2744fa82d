"""Summarise a py-spy ``record --format raw`` file (collapsed stacks): the frames with the most samples.

    python -m bench.pyspy_top FILE [--top 25] [--filter splitserve]

Prints two tables: *self* (samples whose innermost frame is this function: where the CPU actually is) and
*total* (samples with the function anywhere on the stack: what a call costs with everything under it).
Idle samples (the event loop waiting in select/epoll) are counted apart, so the shares are of busy time.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def _frame(f: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)": one row per function, not per line
    f = _LINE.sub(")", f.strip())
    name, _, where = f.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def load(path: Path) -> tuple[Counter[str], Counter[str], int, int]:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    busy = idle = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = [_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        if frames[-1].startswith(("select (selectors.py", "poll (selectors.py")) or frames[-1] in ("process ", ""):
            idle += count
            continue
        busy += count
        own[frames[-1]] += count
        for f in set(frames[1:]):  # the thread/process frame is on every stack
            total[f] += count
    return own, total, busy, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--filter", default="", help="only total-table frames containing this text")
    a = ap.parse_args()
    own, total, busy, idle = load(a.file)
    print(f"{a.file}: {busy} busy samples, {idle} idle ({busy / max(1, busy + idle):.0%} busy)")
    print("self (innermost frame), share of busy samples:")
    for f, n in own.most_common(a.top):
        print(f"  {n / busy:6.1%}  {f}")
    print("total (anywhere on the stack):")
    rows = [(f, n) for f, n in total.most_common() if a.filter in f][: a.top]
    for f, n in rows:
        print(f"  {n / busy:6.1%}  {f}")


if __name__ == "__main__":
    main()
