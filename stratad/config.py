"""The configuration: one frozen chain of typed sections.

Sources, later ones winning: defaults, the TOML file, STRATA_* environment variables (read by
`stratad.env`), the command line. msgspec validates types and rejects unknown keys, so a typo
in the file is an error at start, not a silently ignored setting.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from stratad.env import Env

# when decode steps queue the next one on the GPU (`engine.step_ahead`)
StepAhead = Literal["auto", "on", "off"]

DEFAULT_CONFIG_PATH = Path("/etc/strata/stratad.toml")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section, frozen=True):
    path: str = ""
    """GGUF file, pack or Hugging Face directory; empty serves SmolLM2-135M-Instruct."""
    name: str = ""
    """Model id shown by /v1/models; empty uses the file name."""
    aliases: tuple[str, ...] = ()
    """Other names a request's `model` may give for this model (a name that is neither the
    id nor an alias gets OpenAI's 404 `model_not_found`); `"*"` accepts any name. With
    `path` empty, `default` names the default model too."""
    max_context: Annotated[int, msgspec.Meta(ge=2)] = 4096
    """Tokens of context per sequence (prompt plus completion); capped by the model's own."""
    chat_template: str = ""
    """A Jinja chat template file (Hugging Face's dialect) that replaces the model's own; empty
    uses the model's (the GGUF's `tokenizer.chat_template`, or a Hugging Face directory's
    `chat_template.jinja` or `tokenizer_config.json`), else ChatML. Read at start: a file that
    cannot be read is a configuration error."""
    rope_scaling: Literal["file", "none", "linear", "yarn"] = "file"
    """RoPE past the trained context: "file" as the model states it (its GGUF metadata or
    config.json); "yarn" or "linear" stretches it `rope_scale` times (llama.cpp's
    `--rope-scaling`), e.g. a Qwen3 at 131072 with "yarn" and 4; "none" turns a stated
    scaling off. Stretched, the model's context is `rope_scale` times the original."""
    rope_scale: Annotated[float, msgspec.Meta(gt=1.0)] = 4.0
    """The stretch of `rope_scaling` "yarn" or "linear" (llama.cpp's `--rope-scale`)."""
    rope_original_context: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The context the model was trained on, for "yarn" (llama.cpp's `--yarn-orig-ctx`);
    0: the model's stated context length."""
    draft: str = ""
    """A smaller model with this one's vocabulary (GGUF file or Hugging Face directory) whose
    greedy tokens are the drafts of `speculation.drafter = "draft_model"`, run on the cpu
    engine; a start with another vocabulary is refused."""

    def chat_template_text(self) -> str | None:
        """The override template's text, or None without one; ConfigError if unreadable."""
        if not self.chat_template:
            return None
        try:
            return Path(self.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ConfigError(
                f"model.chat_template: cannot read {self.chat_template}: {why}"
            ) from None


class ServerConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    """Bind address of the HTTP server."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    """TCP port of the HTTP server (0: any free port)."""
    api_key: str = ""
    """If set, requests need `Authorization: Bearer <api_key>`."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names accepted besides IP literals and `localhost` (DNS-rebinding guard);
    `"*"` accepts any."""
    max_queue: Annotated[int, msgspec.Meta(ge=0)] = 16
    """Requests that may wait for the engine; one more gets 429 with Retry-After."""
    default_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Completion tokens of a chat request that names no max_tokens; 0: what the context
    leaves. (/v1/completions defaults to 16, as OpenAI's does.)"""
    prefill_chunk: Annotated[int, msgspec.Meta(ge=1)] = 128
    """Prompt tokens per prefill step; a cancelled request frees the engine within one."""
    embeddings: Literal["off", "mean", "last"] = "mean"
    """`POST /v1/embeddings`: each input's final-norm hidden states pooled into one
    L2-normalised vector of the model's width, by their `mean` over the input's tokens or the
    `last` token's (for a model trained to embed that way); `off` answers 501. An input is
    computed as a prompt is, on a working KV cache, so it takes no memory a completion would
    not."""
    step_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Tokens one engine step computes at most: a token of every generating request, then
    prompt chunks in arrival order (chunked prefill beside decodes, so a long prompt arriving
    delays the others' next tokens by one chunk's time at most); 0: one prefill chunk plus
    one token per parallel request."""
    parallel: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0
    """Requests generated at once (as llama-server's --parallel): each step computes every
    running request's next tokens in one batch, so N clients share each read of the weights.
    Their KV lives in one pool of blocks (`kv_cache_tokens`), by default the whole context
    of each (N times the memory of one); 1 serves one request at a time, in arrival order.
    0 (auto): on a CPU up to 4, as many as keep those contexts within an eighth of the RAM;
    on a GPU (the offload engine) 16, sharing a pool of the whole contexts that fit in an
    eighth of the free VRAM (at most one each; when it runs short the newest requests give
    their blocks back and compute them again later). The start-up log and `stratactl check`
    say how many and why."""
    kv_cache_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Tokens of keys and values the KV pool holds for every request together. KV is paged:
    a request takes blocks of 32 tokens as it grows and gives them back when it ends, so
    short requests hold little. 0 (auto): the whole context of every request at once
    (`parallel` times `model.max_context`), so none ever waits for KV; with `parallel` auto
    on a GPU, what fits in an eighth of the free VRAM (see `parallel`). Fewer (at least one
    context) lets `parallel` run past what whole contexts would cost: when the pool runs
    short, the newest requests give their blocks back and compute their tokens again once
    there is room (the log says so; their output is what it would have been)."""
    conversation_cache_mib: Annotated[int, msgspec.Meta(ge=0)] = 512
    """Host memory for the KV of recent conversations (prefix reuse across requests)."""
    pinned_prefix_mib: Annotated[int, msgspec.Meta(ge=0)] = 256
    """Host memory for prefixes pinned with the `strata_prefix` request extension."""
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    """On SIGTERM: how long running and queued requests may take before they are cancelled."""
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 15.0
    """A connection with no request under way closes after this long: kept alive between
    requests, or from the connect (or the last answer) to a complete request head, which
    bounds a client that sends its headers slowly."""
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """A request body must arrive within this long of its head; a slower one gets 408 and the
    connection closes."""
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 512
    """Open HTTP connections at most (lowered to what the open-file limit leaves, with a
    WARNING); one more is answered 503 and closed."""
    send_buffer_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1 << 20
    """Bytes of a streamed answer that may wait for a client that reads slowly, in the daemon
    and in the kernel's send buffer each (the kernel caps the latter at net.core.wmem_max); past
    this the stream waits for the client (see send_timeout_s)."""
    send_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """A stream whose client has read nothing of a full send buffer for this long is
    cancelled (its request stops, the connection closes)."""
    sse_keepalive_s: Annotated[float, msgspec.Meta(gt=0)] = 15.0
    """A streamed answer with nothing to send for this long (queued, or a long prefill before
    the first token) gets an SSE comment (`: keep-alive`), so that proxies and clients with
    read timeouts keep the connection."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins (`https://app.example.com`, or `"*"`) allowed to call the API from a
    browser (CORS); empty, the default, sends no CORS headers and answers no preflight."""


class EngineConfig(_Section, frozen=True):
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (the first GPU if there is one)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype; auto is float32 on the CPU and bfloat16 on a GPU."""
    threads: int = 0
    """CPU threads for torch; 0 leaves torch's default (one thread under the cpu engine, whose
    compiled kernels take the cores)."""
    gpus: tuple[int, ...] = ()
    """GPUs of a layer split for the offload engine, e.g. [0, 1]; empty runs on engine.device
    alone. Each GPU runs a contiguous run of layers with its own expert cache."""
    layer_split: str = "auto"
    """Layers per GPU of the split, e.g. "20,28" (or "20": the rest go to the last); auto
    divides them in proportion to each GPU's free VRAM."""
    backend: Literal["auto", "reference", "offload", "cpu"] = "auto"
    """Forward pass: `offload` is the GPU engine for MoE models larger than VRAM (experts in
    VRAM slots, page-locked RAM or the file; misses cross PCIe); `cpu` serves from the GGUF
    blocks on the CPU, every product by the compiled CPU kernels (int8 activations, as
    llama.cpp; experts through the store); `reference` is the torch reference (float copies
    of the weights, experts through the store, any device); `auto` picks offload for a MoE
    on a GPU whose expert types its kernels read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to
    Q6_K, IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, MXFP4: every
    quantized type Strata reads), cpu on a CPU where a C compiler builds the kernels, and says why
    when it cannot."""
    pcie_frac: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | Literal["auto", "balanced"] = (
        "auto"
    )
    """Offload engine: share of the experts a decode step misses in VRAM that the GPU takes
    over PCIe (see gpu_miss); the CPU computes the rest from RAM in parallel with its compiled
    kernels (see cpu_expert_threads). A step with a CPU share waits for each layer's routing
    (its GPU work is captured as two graphs per layer between the waits). `auto`: the
    measured rates' balanced share where this GPU's tuning table records (by an A/B/A run)
    that the split pays (switch `cpu_split`), else 1; `balanced`: that share whatever the
    table says (a link slower than the A/B/A run's: at 25 GB/s, the PCIe 4.0 x16 of most
    desktops, the split decoded 11% faster on the H200's host; at its 55 GB/s, slower);
    the start line logs the share the rates alone would give."""
    cpu_expert_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The largest team of the compiled CPU kernels: the cpu engine's products, and the
    offload engine's CPU share of the missed experts (see pcie_frac); 0 takes engine.threads
    if that is set, else every physical core. Each call shape runs on one thread or on this
    many, whichever measures faster (a busy neighbour can make more threads slower)."""
    cpu_interleave: bool = True
    """The cpu engine copies its dense Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights (the layers'
    projections, the router, the head) once at start into rows interleaved in eights, which
    its kernels read 1.3-3x faster (as llama.cpp repacks Q4_0 and Q4_K; docs/engine.md), and
    makes the expert store's RAM copies of a MoE model's experts in the same layout as it pins
    them (the plan sizes them so). The dense copy lives in RAM and the file's pages it was made
    from are given back; off reads every weight from the file's mapping and pins the experts'
    blobs as they are, for a dense model larger than RAM (the copy would not fit)."""
    gpu_miss: Literal["auto", "copy", "in_place"] = "auto"
    """Offload engine: how the GPU gets the experts a decode step misses in VRAM. `copy`: one
    fetch kernel per layer copies them from page-locked RAM into VRAM staging (it keeps the
    link near the copy engine's rate), then the fused kernel reads VRAM; `in_place`: the
    fused kernel reads them over PCIe itself (no staging VRAM). `auto`: the default recorded
    for this GPU by an A/B/A run in its kernel tuning table, else `copy`."""
    expert_prefetch: bool | Literal["auto"] = "auto"
    """Offload engine, decode: guess each layer's experts one layer early (the next router
    applied to the current hidden state) and copy the guessed misses into VRAM while the
    current layer computes. A wrong guess costs link time, never tokens. `auto`: with the
    copy miss path, the tuning table's recorded default, else on (true needs the copy path);
    only while some experts live outside VRAM."""
    offload_prefill_chunk: Annotated[int, msgspec.Meta(ge=16)] = 4096
    """Prompt tokens per prefill chunk of the offload engine (instead of
    server.prefill_chunk): every chunk streams the experts of every layer over PCIe once, so
    a larger chunk moves fewer bytes per token; a cancelled request frees the engine within
    one chunk."""
    kv_cache: Literal["plain", "int8", "q4"] = "plain"
    """How the offload and cpu engines store keys and values: `plain` in the compute dtype
    (bf16 on a GPU, halves in the cpu engine); `int8` as int8 with a float32 scale per token
    and KV head, read directly by the attention kernels: about half the KV memory, so twice the
    context or the requests in the same memory (the default model's perplexity +0.11% over 8K
    tokens of the Python documentation, bench/results/2026-12-05-kv-ppl-cpu.md); `q4` as 4-bit
    codes with a float16 scale and minimum per 32 values, 0.31 of bf16's bytes, which the
    attention kernels also read directly, at a larger cost in quality (+9.9% perplexity on the
    default model, bench/results/2026-12-07-kv-ppl-q4.json).
    The reference engine keeps plain KV (a start with int8 or q4 on it is refused).
    Conversations set aside in the prefix store are plain KV only: with int8 or q4 they are
    reused from the pool's blocks alone."""
    kv_resident: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Offload engine on a GPU: tokens of each request's newest keys and values kept in VRAM
    (a resident window); its older KV blocks move to page-locked RAM as it grows, and decode
    attention reads them there over PCIe, so the context is bounded by RAM, not VRAM (as the
    upstream engine's --kv-resident). Each decode step then reads the older part of every
    request's KV over the link: at 25 GB/s, 1 GB of it costs about 40 ms a step. 0: all in
    VRAM. At least 64 (two blocks); at or above `model.max_context` it changes nothing. The
    start plan counts the window in VRAM and the rest in RAM; conversations set aside in the
    prefix store are not kept with it (they are reused from the pool's blocks alone)."""
    decode_timing: bool = False
    """Log each request's time per decode step by stage (STRATA_DECODE_TIMING=1 also sets it);
    the same figures go to /metrics. Adds a synchronisation per stage on a GPU."""
    step_ahead: StepAhead = "auto"
    """On a GPU (the offload engine's captured decode steps): when every running request
    decodes with nothing but the sampling filters (greedy or temperature, top-k, top-p,
    min-p; no penalties, bias, log-probabilities, grammar or drafts), draw the tokens and
    queue the next step from them on the GPU before the host reads them, so that the GPU
    computes it while the host samples, streams and plans. The tokens are the same either
    way. `auto`: where every expert is in VRAM (on an H100, the a3b over HTTP, greedy: 300.0
    against 243.0 tok/s at 1 client, 801.8 against 716.7 at 8, 949.6 against 944.7 at 16;
    with 4 GiB of expert VRAM it ran slower, 36.7 and 50.7 at 1 and 8 clients against 49.8
    and 71.1 without in an earlier loan: bench/results/2026-12-06-h100-r21.md); `on`:
    wherever a decode step replays a graph. Sampled requests taking it is not yet timed on a
    GPU."""

    def __post_init__(self) -> None:
        if self.expert_prefetch is True and self.gpu_miss == "in_place":
            raise ValueError('expert_prefetch needs gpu_miss = "copy": it copies its guesses')
        if 0 < self.kv_resident < 64:
            raise ValueError(f"kv_resident {self.kv_resident} is less than two KV blocks (64"
                             " tokens); 0 keeps all of it in VRAM")  # fmt: skip


class ControlConfig(_Section, frozen=True):
    socket: str = "/run/strata/stratad.sock"
    """Path of the control socket that `stratactl` talks to; empty turns the socket off."""
    mode: str = "0660"
    """File mode of the control socket (octal)."""
    group: str = ""
    """Group whose members may use the control socket (besides root and the daemon's user);
    empty: the daemon's own group."""
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """A control connection that sends no request for this long is closed."""
    max_clients: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Control connections open at once, at most."""
    max_clients_per_peer: Annotated[int, msgspec.Meta(ge=1)] = 8
    """Control connections one uid may hold at once, so that no one peer locks the others
    out; one more waits up to a second for one of them to go idle or close, then is
    refused."""


class StoreConfig(_Section, frozen=True):
    """The expert store: tiers, resident sizing, pinning, admission (docs/store.md)."""

    pack: str = ""
    """Pack directory written by `stratactl pack`; empty reads experts from the model file."""
    expert_profile: str = ""
    """Routing profile (JSON) that places the hottest experts first; empty treats all alike."""
    expert_cache: Annotated[int, msgspec.Meta(ge=0)] | Literal["auto"] = "auto"
    """VRAM slots for experts: a number (the total over a layer split's GPUs), or auto (each
    GPU's free VRAM after the engine's own buffers and vram_reserve_gib; 0 on a CPU)."""
    vram_reserve_gib: Annotated[float, msgspec.Meta(ge=0)] = 1.5
    """VRAM left for activations, KV cache and the runtime when expert_cache is auto."""
    cache_policy: Literal["lfru", "lru"] = "lfru"
    """How VRAM slots follow use: lfru (an expert used twice is protected) or lru."""
    admit_on_miss: bool = True
    """An expert routed while not in VRAM takes a slot (the policy evicts another)."""
    resident_budget_gib: Annotated[float, msgspec.Meta(ge=0)] | Literal["auto"] = "auto"
    """RAM for resident expert copies: GiB, or auto = MemTotal (or the cgroup limit) minus
    resident_headroom_gib, reserve_runtime_gib, the dense weights, the working KV caches where
    they are in RAM (no GPU) and the server's host caches."""
    resident_headroom_gib: Annotated[float, msgspec.Meta(ge=0)] = 4.0
    """RAM left to the rest of the host (STRATA_RESIDENT_HEADROOM_GIB); re-check it after a
    GPU runtime upgrade (one ROCm release kept 1 GiB more host RAM than the one before)."""
    reserve_runtime_gib: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """Host RAM the process, torch and the GPU runtime hold; subtracted by the auto budget."""
    lock: Literal["auto", "gpu", "mlock", "none"] = "auto"
    """Page-locking of resident copies: auto (the GPU runtime on a GPU, else mlock), gpu,
    mlock or none."""
    pin_chunk_mib: Annotated[int, msgspec.Meta(ge=1)] = 64
    """The resident set is page-locked in chunks of at most this many MiB."""
    pin_rate_gbps: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """Cap on the pinning rate in GB/s, so that the host stays responsive; 0 is unpaced."""
    ready_after_pinning: bool = False
    """Ready only once the resident set is pinned; else at once (unpinned experts come from
    the file meanwhile)."""
    on_short_ram: Literal["degrade", "refuse"] = "degrade"
    """MemAvailable still short of the plan after admission_wait_s: degrade (fewer resident
    experts, one WARNING with the cost) or refuse (exit code 75)."""
    admission_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    """How long to wait at start for the RAM the plan needs."""
    admission_backoff_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """First retry interval while waiting for RAM; it doubles, up to 10 s."""


class SpeculationConfig(_Section, frozen=True):
    """Speculative decoding: drafted tokens verified in one step (docs/engine.md)."""

    drafter: Literal["auto", "off", "prompt_lookup", "suffix", "draft_model"] = "auto"
    """Where drafts come from: `prompt_lookup` proposes the tokens that followed the latest
    earlier occurrence of the sequence's last 2-4 tokens in its prompt and output (llama.cpp's
    lookup decoding: pays where the answer repeats its input, as code edits, quotes and
    schema filling do); `suffix` does that first, else proposes what most often followed the
    sequence's last 2-8 tokens in the recent answers of its API key and user (vLLM's suffix
    decoding: pays where clients ask again for text of one shape, as agent loops, tool calls
    and retries do); `draft_model` proposes the greedy tokens of `model.draft`, a smaller model
    of the same vocabulary (llama.cpp's draft model; pays where that model is much cheaper and
    often agrees); `off` drafts nothing; `auto`: prompt_lookup on the cpu engine (the
    default model on a 2-core VM: 1.0-1.9x, bench/results/2026-12-05-spec-cpu.md), off on a
    GPU, where a drafted token costs 0.5-0.8 of a decode step (its rows route to more experts)
    and an oracle drafter paid only at 90% acceptance with one token (1.09-1.32x; 0.85x at 60%
    with experts off the GPU: bench/results/2026-12-05-h100-r16.md). Greedy output is the
    same either way; sampled output keeps the model's distribution."""
    max_draft: Annotated[int, msgspec.Meta(ge=1, le=16)] = 8
    """Tokens drafted per sequence and step at most."""
    token_cost: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2
    """What verifying one more drafted token costs, as a share of a decode step, until the
    engine's own steps measured it (steps of as many sequences with drafts and without: 0.4
    to 0.8 for 1 to 8 drafts on the 2-core VM's cpu engine, 0.5 to 1.3 on the H100). A sequence
    drafts a j-th token while the share of its checked drafted tokens that stood (a verify
    checks them up to the first miss), to the power j, exceeds the cost, and stops drafting
    for a while when even one token would not pay."""


class LogConfig(_Section, frozen=True):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""


class Config(_Section, frozen=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
    speculation: SpeculationConfig = msgspec.field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        if self.speculation.drafter == "draft_model" and not self.model.draft:
            raise ValueError('speculation.drafter = "draft_model" needs model.draft')


def _invalid(e: msgspec.ValidationError, prefix: str = "") -> str:
    """msgspec's "Expected `int` <= 65535 - at `$.server.port`" as "server.port: expected
    an int <= 65535"."""
    text = str(e)
    m = re.fullmatch(r"(.*) - at `\$\.(.+)`", text)
    if m is None:
        return text
    what = m.group(1)[:1].lower() + m.group(1)[1:]
    what = re.sub(r"`(int|float|str|bool)`", r"\1", what)
    return f"{prefix}{m.group(2)}: {what}"


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        return msgspec.toml.decode(text, type=Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_invalid(e)}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None


def load_config(path: Path | None, env: Env) -> Config:
    """The file (if any) with the environment's overrides applied."""
    if path is None and env.config:
        path = Path(env.config)
    if path is None and DEFAULT_CONFIG_PATH.is_file():
        path = DEFAULT_CONFIG_PATH
    config = Config()
    if path is not None:
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        config = parse_config(text, str(path))
    config = apply_env(config, env)
    config.model.chat_template_text()  # an unreadable override fails the start, not a request
    return config


def apply_env(config: Config, env: Env) -> Config:
    if env.model:
        config = msgspec.structs.replace(
            config, model=msgspec.structs.replace(config.model, path=env.model)
        )
    if env.device:
        config = msgspec.structs.replace(
            config, engine=msgspec.structs.replace(config.engine, device=env.device)
        )
    if env.control_socket is not None:
        config = msgspec.structs.replace(
            config, control=msgspec.structs.replace(config.control, socket=env.control_socket)
        )
    if env.resident_headroom_gib is not None:
        headroom = env.resident_headroom_gib
        store = msgspec.structs.replace(config.store, resident_headroom_gib=headroom)
        config = msgspec.structs.replace(config, store=store)
    if env.decode_timing:
        config = msgspec.structs.replace(
            config, engine=msgspec.structs.replace(config.engine, decode_timing=True)
        )
    if env.log_level:
        level = env.log_level.upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(
                f"STRATA_LOG_LEVEL={env.log_level!r}: expected DEBUG, INFO, WARNING or ERROR"
            )
        config = msgspec.structs.replace(config, log=LogConfig(level=level))  # type: ignore[arg-type]
    return config


def override(config: Config, section: str, **values: object) -> Config:
    """A copy with some keys of one section replaced (command-line flags)."""
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return config
    current = getattr(config, section)
    try:
        updated = msgspec.convert(msgspec.structs.asdict(current) | values, type=type(current))
    except msgspec.ValidationError as e:
        raise ConfigError(_invalid(e, f"{section}.")) from None
    return msgspec.structs.replace(config, **{section: updated})
