"""What a process that never touches KV tensors imports: the supervisor (``splitserve up``) asks which KV transport
is usable and starts the services; importing torch for that cost every stack start about 1.2 CPU-s (and its
services started that much later)."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_supervisors_imports_leave_torch_out() -> None:
    code = ("import sys\nimport splitserve.cli, splitserve.stack\n"
            "from splitserve.kv.transport import usable_transport, TRANSPORTS\n"
            "print([usable_transport(t)[0] for t in TRANSPORTS], 'torch' in sys.modules)")
    assert _run(code).endswith("] False")


def test_the_kv_package_still_exports_its_names_on_first_use() -> None:
    code = ("import sys\nimport splitserve.kv as kv\nassert 'torch' not in sys.modules\n"
            "from splitserve.kv import BlockPool, SMOLLM2_135M\n"
            "print(BlockPool.__module__, SMOLLM2_135M.num_layers, all(getattr(kv, n) is not None for n in kv.__all__))")
    assert _run(code) == "splitserve.kv.pool 30 True"
