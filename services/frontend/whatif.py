"""The console's what-if panel: ``splitserve sim what-if`` run for an operator from ``POST /console/api/whatif``.

The front door does not simulate in its own process: a simulation is seconds to a minute of pure-Python CPU, and
the event loop serves every tenant's streams. :class:`WhatIfRunner` runs the CLI as a child process
(``python -m splitserve.cli sim what-if ... --json``, the interpreter the front door runs under) through asyncio's
subprocess support, so the loop only waits on pipes, with a wall-clock bound (killed past it: 504), and at most
one run at a time per front door (a second gets 429 with ``Retry-After``: two simulations would share the CPU
with the front door and each other).

What the caller gives and what it cannot:

* the **change** is the change file's text (YAML or JSON, at most :data:`MAX_CHANGE_BYTES`), written to a private
  temporary folder (0700, the file 0600) and removed after the run;
* the **trace** is a *name* from an allow-list: the ``.jsonl``/``.csv`` files in one folder (the project's shared
  data ``traces/`` folder the simulator and the README use, or ``--whatif-traces DIR``). A path, or a name not in
  the folder, is refused; the folder is read at each call, so a file dropped in is offered without a restart;
* the **tenants** are the front door's own (``--tenants``), never the caller's. The child gets a copy *without
  credentials* (no ``password``, ``nkey`` or ``api_keys``: the simulation needs none), so nothing it prints can
  echo one; and every answer is still scrubbed of the tenants' secrets (a second wall: the check is cheap);
* the pools (``prefill``, ``decode``: the CLI's ``--prefill``/``--decode``, the current cluster the trace is
  replayed on) are optional integers.

Exit codes map to HTTP: 0 (accepted) and 3 (refused) are 200 with the CLI's JSON and ``accepted``; 2 (a bad
change file or flag) is 400 with the CLI's own message (the temporary paths taken out); past the timeout 504;
anything else 500 with a short message (the child's stderr goes to the log, never to the caller).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.obs.log import LIST_SECRET_ENV, SECRET_ENV, SEED_ENV, get_logger
from splitserve.tenancy.config import TenantsConfig

log = get_logger("frontend.whatif")

WHATIF_TIMEOUT_S = 120.0  # the README's Mooncake examples (8P:8D) take ~30 s of CPU; the Azure traces are bigger
MAX_CHANGE_BYTES = 64 * 1024  # a change file is a few lines; this bounds what lands on the front door's disk
TRACE_SUFFIXES = (".jsonl", ".csv")
MAX_MESSAGE_CHARS = 2000  # of a CLI error message passed on (a YAML error quotes lines; that is enough)
MAX_POOL = 1024  # simulated workers per pool: beyond is a typo, and a very long simulation
# A trace name as the listing gives it: a file name, no folder part, no leading dot.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # fullmatch only ("$" would take a trailing newline)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
REDACTED = "[REDACTED]"

# The change the panel starts with when the checkout's deploy/whatif examples are not beside the package.
BUILTIN_EXAMPLE = """\
# A new tenant at a quarter of the trace's request rate, with a 30 s p99 TTFT target (see the README,
# "Capacity planning (simulator)": add_tenant, set_tenant, pools, traffic).
add_tenant:
  name: newcomer
  spec: {weight: 1, slo: {ttft_p99_ms: 30000}}
  share: 0.25
"""


def default_traces_dir() -> Path:
    """The simulator's own trace folder (``$SPLITSERVE_SHARED_DATA/traces``, else ``../shared/data/traces`` beside
    the checkout): the one the what-if tests and the README use."""
    # Computed as splitserve.sim.workload computes it, not imported from there: that would load the whole simulator
    # into the front door (a test keeps the two equal).
    import splitserve

    env = os.environ.get("SPLITSERVE_SHARED_DATA")
    data = Path(env) if env else Path(splitserve.__file__).resolve().parents[2] / "shared" / "data"
    return data / "traces"


def examples_dir() -> Path:
    """``deploy/whatif`` of the checkout this front door runs from (absent in an installed wheel)."""
    return Path(__file__).resolve().parents[2] / "deploy" / "whatif"


class WhatIfRefused(Exception):
    """An answer other than the verdict: the HTTP status, a message for the caller, and headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def _secrets(tenants: TenantsConfig | None) -> list[str]:
    if tenants is None:
        return []
    out: set[str] = set()
    for spec in tenants.tenants.values():
        out.update(spec.api_keys)
        out.update(v for v in (spec.password, spec.nkey) if v)
    # Longest first: a key that contains another is masked whole.
    return sorted((s for s in out if s), key=len, reverse=True)


def sanitized_tenants(tenants: TenantsConfig) -> dict[str, Any]:
    """The tenants file as the front door loaded it, less every credential (what the child process gets)."""
    raw: dict[str, Any] = tenants.model_dump(mode="json", exclude_unset=True)
    raw.pop("open", None)
    for spec in (raw.get("tenants") or {}).values():
        for k in ("password", "nkey", "api_keys"):
            spec.pop(k, None)
    return raw


@dataclass
class WhatIfRunner:
    """Runs the what-if CLI for the console (see the module docstring). ``tenants`` None: the front door was
    started without ``--tenants`` and every run is refused with 409."""

    tenants: TenantsConfig | None
    traces_dir: Path | None = None  # None: :func:`default_traces_dir`
    timeout_s: float = WHATIF_TIMEOUT_S
    examples: Path | None = None  # None: :func:`examples_dir`
    # The CLI, with the interpreter this front door runs under (its venv; no ``splitserve`` on PATH needed).
    command: tuple[str, ...] = (sys.executable, "-m", "splitserve.cli")
    _running_since: float | None = field(default=None, init=False, repr=False)
    _secrets: list[str] = field(default_factory=list, init=False, repr=False)
    _tenants_json: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._secrets = _secrets(self.tenants)
        self._tenants_json = None if self.tenants is None else json.dumps(sanitized_tenants(self.tenants))

    # --- what the panel offers ------------------------------------------------------------------------
    def folder(self) -> Path:
        return self.traces_dir if self.traces_dir is not None else default_traces_dir()

    def traces(self) -> dict[str, Path]:
        """The allow-list: file name -> path, for the regular trace files in the folder (none if it is absent)."""
        out: dict[str, Path] = {}
        try:
            entries = sorted(os.scandir(self.folder()), key=lambda e: e.name)
        except OSError:
            return out
        for e in entries:
            with contextlib.suppress(OSError):
                if _NAME.fullmatch(e.name) and e.name.endswith(TRACE_SUFFIXES) and e.is_file():
                    out[e.name] = Path(e.path)
        return out

    def example_changes(self) -> list[dict[str, str]]:
        """The change files of deploy/whatif (not its tenants file), else one built in."""
        d = self.examples if self.examples is not None else examples_dir()
        out = []
        with contextlib.suppress(OSError):
            for p in sorted(d.glob("*.yaml")):
                if p.name == "tenants.yaml" or not p.is_file():
                    continue
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    text = p.read_text()
                    if len(text.encode()) <= MAX_CHANGE_BYTES:
                        out.append({"name": p.name, "text": text})
        # The one that shows a refusal first: the panel's prefilled change (the README's first example).
        out.sort(key=lambda e: (e["name"] != "add-analytics.yaml", e["name"]))
        return out or [{"name": "builtin", "text": BUILTIN_EXAMPLE}]

    def describe(self) -> dict[str, Any]:
        """``GET /console/api/whatif/traces``: the traces to pick from, example changes, and the limits."""
        from splitserve.sim.workload import TRACE_FILES

        aliases = {file: name for name, file in TRACE_FILES.items()}
        traces = []
        for name, path in self.traces().items():
            size: int | None = None
            with contextlib.suppress(OSError):
                size = path.stat().st_size
            traces.append({"name": name, "alias": aliases.get(name), "bytes": size})
        return {"traces": traces, "examples": self.example_changes(),
                "tenants_file": self.tenants is not None,
                "tenants": list(self.tenants.tenants) if self.tenants is not None else [],
                "timeout_s": self.timeout_s, "max_change_bytes": MAX_CHANGE_BYTES,
                "running": self._running_since is not None}

    # --- a run ----------------------------------------------------------------------------------------
    def resolve_trace(self, name: str) -> Path:
        if not _NAME.fullmatch(name) or ".." in name:
            # Never a path: the caller names one of the listed files, the front door decides where it is.
            raise WhatIfRefused(400, "trace must be the name of one of the listed traces (GET "
                                     "/console/api/whatif/traces), not a path")
        found = self.traces().get(name)
        if found is None:
            raise WhatIfRefused(404, f"no trace named {name!r} on this front door (GET /console/api/whatif/traces "
                                     "lists them)")
        return found

    def scrub(self, text: str) -> str:
        """``text`` with every credential of the tenants file masked."""
        for s in self._secrets:
            text = text.replace(s, REDACTED)
        return text

    def scrub_json(self, value: Any) -> Any:
        """Every string of a parsed JSON value (keys too) scrubbed: masked after parsing, not in the printed text,
        so that no key, however short or oddly spelled, can break the JSON."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, list):
            return [self.scrub_json(v) for v in value]
        if isinstance(value, dict):
            return {self.scrub(str(k)): self.scrub_json(v) for k, v in value.items()}
        return value

    def _retry_after(self) -> str:
        since = self._running_since or time.monotonic()
        left = self.timeout_s - (time.monotonic() - since)
        return str(max(1, math.ceil(left)))

    async def run(self, change: str, trace: str, *, prefill: int | None = None,
                  decode: int | None = None) -> dict[str, Any]:
        """The verdict (the CLI's JSON, with ``accepted``), or :class:`WhatIfRefused` for every other answer."""
        if len(change.encode("utf-8", "surrogatepass")) > MAX_CHANGE_BYTES:
            raise WhatIfRefused(413, f"the change is over {MAX_CHANGE_BYTES // 1024} KiB")
        if self.tenants is None or self._tenants_json is None:
            raise WhatIfRefused(409, "this front door was started without --tenants: the what-if needs the current "
                                     "tenants file (restart it with --tenants FILE, as `splitserve up --tenants` does)")
        path = self.resolve_trace(trace)
        if self._running_since is not None:
            # Checked and set with no await between: one event loop, so no second run slips in.
            raise WhatIfRefused(429, "a what-if is already running on this front door: one at a time",
                                {"Retry-After": self._retry_after()})
        self._running_since = time.monotonic()
        try:
            return await self._run(change, path, prefill, decode)
        finally:
            self._running_since = None

    async def _run(self, change: str, trace: Path, prefill: int | None, decode: int | None) -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="splitserve-whatif-")  # 0700: only this user reads the change
        try:
            change_file = os.path.join(tmp, "change.yaml")
            tenants_file = os.path.join(tmp, "tenants.yaml")
            for p, text in ((change_file, change), (tenants_file, self._tenants_json or "")):
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
                    f.write(text)
            argv = [*self.command, "sim", "what-if", "--tenants", tenants_file,
                    "--change", change_file, "--trace", str(trace), "--json"]
            if prefill is not None:
                argv += ["--prefill", str(prefill)]
            if decode is not None:
                argv += ["--decode", str(decode)]
            t0 = time.monotonic()
            rc, out, err = await self._exec(argv)
            wall_s = round(time.monotonic() - t0, 2)
            # The caller's view of the paths: the files by their role, the trace by its listed name.
            err = err.replace(tmp + os.sep, "").replace(str(trace), trace.name)
            log.info("whatif_run", trace=trace.name, exit_code=rc, wall_s=wall_s, prefill=prefill, decode=decode)
            return self._answer(rc, out, err, wall_s, trace.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _env(self) -> dict[str, str]:
        # The child needs no credential of the front door's (NATS password, admin keys): it is not handed them.
        drop = {*SECRET_ENV, *LIST_SECRET_ENV, SEED_ENV}
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")  # plain text for the messages passed on
        return env

    async def _exec(self, argv: list[str]) -> tuple[int | None, str, str]:
        """Exit code (None: killed past the timeout), stdout and stderr (scrubbed)."""
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env=self._env(), start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            return None, "", ""
        finally:
            if proc.returncode is None:  # past the timeout, or the request was cancelled: never left running
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the whole group, children included
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 10.0)
        # stdout is scrubbed once parsed (scrub_json); stderr, text only, here
        return proc.returncode, out.decode(errors="replace"), self.scrub(err.decode(errors="replace"))

    def _answer(self, rc: int | None, out: str, err: str, wall_s: float, trace: str) -> dict[str, Any]:
        if rc is None:
            raise WhatIfRefused(504, f"the what-if did not finish within {self.timeout_s:g} s (a smaller trace, "
                                     "or a longer --whatif-timeout-s on the front door)")
        if rc in (0, 3):
            try:
                verdict = json.loads(out)
                if not isinstance(verdict, dict):
                    raise ValueError("not an object")
            except ValueError:
                log.error("whatif_bad_output", exit_code=rc, stdout=self.scrub(out[-2000:]), stderr=err[-2000:])
                raise WhatIfRefused(500, "the what-if printed no verdict (see the front door's log)") from None
            verdict = self.scrub_json(verdict)
            return {**verdict, "accepted": rc == 0, "exit_code": rc, "trace": trace, "wall_s": wall_s}
        if rc == 2:
            raise WhatIfRefused(400, _message(err) or "the what-if refused the change (exit 2)")
        log.error("whatif_failed", exit_code=rc, stderr=err[-4000:])
        raise WhatIfRefused(500, f"the what-if failed (exit {rc}); the front door's log has its output")


def _message(err: str) -> str:
    """The CLI's error message: its ``error: ...`` lines, else its last non-empty lines, as plain text."""
    lines = [ln.rstrip() for ln in _ANSI.sub("", err).splitlines() if ln.strip()]
    first = next((i for i, ln in enumerate(lines) if ln.startswith("error: ")), None)
    # From the first ``error:`` line on: a YAML error goes on over the next lines (where in the file).
    picked: Iterable[str] = lines[-5:] if first is None else [lines[first].removeprefix("error: "), *lines[first + 1:]]
    text = "\n".join(picked)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"
