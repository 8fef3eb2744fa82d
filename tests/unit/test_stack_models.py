"""`splitserve up` with several model pools: a config's `models:` list becomes StackConfig.models, each pool's
workers get their model and --served-model-name, every router one --model NAME=PATH per pool. Built without
starting a process (run_stack is replaced; Stack._children only builds the argv lists)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from typer.testing import CliRunner

from splitserve.stack import ModelPool, Stack, StackConfig


def _up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str, *args: str,
        env: dict[str, str] | None = None) -> tuple[Any, StackConfig | None]:
    from splitserve import cli, stack

    seen: dict[str, Any] = {}

    def fake_run(cfg: Any, **_: Any) -> int:
        seen["cfg"] = cfg
        return 0

    monkeypatch.setattr(stack, "run_stack", fake_run)
    conf = tmp_path / "stack.yaml"
    conf.write_text(config)
    res = CliRunner().invoke(cli.app, ["up", "--config", str(conf), "--transport", "tcp", "--state-dir",
                                       str(tmp_path / "state"), *args], env={"COLUMNS": "300", **(env or {})})
    return res, seen.get("cfg")


def _children(cfg: StackConfig, cores: tuple[int, ...] = (0, 1)) -> dict[str, list[str]]:
    cfg.http_port = 0
    with mock.patch("os.sched_getaffinity", return_value=set(cores)):
        stack = Stack(cfg)
    stack.nats_url = "nats://127.0.0.1:4222"
    try:
        return {c.name: c.argv for c in stack._children()}
    finally:
        if stack.http_sock is not None:
            stack.http_sock.close()


def _all(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


TWO = """
strategy: kvaware
models:
  - name: smollm2
    prefill: 1
    decode: 2
  - name: small/20l
    model: .models/smollm2-20l
    prefill: 0
    decode: 1
"""


def test_models_list_makes_one_pool_per_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    res, cfg = _up(monkeypatch, tmp_path, TWO)
    assert res.exit_code == 0, res.output
    assert cfg is not None
    assert cfg.models == [ModelPool("smollm2", None, 1, 2), ModelPool("small/20l", ".models/smollm2-20l", 0, 1)]
    assert (cfg.prefill, cfg.decode, cfg.strategy) == (1, 3, "kvaware")  # the pools' totals
    assert "2 model(s): smollm2 (bundled): 1 prefill + 2 decode; small/20l (.models/smollm2-20l): 0 prefill + " \
           "1 decode" in res.output
    kids = _children(cfg)
    # worker ids numbered across the pools, in the config's order
    assert sorted(n for n in kids if n.startswith(("prefill", "decode"))) == [
        "decode-0", "decode-1", "decode-2", "prefill-0"]
    for name, served, model in (("prefill-0", "smollm2", []), ("decode-0", "smollm2", []),
                                ("decode-1", "smollm2", []), ("decode-2", "small/20l", [".models/smollm2-20l"])):
        assert _all(kids[name], "--served-model-name") == [served], name
        assert _all(kids[name], "--model") == model, name
        assert _all(kids[name], "--worker-id") == [name]
    # every router gets one NAME=PATH per pool, the default (first) model first
    assert _all(kids["router-0"], "--model") == ["smollm2=bundled", "small/20l=.models/smollm2-20l"]
    # the CPU pools are shared as without model pools: the 3 decoders share the decode core
    assert {_all(kids[n], "--cpus")[0] for n in ("decode-0", "decode-1", "decode-2")} == {"1"}
    assert _all(kids["prefill-0"], "--cpus") == ["0"]


def test_without_models_the_stack_is_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    res, cfg = _up(monkeypatch, tmp_path, "decode: 2\n", "--model", "/m/x.gguf")
    assert res.exit_code == 0, res.output
    assert cfg is not None and cfg.models == []
    kids = _children(cfg)
    assert sorted(n for n in kids if n.startswith(("prefill", "decode"))) == ["decode-0", "decode-1", "prefill-0"]
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert "--served-model-name" not in kids[name] and _all(kids[name], "--model") == ["/m/x.gguf"]
    assert _all(kids["router-0"], "--model") == ["/m/x.gguf"]
    kids = _children(StackConfig(state_dir=tmp_path))
    assert "--model" not in kids["router-0"] and "--model" not in kids["decode-0"]
    assert "model(s)" not in res.output


def test_the_models_list_wins_over_the_pool_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    res, cfg = _up(monkeypatch, tmp_path, TWO, "--decode", "5", "--model", "/elsewhere")
    assert res.exit_code == 0, res.output
    assert cfg is not None and (cfg.prefill, cfg.decode) == (1, 3)
    assert "--model, --decode ignored" in res.output
    assert "/elsewhere" not in str(_children(cfg))
    # --colocated: no prefill pool for any model
    res, cfg = _up(monkeypatch, tmp_path, TWO, "--colocated")
    assert cfg is not None and cfg.prefill == 0 and [p.prefill for p in cfg.models] == [0, 0]
    assert not [n for n in _children(cfg) if n.startswith("prefill")]


def test_a_pool_may_route_with_its_own_strategy_and_threshold(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    cfg_text = ("strategy: roundrobin\ndisagg-threshold: 512\nmodels:\n"
                "  - {name: smollm2, decode: 2, strategy: kvaware}\n"
                "  - {name: big, model: /x, disagg-threshold: 64}\n")
    res, cfg = _up(monkeypatch, tmp_path, cfg_text)
    assert res.exit_code == 0, res.output
    assert cfg is not None
    router = _children(cfg)["router-0"]
    assert _all(router, "--strategy") == ["roundrobin"] and _all(router, "--disagg-threshold") == ["512"]
    assert _all(router, "--model-strategy") == ["smollm2=kvaware"]
    assert _all(router, "--model-disagg-threshold") == ["big=64"]
    res, cfg = _up(monkeypatch, tmp_path, cfg_text, "--colocated")  # colocated: nothing is disaggregated
    assert cfg is not None and "--model-disagg-threshold" not in _children(cfg)["router-0"]


def test_long_context_decoders_serve_the_default_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    res, cfg = _up(monkeypatch, tmp_path, TWO + "long-decode: 1\n")
    assert res.exit_code == 0, res.output
    assert cfg is not None
    long = _children(cfg)["decode-long-0"]
    assert _all(long, "--served-model-name") == ["smollm2"] and "--model" not in long


@pytest.mark.parametrize(("models", "message"), [
    ("  - {name: a}\n  - {name: a, decode: 2}\n", "'a' is listed twice"),
    ("  - {name: a, strategy: fastest}\n", "unknown routing strategy 'fastest'"),
    ("  - {name: a, disagg-threshold: -1}\n", "disagg_threshold must be a whole number >= 0"),
    ("  - {name: a, disagg-threshold: '10'}\n", "disagg_threshold must be a whole number >= 0"),
    ("  - {name: a, decoders: 2}\n", "unknown key 'decoders'"),
    ("  - {model: /x}\n", "models[0] needs a name"),
    ("  - {name: ''}\n", "non-empty name"),
    ("  - {name: 'a=b'}\n", "holds '='"),
    ("  - {name: ' a'}\n", "starts or ends with white space"),
    (f"  - {{name: {'n' * 257}}}\n", "longer than 256"),
    ("  - {name: a, decode: 0}\n", "decode must be a whole number >= 1"),
    ("  - {name: a, prefill: -1}\n", "prefill must be a whole number >= 0"),
    ("  - {name: 12}\n", "name must be a string"),
    ("  - just-a-name\n", "models[0] must be a mapping"),
])
def test_bad_models_lists_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, models: str,
                                      message: str) -> None:
    res, cfg = _up(monkeypatch, tmp_path, "models:\n" + models)
    assert res.exit_code == 2 and cfg is None, res.output
    assert message in " ".join(res.output.split()), res.output
    res, _ = _up(monkeypatch, tmp_path, "models: []\n")
    assert res.exit_code == 2 and "non-empty list" in " ".join(res.output.split()), res.output


def test_stack_config_checks_its_pools(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="listed twice"):
        StackConfig(state_dir=tmp_path, models=[ModelPool("a"), ModelPool("a")])
    cfg = StackConfig(state_dir=tmp_path, models=[ModelPool("a", "/x", 2, 1), ModelPool("b", None, 0, 3)])
    assert (cfg.prefill, cfg.decode) == (2, 4)
    assert cfg.router_models() == ["a=/x", "b=bundled"]
