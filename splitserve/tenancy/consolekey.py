"""The web console's admin key for a stack started with ``splitserve up --tenants``.

Generated once into ``<state-dir>/auth/console-admin.key`` (mode 0600, like the NATS service secrets, and
reused across restarts so an open console keeps working), handed to the front door in its environment
(``SPLITSERVE_CONSOLE_ADMIN_KEYS``), never on a command line or in ``~/.splitserve/stack.json``.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from splitserve.tenancy.natsauth import AUTH_DIR, write_private

ADMIN_KEYS_ENV = "SPLITSERVE_CONSOLE_ADMIN_KEYS"  # comma-separated admin keys the front door accepts
KEY_FILE = "console-admin.key"


def key_path(state_dir: Path) -> Path:
    return state_dir / AUTH_DIR / KEY_FILE


def read_console_key(state_dir: Path) -> str | None:
    try:
        key = key_path(state_dir).read_text().strip()
    except OSError:
        return None
    return key or None


def ensure_console_key(state_dir: Path) -> str:
    key = read_console_key(state_dir)
    if key is None:
        key = "ssadm-" + secrets.token_urlsafe(32)
        write_private(key_path(state_dir), key + "\n")
    return key
