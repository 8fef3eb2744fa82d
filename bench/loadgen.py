"""Run a standard load generator (GuideLLM) against the OpenAI-compatible front door and print its summary.

GuideLLM is not a project dependency: it lives in its own virtual environment (``--venv``, default
``/tmp/lg-venv``), created on first use with pinned versions, so its pins (it pulls its own torch and
transformers) never touch the project's ``.venv``. It builds synthetic prompts with a tokenizer; nothing can
be downloaded from a model hub here, so the bundled model's tokenizer is exported to a folder with
``transformers`` (from the GGUF) and passed as ``--tokenizer kind=huggingface_auto,model=DIR`` with
``HF_HUB_OFFLINE=1``.

Notes on the front door as GuideLLM sees it:

* GuideLLM validates a backend with ``GET /health`` (vLLM's path); the front door serves ``/healthz``, so
  validation is switched off (``validate_backend=false``) — otherwise the run stops with a 404;
* the default request format is ``/v1/chat/completions``: the chat template adds ~30 tokens to each
  synthetic prompt (``--prompt-tokens 192`` is counted as 222 input tokens by the server); pass
  ``--request-format /v1/completions`` for bare prompts.

    python -m bench.loadgen [--http-url http://127.0.0.1:8000] [--rates 0.5,1.5] [--duration 45]
        [--prompt-tokens 192] [--output-tokens 24] [--profile constant|poisson|sweep|concurrent]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

GUIDELLM_PIN = "guidellm==0.8.1"


def ensure_venv(venv: Path) -> Path:
    """The load generator's own venv (created, and GuideLLM installed, if missing); returns its CLI."""
    exe = venv / "bin" / "guidellm"
    if exe.is_file():
        return exe
    # Not sys.executable's venv: a fresh interpreter-level venv (the base python behind .venv).
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GUIDELLM_PIN], check=True)
    return exe


def export_tokenizer(out: Path) -> Path:
    """Save the bundled model's tokenizer (read from its GGUF) as a Hugging Face tokenizer folder."""
    if (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoTokenizer

    from splitserve.engines.model_files import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out


def served_model(http_url: str) -> str:
    with urllib.request.urlopen(http_url.rstrip("/") + "/v1/models", timeout=30) as r:
        return str(json.load(r)["data"][0]["id"])


def guidellm_command(exe: Path, http_url: str, model: str, tokenizer: Path, args: argparse.Namespace,
                     out_json: Path) -> list[str]:
    backend = f"kind=openai_http,target={http_url.rstrip('/')},model={model},validate_backend=false," \
              f"request_format={args.request_format}"
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    cmd = [str(exe), "run", "--backend", backend, "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--data", data, "--constraint", f"kind=max_duration,seconds={args.duration}",
           "--output", f"kind=json,path={out_json}", "--disable-progress"]
    rates = args.rates.split(",")
    if args.profile in ("constant", "poisson"):
        cmd += ["--profile", f"kind={args.profile},rate={rates[0]}"]
        if len(rates) > 1:
            cmd += ["--override", "profile.rate", args.rates]
    elif args.profile == "concurrent":
        cmd += ["--profile", f"kind=concurrent,streams={rates[0]}"]
        if len(rates) > 1:
            cmd += ["--override", "profile.streams", args.rates]
    else:  # sweep: synchronous, throughput, then sweep_size-2 rates in between
        cmd += ["--profile", f"kind=sweep,sweep_size={args.sweep_size}"]
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--http-url", default=None, help="a running front door (no /v1); default: start a stack")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/lg-venv"), help="the load generator's own venv")
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(tempfile.gettempdir()) / "splitserve-tokenizer")
    ap.add_argument("--profile", choices=("constant", "poisson", "concurrent", "sweep"), default="constant")
    ap.add_argument("--rates", default="0.5,1.5", help="req/s (constant/poisson) or streams (concurrent)")
    ap.add_argument("--sweep-size", type=int, default=4)
    ap.add_argument("--duration", type=float, default=45.0, help="seconds per rate point")
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--request-format", choices=("/v1/chat/completions", "/v1/completions"),
                    default="/v1/chat/completions")
    ap.add_argument("--out", type=Path, default=None, help="GuideLLM's JSON report (default: a temp file)")
    args = ap.parse_args(argv)

    exe = ensure_venv(args.venv)
    tokenizer = export_tokenizer(args.tokenizer_dir)
    out_json = args.out or Path(tempfile.mkdtemp(prefix="bench-loadgen-")) / "guidellm.json"

    stack = None
    http_url = args.http_url
    if http_url is None:
        from splitserve.stackproc import start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="bench-loadgen-stack-")), "--http-port", "0")
        http_url = stack.http_url
        assert http_url, "the stack printed no OpenAI API URL"
    try:
        model = served_model(http_url)
        cmd = guidellm_command(exe, http_url, model, tokenizer, args, out_json)
        print("+ " + " ".join(cmd), flush=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        rc = subprocess.run(cmd, env=env).returncode
    finally:
        if stack is not None:
            stack.stop()
    print(f"GuideLLM exit {rc}; JSON report: {out_json}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
