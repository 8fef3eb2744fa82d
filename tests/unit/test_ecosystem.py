"""The field's conventions, unit by unit: vLLM-style metric names with a model_name label, the standard OTel
sampler variables, logprobs and min_tokens in sampling (hf's rules and the mock's honest distribution), the
plain-text BOS rule, hub ids from the local cache, NIXL's fallback, and the CLI (--version, exit codes,
`up --config` / SPLITSERVE_UP_* / --host)."""

from __future__ import annotations

import math
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from splitserve.engines.base import Sampling
from splitserve.engines.detok import StopChecker
from splitserve.engines.model_files import ModelNotFound, resolve_model
from splitserve.engines.sampling import sample_logprobs
from splitserve.obs.metrics import ClusterMetrics
from splitserve.proto import (
    GenerateRequest,
    Heartbeat,
    RequestFinished,
    Route,
    SamplingParams,
    Timings,
    Usage,
    WorkerLoad,
)
from splitserve.services.common.sampling import engine_sampling


def _samples(m: ClusterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition(0.0).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vllm_style_metric_names_with_model_name() -> None:
    m = ClusterMetrics()
    m.on_heartbeat(Heartbeat(worker_id="decode-0", role="decode", seq=1, model="SmolLM2",
                             load=WorkerLoad(active_seqs=2, queued_requests=1)), now=0.0)
    m.on_finished(RequestFinished(
        request_id="r1", tenant="acme", worker_id="decode-0", status="ok", route=Route.DIRECT,
        usage=Usage(prompt_tokens=100, completion_tokens=5, cached_tokens=64), finish_reason="length",
        timings=Timings(ttft_server_ms=200.0, total_ms=600.0, queue_ms=3.0, prefill_ms=150.0),
        itl_ms=[100.0, 100.0, 100.0, 100.0]), now=0.0)
    m.on_finished(RequestFinished(request_id="r2", tenant="acme", worker_id="decode-0", status="cancelled",
                                  usage=Usage(prompt_tokens=10, completion_tokens=0)), now=0.0)
    s = _samples(m)
    lab = (("model_name", "SmolLM2"),)
    assert s[("splitserve:time_to_first_token_seconds_count", lab)] == 1
    assert s[("splitserve:time_to_first_token_seconds_sum", lab)] == 0.2
    assert s[("splitserve:inter_token_latency_seconds_count", lab)] == 4
    assert s[("splitserve:request_time_per_output_token_seconds_sum", lab)] == pytest.approx(0.1)
    assert s[("splitserve:e2e_request_latency_seconds_sum", lab)] == 0.6
    assert s[("splitserve:request_queue_time_seconds_count", lab)] == 1
    assert s[("splitserve:prompt_tokens_total", lab)] == 110
    assert s[("splitserve:generation_tokens_total", lab)] == 5
    assert s[("splitserve:prefix_cache_queries_total", lab)] == 110
    assert s[("splitserve:prefix_cache_hits_total", lab)] == 64
    assert s[("splitserve:request_prompt_tokens_count", lab)] == 2
    assert s[("splitserve:request_generation_tokens_sum", lab)] == 5
    assert s[("splitserve:request_success_total", (("finished_reason", "length"), *lab))] == 1
    assert s[("splitserve:request_success_total", (("finished_reason", "abort"), *lab))] == 1
    assert s[("splitserve:num_requests_running", lab)] == 2
    assert s[("splitserve:num_requests_waiting", lab)] == 1


def test_otel_sampler_variables_and_sdk_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.obs import tracing

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    sampler = tracing._sampler()
    assert "0.25" in sampler.get_description()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert "AlwaysOff" in tracing._sampler().get_description()
    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    assert "ParentBased" in tracing._sampler().get_description()
    assert tracing.tracing_enabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.tracing_enabled()


def test_gen_ai_attributes_of_a_request() -> None:
    from splitserve.obs import tracing

    req = GenerateRequest(request_id="r1", tenant="t", messages=[{"role": "user", "content": "hi"}],
                          model="m", sampling=SamplingParams(max_tokens=7, temperature=0.5))
    a = tracing.gen_ai_of(req)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "splitserve"


# --- sampling ------------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution_and_greedy_picks_the_top() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    toks, lps = sample_logprobs(logits, [Sampling(logprobs=2), Sampling()], [10, 10])
    assert toks == [1, 0] and lps[1] is None
    lp = lps[0]
    assert lp is not None and lp.token_id == 1 and [t for t, _ in lp.top] == [1, 3]
    expected = torch.log_softmax(logits[0], -1)
    assert lp.logprob == pytest.approx(float(expected[1])) and lp.top[1][1] == pytest.approx(float(expected[3]))


def test_min_tokens_masks_eos_until_its_position() -> None:
    logits = torch.tensor([[9.0, 1.0, 0.0]])  # token 0 (EOS) is by far the most likely
    s = engine_sampling(SamplingParams(min_tokens=2, max_tokens=5, logprobs=1), prompt_tokens=10, eos_ids=[0])
    assert s.suppress_ids == (0,) and s.suppress_before == 12
    assert sample_logprobs(logits, [s], [10])[0] == [1]
    assert sample_logprobs(logits, [s], [11])[0] == [1]
    toks, lps = sample_logprobs(logits, [s], [12])
    assert toks == [0]
    # the raw distribution is reported even where EOS was masked
    _, masked = sample_logprobs(logits, [s], [10])
    assert masked[0] is not None and masked[0].top[0][0] == 0
    assert engine_sampling(SamplingParams(min_tokens=2, ignore_eos=True), 10, [0]).suppress_ids == ()


def test_stop_checker_holds_stops_until_min_tokens() -> None:
    sc = StopChecker(["x"], eos_ids=[0], max_tokens=10, min_tokens=3)
    assert sc.update(5, "ax").finish_reason is None
    assert sc.update(0, "").finish_reason is None  # EOS before min_tokens does not stop
    assert sc.update(5, "x").finish_reason == "stop"


def test_min_tokens_over_max_tokens_is_invalid() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_mock_logprobs_are_honest() -> None:
    from splitserve.engines.mock import MockEngine

    eng = MockEngine.load(step_ms=0, prefill_tokens_per_s=0)
    greedy = eng.prefill([1, 2, 3], Sampling(logprobs=3))
    assert greedy.first_logprobs is not None and greedy.first_logprobs.logprob == 0.0
    assert greedy.first_logprobs.top == ((greedy.first_token, 0.0),)  # a point mass: no alternative
    sampled = eng.prefill([1, 2, 3], Sampling(temperature=1.0, seed=1, logprobs=2))
    lp = sampled.first_logprobs
    assert lp is not None and lp.logprob == pytest.approx(-math.log(len(eng.token_range)))
    assert len(lp.top) == 2 and lp.top[0][0] == sampled.first_token
    eng.add_sequence("s", greedy.kv, greedy.first_token, Sampling(logprobs=1))
    tok = eng.step()["s"]
    assert eng.step_logprobs()["s"].token_id == tok


# --- tokenization and models ---------------------------------------------------------------------------------


def test_hub_ids_resolve_from_the_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFound, match="hf download acme/tiny"):
        resolve_model("acme/tiny")
    repo = tmp_path / "models--acme--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model("acme/tiny").directory == snap


def test_nixl_missing_falls_back_to_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.kv import transport

    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # import fails as if not installed
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    name, why = transport.usable_transport("nixl")
    assert name == "tcp" and why is not None and "splitserve[nixl]" in why
    assert transport.usable_transport("tcp") == ("tcp", None)


# --- CLI -----------------------------------------------------------------------------------------------------


def _up(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str] | None = None) -> tuple[Any, Any]:
    from splitserve import cli, stack

    seen: dict[str, Any] = {}

    def fake_run(cfg: Any, **_: Any) -> int:
        seen["cfg"] = cfg
        return 0

    monkeypatch.setattr(stack, "run_stack", fake_run)
    res = CliRunner().invoke(cli.app, ["up", *args], env={"COLUMNS": "300", **(env or {})})
    return res, seen.get("cfg")


def test_up_config_file_env_vars_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "stack.yaml"
    conf.write_text("decode: 3\nprefill-cpus: '0'\nstrategy: session\nhost: 0.0.0.0\ntransport: tcp\n")
    res, cfg = _up(monkeypatch, ["--config", str(conf)])
    assert res.exit_code == 0, res.output
    assert (cfg.decode, cfg.prefill_cpus, cfg.strategy, cfg.http_host) == (3, "0", "session", "0.0.0.0")
    # the environment beats the file, the command line beats both
    res, cfg = _up(monkeypatch, ["--config", str(conf), "--strategy", "kvaware"],
                   env={"SPLITSERVE_UP_DECODE": "2", "SPLITSERVE_UP_STRATEGY": "prefixaware"})
    assert (cfg.decode, cfg.strategy) == (2, "kvaware")
    conf.write_text("decodes: 2\n")
    res, _ = _up(monkeypatch, ["--config", str(conf)])
    assert res.exit_code == 2 and "unknown key 'decodes'" in res.output.replace("\n", " "), res.output


def test_version_and_exit_codes() -> None:
    from splitserve import cli

    res = CliRunner().invoke(cli.app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("splitserve ")
    assert CliRunner().invoke(cli.app, ["up", "--no-such-flag"]).exit_code == 2  # usage error
    res = CliRunner().invoke(cli.app, ["generate", "--nats-url", "nats://127.0.0.1:1", "hi"])
    assert res.exit_code == 1  # runtime failure: nothing listens there


def test_python_m_cli_trace_is_registered() -> None:
    import subprocess

    cp = subprocess.run([sys.executable, "-m", "splitserve.cli", "trace", "--help"], capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 0 and "waterfall" in cp.stdout, cp.stderr


def test_vllm_workers_serve_their_own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx2
    from prometheus_client import REGISTRY, Counter

    from splitserve.services.common.vllm_worker import METRICS_PORT_ENV, serve_vllm_metrics

    class Log:
        def __init__(self) -> None:
            self.warnings: list[tuple[str, dict[str, Any]]] = []

        def info(self, *a: Any, **kw: Any) -> None:
            pass

        def warning(self, event: str, **kw: Any) -> None:
            self.warnings.append((event, kw))

    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    assert serve_vllm_metrics(Log()) is None  # not asked for
    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    # stands for vLLM's PrometheusStatLogger, which registers its series in the default registry
    c = Counter("vllm:test_generation_tokens", "test", ["model_name"], registry=REGISTRY)
    try:
        c.labels("m").inc(3)
        url = serve_vllm_metrics(Log())
        assert url is not None
        assert 'vllm:test_generation_tokens_total{model_name="m"} 3.0' in httpx2.get(url).text
        # The port `splitserve up` chose is taken by the time the model has loaded (a CI run once died of it):
        # the worker serves on another port and says so; it does not exit.
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            taken = held.getsockname()[1]
            monkeypatch.setenv(METRICS_PORT_ENV, str(taken))
            log = Log()
            url2 = serve_vllm_metrics(log)
            assert url2 is not None and f":{taken}/" not in url2
            assert [e for e, _ in log.warnings] == ["vllm_metrics_port_taken"]
            assert log.warnings[0][1]["wanted"] == taken
            assert "vllm:test_generation_tokens_total" in httpx2.get(url2).text
        # A value that is no port: a warning, and the series on a free port.
        monkeypatch.setenv(METRICS_PORT_ENV, "not-a-port")
        log = Log()
        url3 = serve_vllm_metrics(log)
        assert url3 is not None and [e for e, _ in log.warnings] == ["vllm_metrics_port_invalid"]
        assert "vllm:test_generation_tokens_total" in httpx2.get(url3).text
    finally:
        REGISTRY.unregister(c)


def test_ports_picked_ahead_of_binding_avoid_the_kernels_ephemeral_range() -> None:
    """A port picked now and bound minutes later (a vLLM worker's metrics, a restarted node) must not be one
    the kernel may meanwhile hand to any bind(0) or outgoing connection."""
    from splitserve.natsserver import _ephemeral_low, free_port

    low = _ephemeral_low()
    picked = {free_port() for _ in range(50)}
    assert all(p < low for p in picked)
    assert len(picked) > 40  # random, so that two pickers rarely agree
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        assert free_port(busy) != busy  # a preferred port that is taken is not returned
    mine = free_port()
    assert free_port(mine) == mine


def test_log_pump_copies_whole_lines_across_reads(tmp_path: Path) -> None:
    """The supervisor copies what a pipe read returns in one write: a line cut between two reads, a raw line
    among JSON ones and a last line with no newline still reach the log whole, one JSON object per line."""
    import json

    from splitserve.stack import log_pump

    rec = b'{"event": "routed", "request_id": "r1"}'
    data = rec + b"\n" + b"oops raw\n" + rec + b"\n" + b'{"event": "tail"}'
    cuts = [3, 20, len(rec) + 5, len(rec) + 14, len(data) - 4, len(data)]

    class Pipe:  # a pipe whose reads return the chunks above
        def __init__(self) -> None:
            self.chunks = [data[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]

        def read1(self, n: int) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

    log = tmp_path / "svc.log"
    log_pump(Pipe(), log, "svc")  # type: ignore[arg-type]
    lines = log.read_bytes().split(b"\n")
    assert lines[-1] == b""
    objs = [json.loads(x) for x in lines[:-1]]
    assert [o["event"] for o in objs] == ["routed", "oops raw", "routed", "tail"]
    assert objs[1]["service"] == "svc" and objs[1]["logger"] == "stderr"


@given(st.lists(st.text(alphabet="ab{}\n", max_size=30), max_size=12), st.lists(st.integers(1, 40), max_size=30))
def test_log_pump_keeps_every_line_whatever_the_reads(parts: list[str], sizes: list[int]) -> None:
    """However the pipe's reads cut the output (a long line over many reads, a read that ends a line exactly),
    the log holds its lines in order, each once."""
    import json
    import tempfile

    from splitserve.stack import log_pump

    data = "".join(parts).encode()
    chunks, at = [], 0
    for n in [*sizes, len(data) + 1]:
        if at < len(data):
            chunks.append(data[at:at + n])
            at += n

    class Pipe:
        def read1(self, n: int) -> bytes:
            return chunks.pop(0) if chunks else b""

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "svc.log"
        log_pump(Pipe(), log, "svc")  # type: ignore[arg-type]
        got = [json.loads(x) for x in log.read_bytes().split(b"\n")[:-1]]
    want = data.split(b"\n")
    if want[-1] == b"":
        want.pop()
    assert len(got) == len(want)
    for obj, line in zip(got, want, strict=True):
        assert obj.get("event", obj) == line.decode() or json.loads(line) == obj


def test_raw_process_output_is_wrapped_as_json() -> None:
    import json

    from splitserve.stack import json_line

    rec = b'{"event": "ready", "level": "info"}\n'
    assert json_line(rec, "decode-0") == rec  # the services' own JSON passes untouched
    for raw in (b"nanobind: leaked 4 instances!\n", b"{not json\r\n", b"[1, 2]\n", b"\xff\xfe bytes\n"):
        obj = json.loads(json_line(raw, "decode-0"))
        assert obj["service"] == "decode-0" and obj["logger"] == "stderr" and obj["level"] == "warning"
        assert obj["event"] == raw.rstrip(b"\r\n").decode("utf-8", errors="replace")
