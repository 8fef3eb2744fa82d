"""Where the local stack lives: ``splitserve up`` records its NATS URL in a state file so that every client
command on this machine reaches it with no flags.

Resolution order for a NATS URL: explicit argument, ``$SPLITSERVE_NATS_URL``, the running stack's state
file (``$SPLITSERVE_HOME/stack.json``, default ``~/.splitserve``), then ``nats://127.0.0.1:4222``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_URL = "nats://127.0.0.1:4222"


def home() -> Path:
    return Path(os.environ.get("SPLITSERVE_HOME", Path.home() / ".splitserve"))


def stack_file() -> Path:
    return home() / "stack.json"


def write_stack(info: dict[str, Any]) -> None:
    path = stack_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)


def read_stack() -> dict[str, Any] | None:
    try:
        data = json.loads(stack_file().read_text())
    except (OSError, ValueError):
        return None
    pid = data.get("pid")
    if isinstance(pid, int) and not _alive(pid):
        return None  # stale file from a stack that died without cleaning up
    return data if isinstance(data, dict) else None


def clear_stack(pid: int) -> None:
    data = read_stack()
    if data is None or data.get("pid") == pid:
        stack_file().unlink(missing_ok=True)


def resolve_nats_url(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    env = os.environ.get("SPLITSERVE_NATS_URL")
    if env:
        return env
    data = read_stack()
    if data and data.get("nats_url"):
        return str(data["nats_url"])
    return DEFAULT_URL


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
