"""``splitserve sim run|plan`` (the real typer app), the planner, plots, and the DistServe smoke check."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.sim import SimConfig, SimRequest, load_sharegpt, simulate
from splitserve.sim.latency import StepFit
from splitserve.sim.planner import plan

runner = CliRunner()


def test_sim_run_json() -> None:
    r = runner.invoke(app, ["sim", "run", "--trace", "azure-conv", "--limit", "200", "--prefill", "1", "--decode", "2",
                            "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["finished"] == 200 and out["requests"] == 200
    assert out["ttft_s"]["p50"] > 0 and out["itl_s"]["n"] > 0
    assert set(out["routes"]) <= {"direct", "disaggregated"}
    assert out["config"]["strategy"] == "kvaware"


def test_sim_run_bad_input_is_a_clear_error() -> None:
    r = runner.invoke(app, ["sim", "run", "--trace", "no-such-trace"])
    assert r.exit_code == 2 and "unknown trace 'no-such-trace'" in r.output
    r = runner.invoke(app, ["sim", "run", "--trace", "/nonexistent/t.csv"])
    assert r.exit_code == 2 and "no trace '/nonexistent/t.csv'" in r.output
    r = runner.invoke(app, ["sim", "run", "--latency", "splitwise:llama2-70b:h100:tp3", "--limit", "5"])
    assert r.exit_code == 2 and "TP 3" in r.output
    r = runner.invoke(app, ["sim", "run", "--strategy", "random", "--limit", "5"])
    assert r.exit_code == 2 and "unknown strategy" in r.output


@pytest.mark.slow  # matplotlib's import and three simulations: ~10 s here
def test_sim_run_plots(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("matplotlib (the sim extra) is not installed")
    r = runner.invoke(app, ["sim", "run", "--trace", "azure-code", "--limit", "150", "--decode", "2",
                            "--rates", "1,4", "--plots", str(tmp_path)])
    assert r.exit_code == 0, r.output
    for name in ("latency_cdf.png", "utilisation.png", "goodput_vs_rate.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "goodput vs rate" in r.output


def test_planner_finds_the_cheapest_size_meeting_the_slo() -> None:
    fit = StepFit("t", (5.0, 0.05, 0.0), (10.0, 0.0, 0.5))
    base = SimConfig(model="llama-3.1-8b", prefill_latency=fit, gpus_per_prefill=1, gpus_per_decode=1, fabric="nvlink",
                     ttft_slo_s=0.5, tpot_slo_s=0.05, max_seqs=32)
    reqs = [SimRequest(f"r{i}", i * 0.02, 400 + (i * 37) % 600, 40) for i in range(300)]
    p = plan(base, reqs, sizes=range(1, 7), strategies=["kvaware", "roundrobin"], thresholds=[512])
    assert p.best is not None
    smaller = [r for r in p.rows if r["gpus"] < p.best["gpus"]]
    assert smaller and not any(r["met"] for r in smaller)  # everything cheaper was tried and failed
    assert simulate(dataclasses.replace(base, prefill=p.best["prefill"], decode=p.best["decode"],
                                        strategy=p.best["strategy"]), reqs).meets_slo


def test_sim_plan_cli_reports_no_fit_with_exit_1() -> None:
    r = runner.invoke(app, ["sim", "plan", "--trace", "azure-conv", "--limit", "100", "--rate-factor", "50",
                            "--sizes", "1-2", "--ttft-slo", "0.001"])
    assert r.exit_code == 1, r.output
    assert "no configuration in the sweep meets the SLO" in r.output


def test_distserve_published_config_smoke() -> None:
    """bench.sim_distserve in small: DistServe's fits and modelling, ShareGPT lengths, prefill TP2 + decode TP1.
    With DistServe's current simulator (decoders at their own TP) this config's per-GPU rate is ~0.94-1.1 req/s
    here (the decoder's P90 TPOT binds): 0.6 passes and 1.5 fails. With the simulator the README's 1.56 came from
    (decoders at the prefill's TP) it is ~2.2 here: 1.5 passes."""
    from dataclasses import replace

    from bench.sim_distserve import DISTSERVE, attains

    assert attains(2, 1, 0.6, n=300, seeds=2)
    assert not attains(2, 1, 1.5, n=300, seeds=2)
    assert attains(2, 1, 1.5, n=300, seeds=2, m=replace(DISTSERVE, readme_era=True))
    reqs = load_sharegpt(limit=50, rate=2.0, max_total_tokens=2048)
    assert all(r.prompt_tokens + r.output_tokens <= 2048 for r in reqs)
