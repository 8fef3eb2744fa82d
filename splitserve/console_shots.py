"""Screenshots of every page of the web console, taken in a real headless Chromium.

    python -m splitserve.console_shots --out DIR                     # the console of the stack on this machine
    python -m splitserve.console_shots --url http://HOST:8000 --key ADMIN_KEY --out DIR
    python -m splitserve.console_shots --start --out DIR             # start a stack of its own, load it, shoot

Writes ``cluster.png``, ``tenants.png``, ``requests.png`` (with the slowest request's waterfall open) and
``explorer.png`` (a prompt explained by every strategy). Needs the ``dev`` extra (Playwright) and Debian's
``chromium`` (``tools/apt-packages.txt``); Playwright's own browser download is never used.

:func:`browser` is also what the console's browser tests launch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
EXPLAIN_PROMPT = ("You are a helpful assistant. Summarise the history of the Roman Empire, from the founding of "
                  "the city to the fall of Constantinople, in three sentences.")


def chromium_path() -> str | None:
    for cand in (os.environ.get("SPLITSERVE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if cand and Path(cand).exists():
            return cand
    return None


@contextlib.contextmanager
def browser() -> Iterator[Any]:
    """A headless Chromium driven by Playwright (sync API); raises RuntimeError naming what is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise RuntimeError("the console screenshots need Playwright: pip install 'splitserve[dev]'") from None
    exe = chromium_path()
    if exe is None:
        raise RuntimeError("no chromium found: apt-get install chromium (or set SPLITSERVE_CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def sign_in(page: Any, base: str, key: str | None) -> None:
    """Open the console; sign in with ``key`` when it asks for one."""
    page.goto(f"{base}/console/")
    page.wait_for_function("document.getElementById('who').textContent !== '' || "
                           "!document.getElementById('login').hidden")
    if page.is_visible("#login") and key:
        page.fill("#key-input", key)
        page.click("#key-submit")
        page.wait_for_function("document.getElementById('who').textContent !== ''")


def shoot(base: str, out: Path, key: str | None = None, width: int = 1500, explain_prompt: str = EXPLAIN_PROMPT,
          chat: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with browser() as b:
        page = b.new_page(viewport={"width": width, "height": 900})
        sign_in(page, base, key)
        admin = "admin" in (page.text_content("#who") or "") or "open" in (page.text_content("#who") or "")
        pages = ["cluster", "tenants", "requests", "explorer"] if admin else ["tenants", "requests"]
        for name in pages:
            page.goto(f"{base}/console/#{name}")
            if name == "cluster":
                page.wait_for_selector("#workers .worker-row")
                time.sleep(2.5)  # one more sample: the sparklines have a point to draw to
            elif name == "tenants":
                page.wait_for_selector("#usage tbody tr")
                time.sleep(4.5)  # two samples of the queue report: the sparklines have a line to draw
            elif name == "requests":
                page.wait_for_selector("#slowest tbody tr")
                ids = [r.get_attribute("data-request") for r in page.query_selector_all("#slowest .request-row")]
                for rid in ids[:4]:  # the slowest one that went through a prefiller (its waterfall has a KV push)
                    page.goto(f"{base}/console/#requests/{rid}")
                    page.wait_for_selector("#waterfall .span-row")
                    kv = page.query_selector("#waterfall .span-row[data-span='kv.push']")
                    if kv is not None:
                        kv.click()  # one span's attributes opened
                        break
            elif name == "explorer":
                page.fill("#explain-prompt", explain_prompt)
                page.set_checked("#explain-chat", chat)
                page.click("#explain-submit")
                page.wait_for_selector("#explain .strategy, #explain .error")
            path = out / f"{name}.png"
            page.screenshot(path=str(path), full_page=True)
            shots.append(path)
    return shots


def _post(url: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 - our own front door
        out: dict[str, Any] = json.loads(resp.read())
        return out


DEMO_TENANTS = """\
defaults: {tokens_per_minute: 20000, max_inflight: 8}
tenants:
  search: {weight: 2, api_keys: [sk-demo-search]}
  batch-jobs: {api_keys: [sk-demo-batch], tokens_per_minute: 2000}
"""


def demo(out: Path, engine: str, state_dir: Path) -> list[Path]:
    """Start a stack with two tenants, send them some requests, then shoot every page."""
    from splitserve.stackproc import start_stack
    from splitserve.tenancy.consolekey import read_console_key

    state_dir.mkdir(parents=True, exist_ok=True)
    tenants = state_dir / "tenants.yaml"
    tenants.write_text(DEMO_TENANTS)
    args = ["--engine", engine, "--prefill", "1", "--decode", "2", "--disagg-threshold", "48",
            "--strategy", "kvaware", "--transport", "tcp", "--tenants", str(tenants)]
    print(f"console_shots: starting a stack ({' '.join(args)}) ...", flush=True)
    sp = start_stack(state_dir / "stack", *args, timeout=900)  # a loaded machine loads three models slowly
    try:
        assert sp.http_url is not None
        long = "The history of the Roman Empire spans many centuries, from the founding of the city. " * 4
        for i, (key, prompt) in enumerate([("sk-demo-search", "What is the capital of France?"),
                                           ("sk-demo-search", long + "Summarise it."),
                                           ("sk-demo-batch", "Write a haiku about queues."),
                                           ("sk-demo-search", long + "Summarise it again."),
                                           ("sk-demo-batch", "Count to five.")]):
            _post(f"{sp.http_url}/v1/completions", {"prompt": prompt, "max_tokens": 8 + 4 * i, "temperature": 0},
                  key)
        with contextlib.suppress(Exception):  # a refusal (over batch-jobs' max_tokens) makes a failed request
            _post(f"{sp.http_url}/v1/completions", {"prompt": "x", "max_tokens": 100000}, "sk-demo-batch")
        time.sleep(2.0)  # spans leave each process in ~0.5 s batches
        # the long prompt again: its prefix is cached now, and the explorer shows where
        return shoot(sp.http_url, out, read_console_key(state_dir / "stack"), explain_prompt=long + "Summarise it.",
                     chat=False)
    finally:
        sp.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitserve.console_shots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    ap.add_argument("--url", default=None, help="the front door (default: the local stack's, else :8000)")
    ap.add_argument("--key", default=os.environ.get("SPLITSERVE_CONSOLE_KEY"),
                    help="console key (default: the local stack's admin key, if it has one)")
    ap.add_argument("--start", action="store_true", help="start a stack of its own (two tenants, some requests)")
    ap.add_argument("--engine", default="hf", help="with --start: hf (real model, real spans) or mock")
    args = ap.parse_args(argv)
    try:
        if args.start:
            with tempfile.TemporaryDirectory(prefix="ss-console-shots-") as tmp:
                shots = demo(args.out, args.engine, Path(tmp))
        else:
            url, key = args.url, args.key
            if url is None or key is None:
                from splitserve import discovery
                from splitserve.tenancy.consolekey import read_console_key

                data = discovery.read_stack() or {}
                url = url or data.get("http_url")
                if key is None and data.get("state_dir"):
                    key = read_console_key(Path(str(data["state_dir"])))
            shots = shoot((url or "http://127.0.0.1:8000").rstrip("/"), args.out, key)
    except RuntimeError as exc:
        print(f"console_shots: {exc}", file=sys.stderr)
        return 2
    for p in shots:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
