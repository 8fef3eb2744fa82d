"""The vLLM KV-event bridge: vLLM's own msgpack events -> splitserve's events keyed by the router's hashes."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.cache.hashing import hash_token_blocks
from splitserve.services.common.vllm_kv import VllmKvBridge
from tests.vllm.conftest import needs_vllm

pytestmark = needs_vllm


def _bridge() -> VllmKvBridge:
    return VllmKvBridge(bus=None, worker_id="w", endpoint="tcp://127.0.0.1:1",  # type: ignore[arg-type]
                        replay_endpoint=None, engine_block_size=32, route_block_size=16)


def _roundtrip(events: list[Any]) -> list[Any]:
    """Through vLLM's own wire encoding, as the ZMQ publisher sends it."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    data = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    return list(msgspec.msgpack.decode(data, type=KVEventBatch).events)


def test_stored_blocks_are_rekeyed_to_router_hashes_and_removals_map_back() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    tokens = list(range(100, 196))  # 96 tokens = 3 vLLM blocks of 32 = 6 router blocks of 16
    b = _bridge()
    first = BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=tokens[:64], block_size=32,
                        lora_id=None, medium="GPU", lora_name=None)
    second = BlockStored(block_hashes=[b"h3"], parent_block_hash=b"h2", token_ids=tokens[64:96], block_size=32,
                         lora_id=None, medium="GPU", lora_name=None)
    out = b.translate(_roundtrip([first, second]))
    expected = hash_token_blocks(tokens, 16)
    assert [e["type"] for e in out] == ["stored", "stored"]
    assert out[0]["block_hashes"] + out[1]["block_hashes"] == expected  # exactly what the router computes
    assert out[1]["parent_block_hash"] == expected[3] and out[0]["medium"] == "gpu"
    assert b.num_blocks() == 3 and sorted(b.held()["gpu"]) == sorted(expected)

    out = b.translate(_roundtrip([BlockRemoved(block_hashes=[b"h3"], medium="GPU")]))
    assert out == [{"type": "removed", "block_hashes": expected[4:6], "medium": "gpu"}]
    out = b.translate(_roundtrip([AllBlocksCleared()]))
    assert out == [{"type": "cleared", "medium": None}] and b.num_blocks() == 0


def test_unknown_parent_and_block_size_mismatch() -> None:
    from vllm.distributed.kv_events import BlockStored

    b = _bridge()
    orphan = BlockStored(block_hashes=[b"x"], parent_block_hash=b"never-seen", token_ids=list(range(32)),
                         block_size=32, lora_id=None, medium="GPU", lora_name=None)
    assert b.translate([orphan]) == []  # cannot be re-keyed without the chain's start: skipped, not guessed
    with pytest.raises(ValueError, match="multiple"):
        VllmKvBridge(None, "w", "tcp://x:1", None, engine_block_size=24, route_block_size=16)  # type: ignore[arg-type]


def test_a_salted_chain_is_rooted_at_its_salt() -> None:
    """vLLM publishes a request's ``cache_salt`` in its first block's extra keys; the bridge roots the re-keyed
    chain there, so the router's index matches the prompt only under the same tenant's salt."""
    from vllm.distributed.kv_events import BlockStored

    tokens = list(range(300, 364))  # 2 vLLM blocks of 32
    b = _bridge()
    salted = BlockStored(block_hashes=[b"s1"], parent_block_hash=None, token_ids=tokens[:32], block_size=32,
                         lora_id=None, medium="GPU", lora_name=None, extra_keys=[("t:A",)])
    child = BlockStored(block_hashes=[b"s2"], parent_block_hash=b"s1", token_ids=tokens[32:], block_size=32,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None])
    out = b.translate(_roundtrip([salted, child]))
    expected = hash_token_blocks(tokens, 16, cache_salt="t:A")
    assert out[0]["block_hashes"] + out[1]["block_hashes"] == expected
    assert expected != hash_token_blocks(tokens, 16)  # not the unsalted chain another tenant would look up
    # with a LoRA, its name comes first among the extra keys: the salt is the string after it
    lora = BlockStored(block_hashes=[b"l1"], parent_block_hash=None, token_ids=tokens[:32], block_size=32,
                       lora_id=1, medium="GPU", lora_name="adapter", extra_keys=[("adapter", "t:B")])
    out = b.translate(_roundtrip([lora]))
    assert out[0]["block_hashes"] == hash_token_blocks(tokens[:32], 16, cache_salt="t:B")
