"""Where the local stack lives: ``splitserve up`` records its NATS URL in a state file so that every client
command on this machine reaches it with no flags.

A "NATS URL" may name several servers of one cluster, comma-separated (``nats://a:4222,nats://b:4222``):
every connection takes the list (:func:`server_list`) and fails over between them.

Resolution order for a NATS URL: explicit argument, ``$SPLITSERVE_NATS_URL``, the running stack's state
file (``$SPLITSERVE_HOME/stack.json``, default ``~/.splitserve``), then ``nats://127.0.0.1:4222``.

The state file holds no secret. A stack started with a tenants file keeps its operator (``admin``)
credentials under its state directory, readable by its owner only: :func:`admin_credentials` finds them for
the CLI's operator commands, and only for that stack's own URL (never sent to another server).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_URL = "nats://127.0.0.1:4222"


def server_list(url: str) -> list[str]:
    """The servers of a (possibly comma-separated) NATS URL, in order, without duplicates: what nats-py's
    ``connect(servers=...)`` takes."""
    out: list[str] = []
    for part in url.replace(" ", ",").split(","):
        part = part.strip()
        if part and part not in out:
            out.append(part)
    if not out:
        raise ValueError(f"no NATS server in {url!r}")
    return out


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


def admin_credentials(url: str) -> tuple[str, str] | None:
    """The operator credentials for ``url``: ``$SPLITSERVE_NATS_USER``/``_PASSWORD`` when set, else the
    local stack's admin user when ``url`` is that stack's, else None (an open server)."""
    from splitserve.tenancy import natsauth

    user = os.environ.get(natsauth.ENV_USER)
    if user:
        return user, os.environ.get(natsauth.ENV_PASSWORD, "")
    data = read_stack()
    if not data or data.get("nats_url") != url or not data.get("state_dir"):
        return None
    return natsauth.read_admin_credentials(Path(str(data["state_dir"])))
