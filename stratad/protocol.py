"""Control-socket messages, shared by the daemon and `stratactl` (msgspec; never torch).

One request per line, one reply per line: newline-delimited JSON on a Unix stream socket.
Requests are tagged by `verb`, replies by `type`; any request may be answered with an
`ErrorReply` instead of its own reply type.

    -> {"verb": "status"}
    <- {"type": "status", "state": "serving", "model": "...", ...}
    -> {"verb": "nope"}
    <- {"type": "error", "code": "bad-request", "error": "..."}
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024
"""The daemon refuses a longer request line (and closes that connection)."""
MAX_REPLY_BYTES = 16 << 20
"""The client refuses a longer reply line."""

State = Literal["starting", "loading", "pinning", "serving", "draining", "stopping"]
ErrorCode = Literal["bad-request", "too-large", "permission", "unavailable", "internal", "busy"]
HealthStatus = Literal["loading", "pinning", "ok", "degraded", "draining", "failed"]


class ProtocolError(ValueError):
    """A message that does not decode; `code` is the `ErrorReply` code it earns."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


# ---- requests ---------------------------------------------------------------------------


class _Request(_Message, frozen=True, tag_field="verb"):
    v: int = PROTOCOL_VERSION


class StatusRequest(_Request, frozen=True, tag="status"):
    pass


class CoverageRequest(_Request, frozen=True, tag="coverage"):
    pass


class PlanRequest(_Request, frozen=True, tag="plan"):
    pass


class StatsRequest(_Request, frozen=True, tag="stats"):
    pass


class ProfileSaveRequest(_Request, frozen=True, tag="profile-save"):
    path: str = ""
    """Where the daemon writes the expert profile; empty: its configured profile path."""


class DrainRequest(_Request, frozen=True, tag="drain"):
    wait_s: float = 0.0
    """Wait up to this long for in-flight requests to finish before replying."""


class UndrainRequest(_Request, frozen=True, tag="undrain"):
    """Take requests again after a `drain` (not after SIGTERM: the daemon is stopping then)."""


Request = (
    StatusRequest
    | CoverageRequest
    | PlanRequest
    | StatsRequest
    | ProfileSaveRequest
    | DrainRequest
    | UndrainRequest
)
VERBS: tuple[str, ...] = tuple(
    str(t.__struct_config__.tag)
    for t in Request.__args__  # type: ignore[attr-defined]
)


# ---- replies ----------------------------------------------------------------------------


class _Reply(_Message, frozen=True, tag_field="type"):
    pass


class ErrorReply(_Reply, frozen=True, tag="error"):
    code: ErrorCode
    error: str


class Progress(_Message, frozen=True):
    """Page-locking of the resident set."""

    done_bytes: int
    total_bytes: int
    rate_bytes_s: float = 0.0
    eta_s: float | None = None

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes <= 0 else min(1.0, self.done_bytes / self.total_bytes)


class Requests(_Message, frozen=True):
    total: int = 0
    """HTTP requests answered since start (any status)."""
    active: int = 0
    """Requests being served now."""
    queued: int = 0
    """Requests waiting for the engine."""
    refused: int = 0
    """Requests refused while draining or with a full queue."""


class MemoryUse(_Message, frozen=True):
    rss_bytes: int = 0
    pinned_bytes: int = 0
    host_total_bytes: int = 0
    host_available_bytes: int = 0
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None


class Health(_Message, frozen=True, omit_defaults=True):
    """The daemon's health: the body of HTTP /health and the `health` of a status reply."""

    status: HealthStatus
    """ok or degraded: it serves (HTTP 200); else it does not now (HTTP 503)."""
    model: str | None
    running: int
    """Requests the engine runs now."""
    waiting: int
    """Requests waiting for the engine (or for the tokenizer)."""
    reason: str | None = None
    """Why it is degraded, draining, held or failed."""

    @property
    def serving(self) -> bool:
        return self.status in ("ok", "degraded")


class StatusReply(_Reply, frozen=True, tag="status"):
    state: State
    version: str
    pid: int
    uptime_s: float
    model: str = ""
    arch: str = ""
    device: str = ""
    moe: bool = False
    plan_hash: str = ""
    coverage_complete: bool | None = None
    requests: Requests = msgspec.field(default_factory=Requests)
    pinning: Progress | None = None
    memory: MemoryUse = msgspec.field(default_factory=MemoryUse)
    health: Health | None = None
    """What HTTP /health says (None before the HTTP side is set up)."""
    protocol: int = PROTOCOL_VERSION


class LayerCoverage(_Message, frozen=True):
    layer: int
    experts: int
    in_vram: int
    in_ram: int
    """Experts with a RAM copy (whether or not they also hold a VRAM slot)."""
    file_only: int
    """Experts with neither: read from the file (`CoverageReply.file`) whenever routed to."""
    routed_mass: float
    """Share of this layer's routed mass (from the profile) whose experts have a RAM or VRAM
    copy; without a profile, the share of its experts."""


class CoverageReply(_Reply, frozen=True, tag="coverage"):
    moe: bool
    experts: int = 0
    in_vram: int = 0
    in_ram: int = 0
    in_file_only: int = 0
    routed_mass: float = 1.0
    """Share of the routed mass whose experts need no file read."""
    complete: bool = True
    file_reads: int = 0
    """Expert reads from the file since start."""
    file_read_bytes: int = 0
    estimated_cost: str = ""
    """In words: what the missing coverage costs (empty when complete)."""
    estimated_slowdown: float | None = None
    """Estimated fraction of prompt speed lost (0.26 = 26 % slower); None when unknown."""
    layers: list[LayerCoverage] = msgspec.field(default_factory=list)
    file: str = ""
    """The file experts without a copy are read from, in words ("the model file PATH", "the
    pack file PATH"); empty where the reply is of a plan alone."""


class Tier(_Message, frozen=True):
    experts: int = 0
    bytes: int = 0


class PlanReply(_Reply, frozen=True, tag="plan"):
    hash: str
    moe: bool
    vram: Tier = msgspec.field(default_factory=Tier)
    ram: Tier = msgspec.field(default_factory=Tier)
    file: Tier = msgspec.field(default_factory=Tier)
    vram_budget_bytes: int = 0
    ram_budget_bytes: int = 0
    headroom_bytes: int = 0
    mem_total_bytes: int = 0
    degraded: bool = False
    """The daemon runs a smaller plan than configured (not enough RAM at start)."""
    inputs: dict[str, str] = msgspec.field(default_factory=dict)
    """What the plan was computed from (manifest, profile, budgets), for `check --after-restart`."""


class StageTiming(_Message, frozen=True):
    name: str
    calls: int
    total_ms: float

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.calls if self.calls else 0.0


class StatsReply(_Reply, frozen=True, tag="stats"):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stages: list[StageTiming] = msgspec.field(default_factory=list)
    tier_hits: dict[str, int] = msgspec.field(default_factory=dict)
    """Expert uses served from each tier: vram, ram, file."""
    counters: dict[str, int] = msgspec.field(default_factory=dict)
    """The engine's counts: drafted and accepted tokens and verifying steps (speculative
    decoding), preemptions (the KV pool ran short)."""

    def hit_rate(self, tier: str) -> float | None:
        total = sum(self.tier_hits.values())
        return self.tier_hits.get(tier, 0) / total if total else None


class ProfileSaveReply(_Reply, frozen=True, tag="profile-save"):
    path: str
    experts: int
    bytes: int


class DrainReply(_Reply, frozen=True, tag="drain"):
    in_flight: int
    drained: bool
    """No request is in flight any more (new ones are refused from the first drain on)."""


class UndrainReply(_Reply, frozen=True, tag="undrain"):
    serving: bool
    """The daemon takes requests again (false: it was not drained, or it is stopping)."""
    state: HealthStatus


Reply = (
    ErrorReply
    | StatusReply
    | CoverageReply
    | PlanReply
    | StatsReply
    | ProfileSaveReply
    | DrainReply
    | UndrainReply
)

_request_decoder = msgspec.json.Decoder(Request)
_reply_decoder = msgspec.json.Decoder(Reply)
_encoder = msgspec.json.Encoder()


def encode(message: _Message) -> bytes:
    """One line: the JSON and a newline."""
    return _encoder.encode(message) + b"\n"


def decode_request(line: bytes) -> Request:
    if len(line) > MAX_REQUEST_BYTES:
        raise ProtocolError(
            "too-large", f"request of {len(line)} bytes; at most {MAX_REQUEST_BYTES}"
        )
    try:
        request = _request_decoder.decode(line)
    except msgspec.ValidationError as e:
        if "Invalid value" in str(e) and "`$.verb`" in str(e):
            raise ProtocolError("bad-request", f"unknown verb; known: {', '.join(VERBS)}") from None
        raise ProtocolError("bad-request", f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError("bad-request", f"not JSON: {e}") from None
    if request.v != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad-request", f"protocol version {request.v}; this daemon speaks {PROTOCOL_VERSION}"
        )
    return request


def decode_reply(line: bytes) -> Reply:
    try:
        return _reply_decoder.decode(line)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolError("bad-request", f"unreadable reply from the daemon: {e}") from None
