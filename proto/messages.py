"""Versioned message models for every subject in ``proto.subjects``.

Every model carries ``v`` (the schema version it was written with) and a ``kind`` literal naming its type,
so a receiver can tell a wrong-version message from a malformed one and answer precisely. Fields that
carry token ids use :data:`proto.tokens.TokenIds` (packed uint32), so a 128k-token prompt stays compact.

Compatibility rule: within one major ``v``, fields are only ever added with defaults; a receiver ignores
fields it does not know (``extra="ignore"``) and rejects a ``v`` it does not speak.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from splitserve.proto.quoting import quoted
from splitserve.proto.subjects import check_token, reply_subjects, request_key
from splitserve.proto.tokens import TokenIds

PROTO_VERSION = 1

__all__ = [
    "PROTO_VERSION",
    "MAX_STOP_CHARS",
    "Accepted",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheQuery",
    "CacheQueryReply",
    "CancelRequest",
    "ChatMessage",
    "DecodeJob",
    "ErrorCode",
    "ErrorMessage",
    "GenerateRequest",
    "Heartbeat",
    "KvEvent",
    "KvEventBatch",
    "KvHandle",
    "KvHeld",
    "KvHeldRequest",
    "KvReserveReply",
    "KvReserveRequest",
    "Message",
    "PrefillDone",
    "PrefillDoneAck",
    "PrefillJob",
    "QueueReport",
    "QueueReportRequest",
    "QueuedRequest",
    "DispatchNote",
    "FairShareReport",
    "RequestRecord",
    "TenantUsage",
    "TenantQueue",
    "JobBounced",
    "RequestFinished",
    "RevokeJob",
    "RevokeReply",
    "Route",
    "SamplingParams",
    "TokenLogprob",
    "TopLogprob",
    "SpanBatch",
    "StageCost",
    "StreamDelta",
    "StreamError",
    "StreamFinal",
    "StreamMessage",
    "Timings",
    "Usage",
    "WorkerLoad",
    "now_ms",
]


def now_ms() -> float:
    return time.time() * 1000.0


def _own_reply_subject(subject: str, tenant: str, request_id: str) -> str:
    """A request's stream subject is derived from (tenant, request id), never chosen by a sender: an empty
    value becomes the live stream subject, and anything but the stream or result subject is refused, so no
    service ever publishes where a message body points it (another tenant's subjects, ``$KV``, ``$JS.API``)."""
    stream, result = reply_subjects(tenant, request_id)
    if not subject:
        return stream
    if subject not in (stream, result):
        raise ValueError(f"stream_subject must be {stream!r} or {result!r} (derived from the tenant and the request "
                         f"id), not {quoted(subject)}")
    return subject


class Message(BaseModel):
    """Base of every wire message."""

    model_config = ConfigDict(
        extra="ignore", populate_by_name=True, ser_json_bytes="base64", val_json_bytes="base64"
    )
    v: int = PROTO_VERSION


class TenantRequest:
    """A message about one tenant's request. A request id is the client's and unique only within its tenant, so
    every map, store key, engine sequence and heartbeat list that names requests across tenants uses ``key``
    (``proto.request_key``): tenant A naming an id that B uses (first, or after) touches nothing of B's."""

    __slots__ = ()
    if TYPE_CHECKING:
        request_id: str
        tenant: str

    @property
    def key(self) -> str:
        return request_key(self.tenant, self.request_id)


class ErrorCode(StrEnum):
    """Terminal error kinds a caller can act on."""

    BAD_REQUEST = "bad_request"  # malformed or invalid message / parameters
    UNSUPPORTED_VERSION = "unsupported_version"
    PROMPT_TOO_LONG = "prompt_too_long"  # more tokens than the model or the tenant allows
    PAYLOAD_TOO_LARGE = "payload_too_large"  # encoded message over the NATS payload limit
    UNKNOWN_TENANT = "unknown_tenant"
    MODEL_NOT_FOUND = "model_not_found"  # no served model by that name (HTTP 404; the message lists the served ones)
    MODEL_NOT_ALLOWED = "model_not_allowed"  # the tenant's contract does not include that model (HTTP 403)
    # The message claims a tenant (or request) other than the one its subject is authorised for, or acts on a
    # request the sender does not own.
    FORBIDDEN = "forbidden"
    QUOTA_EXCEEDED = "quota_exceeded"
    NO_WORKERS = "no_workers"  # no live worker of a needed role within the bounded wait
    WORKER_DIED = "worker_died"  # the worker serving the request stopped mid-request
    KV_TRANSFER_FAILED = "kv_transfer_failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # the request's deadline passed
    BUSY = "busy"  # bounded queues are full; retry later
    # The tenant's latency targets (its SLO) cannot be met now: refused at once rather than served late (HTTP 429
    # with Retry-After: when the queue ahead should have drained enough)
    SLO_UNATTAINABLE = "slo_unattainable"
    INTERNAL = "internal"


class Route(StrEnum):
    DIRECT = "direct"
    DISAGGREGATED = "disaggregated"


# ---------------------------------------------------------------------------------------------- requests


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


MAX_STOP_CHARS = 1024


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(default=128, ge=1, le=1_000_000)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = False  # keep generating past EOS (load tests: always max_tokens)
    # No EOS (it is masked out of the sampled distribution) and no stop string before this many tokens.
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    # Log-probabilities of each generated token: None = none; k = the chosen token's and the k most likely.
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        # Every generated token is checked against every stop string (and the text that may start one is held
        # back): a megabyte stop string would cost the decoder that much per token, and ride in every record of
        # the request. Nothing a model writes needs a longer one.
        if (longest := max((len(s) for s in v), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS:,} characters; one has {longest:,}")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self


class TopLogprob(BaseModel):
    model_config = ConfigDict(extra="ignore")
    token_id: int
    token: str  # the token alone, decoded (special tokens included)
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token's log-probability under the model's raw distribution (log-softmax of the logits,
    before temperature / top-p, as vLLM reports by default), and the most likely alternatives."""

    model_config = ConfigDict(extra="ignore")
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class GenerateRequest(Message, TenantRequest):
    """A client's request for one completion. Exactly one of prompt / messages / prompt_token_ids."""

    kind: Literal["generate_request"] = "generate_request"
    request_id: str
    tenant: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: TokenIds | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    session_id: str | None = Field(default=None, max_length=256)
    # Derived: ss.stream.{tenant}.{request_id} (default) or, for an async job, ss.result.{tenant}.{request_id}.
    stream_subject: str = Field(default="", max_length=200)
    created_ms: float = Field(default_factory=now_ms)
    deadline_ms: float | None = None  # absolute unix ms; the request expires after it
    priority: int = Field(default=0, ge=0, le=9)  # 0 = most urgent class within the tenant
    # "auto" lets the router's threshold decide; the others force a path (debugging, benchmarks).
    route: Literal["auto", "direct", "disaggregated"] = "auto"
    # False: no deltas, only the terminal message (non-streaming callers and async jobs, whose stream subject
    # is their result subject).
    stream: bool = True
    # The served model (or pool) the caller asks for, or a LoRA adapter's name (as vLLM's API takes it); None: the
    # router's default (its first). A router serving several models routes only to that model's workers and
    # refuses a name it does not serve.
    model: str | None = Field(default=None, max_length=256)
    # The LoRA adapter: set by the router when ``model`` names one (``model`` is then its base model's name).
    lora: str | None = Field(default=None, max_length=256)
    # The caller's own prefix-cache salt (OpenAI / vLLM ``cache_salt``; added in v1 with a default). It only
    # splits the tenant's cache further: the router combines it with the tenant's (or its cache group's) salt,
    # so it can never reach another tenant's cached prefixes (``TenantsConfig.cache_salt``).
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("request_id")
    @classmethod
    def _rid(cls, v: str) -> str:
        return check_token(v, "request id")

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str) -> str:
        return check_token(v, "tenant")

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, messages or prompt_token_ids must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.stream_subject = _own_reply_subject(self.stream_subject, self.tenant, self.request_id)
        return self


class Accepted(Message):
    """The router's immediate answer to a GenerateRequest: it owns the request now."""

    kind: Literal["accepted"] = "accepted"
    request_id: str
    router_id: str
    prompt_tokens: int


# ---------------------------------------------------------------------------------------------- jobs


class DecodeJob(Message, TenantRequest):
    """What a decoder needs to serve a request. Sent directly (route=direct: the decoder prefills locally)
    or inside a PrefillDone once the KV has landed in the decoder's reserved blocks."""

    kind: Literal["decode_job"] = "decode_job"
    request_id: str
    tenant: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    stream_subject: str = Field(default="", max_length=200)  # derived and checked as GenerateRequest's
    route: Route
    decoder_id: str
    prefill_worker: str | None = None
    created_ms: float  # when the client created the request (for end-to-end timing)
    routed_ms: float = Field(default_factory=now_ms)
    deadline_ms: float | None = None
    decision: dict[str, Any] = Field(default_factory=dict)  # the routing decision record
    stream: bool = True  # publish deltas (False: only the terminal message)
    # Migration (added in v1 with defaults: an older decoder reads a first attempt unchanged). A request whose
    # worker died continues elsewhere: the new decoder computes over prompt + resume_token_ids (the tokens
    # already streamed to the caller), treats those as generated output (usage, final token_ids/text, the
    # max_tokens budget) and publishes from start_seq. ``attempt`` counts migrations; a worker drops a job or
    # KV hand-off of an attempt older than one it was told to revoke.
    attempt: int = Field(default=0, ge=0)
    resume_token_ids: TokenIds = Field(default_factory=list)
    resume_text: str = ""
    start_seq: int = Field(default=0, ge=0)
    # The router-computed salt that keys this request's prefix-cache blocks on the workers and in their KV events
    # (tenant or cache group, refined by the request's own salt). Added in v1 with a default: None (a job from
    # an older router) keeps the unsalted keys.
    cache_salt: str | None = Field(default=None, max_length=200)
    # The LoRA adapter the prompt and the tokens are computed with (None: the base model); the prefiller applies
    # the same one. Added in v1 with a default.
    lora: str | None = Field(default=None, max_length=256)
    # The tenant's fair-share weight (tenants file): a prefiller serves its waiting prompts by weighted tokens
    # between tenants (splitserve.tenancy.fairqueue). Added in v1 with a default.
    weight: float = Field(default=1.0, gt=0.0, le=1e6, allow_inf_nan=False)
    # Funded by its tenant's guarantee (splitserve.tenancy.contracts): a prefiller serves such prompts before any
    # other. Added in v1 with a default.
    guaranteed: bool = False
    # Its tenant's contract priority class (0 most urgent): a decoder admits the jobs waiting for a slot most urgent
    # class first, so a slot freed by preemption (splitserve.tenancy.preemption) goes to the request that preempted.
    # Added in v1 with a default (0 for every job: first come, first admitted, as before).
    priority_class: int = Field(default=0, ge=0, le=9)

    @model_validator(mode="after")
    def _own_subject(self) -> DecodeJob:
        check_token(self.tenant, "tenant")
        check_token(self.request_id, "request id")
        self.stream_subject = _own_reply_subject(self.stream_subject, self.tenant, self.request_id)
        return self

    def context_token_ids(self) -> list[int]:
        """What the KV must cover: the prompt, then the tokens a previous attempt already produced."""
        if not self.resume_token_ids:
            return self.prompt_token_ids
        return [*self.prompt_token_ids, *self.resume_token_ids]


class RevokeJob(Message, TenantRequest):
    """Router -> decoder, request/reply: stop holding one attempt of a request, silently (no terminal message:
    the request continues elsewhere). Without ``force`` a sequence already decoding is kept (the answer says
    so); with it, that too is dropped (fencing a decoder the router declared dead)."""

    kind: Literal["revoke_job"] = "revoke_job"
    request_id: str
    tenant: str
    attempt: int = Field(ge=0)
    force: bool = False
    reason: str = ""


class RevokeReply(Message):
    kind: Literal["revoke_reply"] = "revoke_reply"
    request_id: str
    revoked: bool  # whatever the decoder held of that attempt is gone (or it held nothing)
    running: bool = False  # not revoked: the sequence is decoding (or its KV has landed) here


class JobBounced(Message, TenantRequest):
    """Prefiller -> routers: a job could not be handed to its decoder (it died, refused or timed out the KV
    reservation, or the push failed). The caller was told nothing; the router that dispatched the request
    sends it again (another prefiller or decoder), within its migration bound."""

    kind: Literal["job_bounced"] = "job_bounced"
    request_id: str
    tenant: str
    worker_id: str
    attempt: int = Field(default=0, ge=0)
    code: ErrorCode
    message: str
    decoder: str | None = None  # code worker_died: the decoder that did not answer (it is not routed to again
    # until its next heartbeat)


class PrefillJob(Message):
    """Router -> prefiller: compute the prompt's KV and push it into the named decoder's reserved blocks."""

    kind: Literal["prefill_job"] = "prefill_job"
    decode: DecodeJob  # forwarded to the decoder inside PrefillDone


class KvReserveRequest(Message, TenantRequest):
    kind: Literal["kv_reserve_request"] = "kv_reserve_request"
    request_id: str
    tenant: str = ""  # whose request (decoders list reservations by proto.request_key)
    prefill_worker: str
    num_tokens: int = Field(ge=1)
    transport: str


class KvReserveReply(Message):
    kind: Literal["kv_reserve_reply"] = "kv_reserve_reply"
    request_id: str
    ok: bool
    transfer_id: str | None = None
    block_ids: list[int] = Field(default_factory=list)
    descriptor: bytes | None = None  # transport-specific target blob (base64 in JSON)
    lease_ms: float = 0.0  # the reservation is freed if no PrefillDone arrives in time
    retry_after_ms: float | None = None  # set when the buffer is full: try again later
    error: str | None = None
    # Set when the request can never fit: the decoder's whole landing buffer, in tokens (no retry, no other attempt
    # on it: the prefiller fails the request at once with prompt_too_long instead of bouncing it)
    capacity_tokens: int | None = None


class KvHandle(BaseModel):
    """Where a request's KV now sits on the decoder, and what it cost to get it there."""

    model_config = ConfigDict(extra="ignore")
    transfer_id: str
    num_tokens: int
    cached_tokens: int = 0
    kv_bytes: int
    transport: str
    prefill_ms: float
    transfer_ms: float
    started_ms: float | None = None  # when the prefiller started the job (unix ms)
    # This request's share of the prefill compute (a batched prefill's time split among its members; None: an
    # older prefiller, prefill_ms then)
    compute_ms: float | None = None


class PrefillDone(Message):
    """Prefiller -> decoder: the KV has landed (the transport confirmed it); here is the first token."""

    kind: Literal["prefill_done"] = "prefill_done"
    request_id: str
    first_token: int
    kv: KvHandle
    decode: DecodeJob
    # Engines that move KV with their own connectors (vLLM's NixlConnector): what the prefiller's engine
    # returned for the decoder's engine (remote engine id, block ids, host, port...). None with the hf engine.
    kv_transfer_params: dict[str, Any] | None = None
    first_logprob: TokenLogprob | None = None  # the first token's, when the request asked for logprobs


class PrefillDoneAck(Message):
    """Decoder -> prefiller, the reply to a PrefillDone: the decoder has taken the hand-off (added in v1). The
    prefiller sends PrefillDone as a request and again while unanswered: one lost in flight (a NATS node died
    with it) left the request with nobody to run it, its KV reservation holding it for the whole lease. The
    decoder takes each transfer once; a repeat is answered and dropped."""

    kind: Literal["prefill_done_ack"] = "prefill_done_ack"
    request_id: str
    transfer_id: str


# ---------------------------------------------------------------------------------------------- stream


class Usage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Timings(BaseModel):
    """Server-side timings of one request, all in milliseconds."""

    model_config = ConfigDict(extra="ignore")
    queue_ms: float | None = None  # created -> routed
    dispatch_ms: float | None = None  # created -> the first worker starts the job (control-plane overhead)
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    ttft_server_ms: float | None = None  # created -> first token published
    total_ms: float | None = None


class StageCost(BaseModel):
    """The worker-seconds one request caused, per stage (chargeback). A decode step's time is shared equally by
    the sequences it advanced, so a decoder's requests' ``decode_s`` sum to the seconds it spent stepping
    (``WorkerLoad.busy_s``); ``prefill_s`` is the compute of the prompt's uncached tokens (on the prefiller, or on
    the decoder when it prefilled itself); ``transfer_s`` the KV push left after prefill. ``saved_s``: what the
    ``cached_tokens`` would have cost at the rate this request's prefill ran (an estimate)."""

    model_config = ConfigDict(extra="ignore")
    # finite and >= 0: these are summed into bills and counters, where one NaN or infinity would poison the total
    prefill_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    transfer_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    decode_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    cached_tokens: int = Field(default=0, ge=0)
    saved_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)


class StreamDelta(Message):
    kind: Literal["delta"] = "delta"
    request_id: str
    seq: int  # 0, 1, 2, ... per request; the final message continues the sequence
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


class StreamFinal(Message):
    kind: Literal["final"] = "final"
    request_id: str
    seq: int
    token_ids: list[int]  # every generated token
    text: str
    finish_reason: Literal["stop", "length", "cancelled", "expired"]
    usage: Usage
    route: Route
    prefill_worker: str | None
    decode_worker: str
    timings: Timings = Field(default_factory=Timings)
    decision: dict[str, Any] = Field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asked for them
    model: str | None = None  # the model the decoder serves


class StreamError(Message):
    """Terminal error on a request's stream (also used as the reply to a rejected GenerateRequest)."""

    kind: Literal["error"] = "error"
    request_id: str | None = None
    seq: int | None = None
    code: ErrorCode
    message: str
    retryable: bool = False
    retry_after_ms: float | None = None
    worker: str | None = None


ErrorMessage = StreamError

StreamMessage = Annotated[StreamDelta | StreamFinal | StreamError, Field(discriminator="kind")]


class CancelRequest(Message, TenantRequest):
    """Stop a request wherever it is (queued, prefilling, decoding) and free its KV and reservations; the
    caller then gets a StreamFinal with finish_reason "cancelled" (what was generated so far, and usage)."""

    # A cancel names a request and a reason: tiny. Every router, prefiller and decoder decodes every tenant's cancels
    # on its event loop, so a larger one is refused unread (a tenant's multi-MB cancels stalled the workers' loops
    # for seconds: they missed heartbeats and other tenants' requests were moved as if their worker had died).
    MAX_BYTES: ClassVar[int] = 64 * 1024
    kind: Literal["cancel_request"] = "cancel_request"
    request_id: str
    tenant: str
    reason: str = "cancelled by the client"


class RequestFinished(Message, TenantRequest):
    """Emitted once per request when it ends (any outcome): in-flight tracking and usage metering."""

    kind: Literal["request_finished"] = "request_finished"
    request_id: str
    tenant: str
    worker_id: str
    status: Literal["ok", "error", "cancelled", "expired"]
    usage: Usage | None = None
    error_code: ErrorCode | None = None
    route: Route | None = None
    timings: Timings | None = None  # server-side timings, for the cluster's latency histograms
    itl_ms: list[float] = Field(default_factory=list)  # inter-token gaps at the decoder (at most 512 kept)
    kv_bytes: int | None = None  # KV moved from a prefiller for this request
    finish_reason: str | None = None  # the stream's finish reason (stop / length / cancelled / expired)
    # The served model and the LoRA adapter the request ran with, for usage and metrics by model (added in v1 with
    # defaults: None where the publisher does not know, e.g. a request refused before it was resolved).
    model: str | None = Field(default=None, max_length=256)
    lora: str | None = Field(default=None, max_length=256)
    cost: StageCost | None = None  # worker-seconds per stage, from the decoder that served it (None: not known)


# ---------------------------------------------------------------------------------------------- workers


class WorkerLoad(BaseModel):
    model_config = ConfigDict(extra="ignore")
    active_seqs: int = 0
    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    reserved_blocks: int = 0  # blocks leased to incoming KV transfers
    used_blocks: int = 0  # blocks holding active sequences' KV
    cached_blocks: int = 0  # prefix-cache blocks resident (all tiers)
    prefill_tokens_per_s: float | None = None  # measured local prefill speed (feeds the router's stall rule)
    max_seqs: int | None = None  # the most sequences it runs at once (the router paces its queue by it)
    step_ms: float | None = None  # recent decode step time: the fixed cost of any forward pass it runs
    # Seconds spent computing since start, per stage ("prefill", "decode"): what its requests' StageCost sum to
    busy_s: dict[str, float] = Field(default_factory=dict, max_length=8)


class Heartbeat(Message):
    kind: Literal["heartbeat"] = "heartbeat"
    worker_id: str
    role: Literal["router", "prefill", "decode", "cache_index", "frontend"]
    seq: int
    ts_ms: float = Field(default_factory=now_ms)
    state: Literal["starting", "ready", "draining", "stopped"] = "ready"
    interval_ms: float = 500.0
    pid: int | None = None
    engine: str | None = None
    model: str | None = None
    max_model_len: int | None = None
    transport: str | None = None
    block_size: int | None = None
    load: WorkerLoad = Field(default_factory=WorkerLoad)
    # The requests this worker holds, as ``proto.request_key(tenant, request_id)`` (ids are unique per tenant only)
    active_requests: list[str] = Field(default_factory=list)
    # A decoder's context pool: "long" decoders take the long prompts (splitserve.routing.context)
    pool: Literal["general", "long"] = "general"
    # The LoRA adapters loaded on this worker now, and all it may load on demand (--max-loras); routers prefer a
    # worker with a request's adapter loaded, and send it only to one that has it available
    adapters: list[str] = Field(default_factory=list, max_length=1024)
    adapters_available: list[str] = Field(default_factory=list, max_length=1024)


# ---------------------------------------------------------------------------------------------- KV events
# Mirrors vLLM's kv_events.py (BlockStored / BlockRemoved / AllBlocksCleared in a sequenced batch) so that
# vLLM's own events can be bridged onto the same subjects.


def _tier(value: object) -> object:
    return value.lower() if isinstance(value, str) else value  # vLLM spells the tiers "GPU" / "CPU"


class BlockStored(BaseModel):
    """Full blocks now cached on a worker, in chain order; ``parent_block_hash`` precedes the first one."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["stored"] = "stored"
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None  # all blocks' tokens, concatenated (vLLM sends them; optional here)
    block_size: int
    lora_id: int | None = None
    medium: Annotated[str, BeforeValidator(_tier)] = "gpu"


class BlockRemoved(BaseModel):
    """Blocks a worker evicted from one tier."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["removed"] = "removed"
    block_hashes: list[int]
    medium: Annotated[str, BeforeValidator(_tier)] = "gpu"


class AllBlocksCleared(BaseModel):
    """The worker dropped every block of one tier, or of every tier when ``medium`` is None."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["cleared"] = "cleared"
    medium: Annotated[str | None, BeforeValidator(_tier)] = None


KvEvent = Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="type")]


class KvEventBatch(Message):
    kind: Literal["kv_event_batch"] = "kv_event_batch"
    worker_id: str
    seq: int  # per worker, +1 per batch: a jump means events were lost and the index must resync
    ts_ms: float = Field(default_factory=now_ms)
    events: list[KvEvent]


class KvHeldRequest(Message):
    """Ask a worker for every block it holds now (an index resync after a gap in its event stream)."""

    kind: Literal["kv_held_request"] = "kv_held_request"


class KvHeld(Message):
    kind: Literal["kv_held"] = "kv_held"
    worker_id: str
    seq: int  # the last event batch seq this state includes
    held: dict[str, list[int]]  # medium -> block hashes


class CacheQuery(Message):
    kind: Literal["cache_query"] = "cache_query"
    block_hashes: list[int]


class CacheQueryReply(Message):
    kind: Literal["cache_query_reply"] = "cache_query_reply"
    matched_blocks: dict[str, int]  # worker id -> leading blocks held


class SpanBatch(Message):
    """Finished trace spans of one process (the embedded exporter; kept in the SS_TRACES stream).

    Each span is a plain record: trace_id, span_id, parent_id, name, service, worker_id, start_ns, end_ns,
    status, status_message, attributes, events (see ``splitserve.obs.tracing.span_to_record``)."""

    kind: Literal["span_batch"] = "span_batch"
    service: str
    worker_id: str
    spans: list[dict[str, Any]]


# ---------------------------------------------------------------------------------------------- queues


class QueuedRequest(Message):
    """An accepted request waiting in its tenant's durable queue (``ss.q.{tenant}.p{class}``). It carries
    the prompt already tokenized and checked, so dispatch never repeats intake's work."""

    kind: Literal["queued_request"] = "queued_request"
    request: GenerateRequest
    prompt_token_ids: TokenIds
    accepted_ms: float = Field(default_factory=now_ms)
    router_id: str  # the router that accepted it (dispatch may be another one, after a restart)
    # The revision of the request's record in the SS_REQUESTS bucket when it was queued: dispatch claims it
    # with one compare-and-set against this revision (None: an older router; dispatch reads the record first).
    record_revision: int | None = None


class QueueReportRequest(Message):
    kind: Literal["queue_report_request"] = "queue_report_request"


class TenantQueue(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tenant: str
    weight: float = 1.0
    queued: int = 0  # waiting in the durable queue, all classes
    queued_by_class: dict[str, int] = Field(default_factory=dict)  # "p0" -> n
    running: int = 0  # dispatched by this router, not finished
    inflight: int = 0  # accepted and not finished (the max_inflight quota counts these)
    oldest_wait_ms: float | None = None  # how long the oldest waiting request has waited
    accepted_per_s: float = 0.0  # over the last 10 s
    dispatched_per_s: float = 0.0
    refused_per_s: float = 0.0
    served_tokens: int = 0  # tokens charged to the tenant by the fair scheduler since the router started
    tokens_last_minute: int = 0  # what the tokens_per_minute quota counts
    # Contracts (splitserve.tenancy.contracts), added in v1 with defaults: the tenant's priority class, its running
    # requests over every router, and how its next request would be funded now ("guaranteed", "burst", or
    # "capped": at a burst cap, it waits); None without contracts.
    priority: int = 0
    cluster_running: int | None = None
    funding: str | None = None


class QueueReport(Message):
    kind: Literal["queue_report"] = "queue_report"
    router_id: str
    ts_ms: float = Field(default_factory=now_ms)
    capacity: int = 0  # decode slots the router may fill now
    running: int = 0
    tenants: list[TenantQueue] = Field(default_factory=list)
    # What the live workers cannot honour of the contracts' guarantees (empty: they fit). Added in v1.
    contract_problems: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------- several routers
# State the router replicas share. RequestRecord and TenantUsage are values in JetStream KV buckets (written
# with compare-and-set on the key's revision); DispatchNote and FairShareReport are plain publishes.


class RequestRecord(Message, TenantRequest):
    """One request's cluster-wide state, the value of key ``{tenant}.{request_id}``
    (``key``) in the ``SS_REQUESTS`` KV bucket.

    Created (create-only) at intake, so a tenant's request id is accepted once across every router; moved by
    compare-and-set on its revision: ``queued`` -> ``dispatched`` (exactly one router wins the dispatch) ->
    ``ended`` (exactly one router settles its quota and acks it). A request cancelled or expired while queued
    goes ``queued`` -> ``ended`` by the same compare-and-set, so it can never also be dispatched."""

    kind: Literal["request_record"] = "request_record"
    request_id: str
    tenant: str
    state: Literal["queued", "dispatched", "ended"]
    stream_subject: str = Field(default="", max_length=200)  # derived and checked as GenerateRequest's
    prompt_tokens: int = 0
    max_tokens: int = 0
    accepted_ms: float = Field(default_factory=now_ms)
    deadline_ms: float | None = None
    accepted_by: str  # the router whose intake accepted it
    owner: str | None = None  # the router that dispatched (or adopted) it
    owner_pid: int | None = None  # that router's process: a restarted router of the same id is not the owner
    status: str | None = None  # when ended: ok | error | cancelled | expired
    used_tokens: int | None = None  # when ended: prompt + completion tokens it used (None: it never ran)
    updated_ms: float = Field(default_factory=now_ms)

    @model_validator(mode="after")
    def _own_subject(self) -> RequestRecord:
        check_token(self.tenant, "tenant")
        check_token(self.request_id, "request id")
        self.stream_subject = _own_reply_subject(self.stream_subject, self.tenant, self.request_id)
        return self


class TenantUsage(Message):
    """A tenant's quota usage across every router, the value of key ``{tenant}`` in the ``SS_QUOTA`` bucket
    (``splitserve.tenancy.quota.QuotaBook.export``). Every admission and finish is a compare-and-set on it,
    so max_inflight and tokens_per_minute are global and exact."""

    kind: Literal["tenant_usage"] = "tenant_usage"
    tenant: str
    # request id -> [admitted at (unix s), tokens reserved]: accepted and not yet finished
    inflight: dict[str, tuple[float, int]] = Field(default_factory=dict)
    # finished requests' real token use in the last minute, one entry per second: [second (unix s), tokens]
    settled: list[tuple[float, int]] = Field(default_factory=list)
    finishes: list[float] = Field(default_factory=list)  # recent finish times (unix s), for retry-after
    updated_ms: float = Field(default_factory=now_ms)


class DispatchNote(Message, TenantRequest):
    """Router -> the other routers (``ss.routed.{router}``): "I just sent this request to these workers", so
    their pending-load ledgers count it until the workers' own heartbeats do (no two routers pile one burst
    onto the worker that looked cheapest to both)."""

    kind: Literal["dispatch_note"] = "dispatch_note"
    router_id: str
    request_id: str
    decoder: str
    decoder_tokens: int = 0  # prefill tokens the decoder runs itself (direct route)
    blocks: int = 0  # KV blocks the request takes on the decoder
    prefiller: str | None = None
    prefiller_tokens: int = 0
    # Fair share: what the dispatch charged its tenant (tokens / weight). The others count it at once, until
    # the sender's next FairShareReport (which includes it) replaces it: a fast queue is not split by stale counts.
    tenant: str = ""
    virtual_tokens: float = 0.0


class FairShareReport(Message):
    """Router -> the other routers (``ss.fair.{router}``), periodically: the virtual tokens (tokens / weight)
    this router's process has charged each tenant. Each router adds the others' to its own fair-share counters,
    so the weighted split holds over the whole cluster, not per router."""

    kind: Literal["fair_share_report"] = "fair_share_report"
    router_id: str
    incarnation: str  # one per router process: a restarted router's tokens add to, never replace, the old ones
    virtual_tokens: dict[str, float] = Field(default_factory=dict)
    # Contracts (splitserve.tenancy.contracts), added in v1 with a default: the requests this router runs per
    # tenant now.
    running: dict[str, int] = Field(default_factory=dict, max_length=4096)
