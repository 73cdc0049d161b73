"""LoRA adapters, each served as a model of its own over a local base model."""

from __future__ import annotations

from pydantic import Field, model_validator

from switchyard.config.base import ALIAS_PATTERN, Strict

# The project's demonstration LoRA adapters (engines/lora_train.py), named by path.
DEMO_PREFIX = "demo:"
DEMO_ADAPTERS = ("pirate", "robot")


class AdapterConfig(Strict):
    """A LoRA adapter for a local model, named by clients as the model."""

    name: str = Field(pattern=ALIAS_PATTERN)
    """The name clients send as `model` for this adapter; unique among model aliases."""
    base: str
    """Alias of the model it was trained on: a llamacpp model on the server runtime or a vllm model,
    with a single engine."""
    base_revision: str
    """The base model's revision it was trained on; must equal that model's `revision`."""
    path: str
    """On local disk, never fetched: a GGUF LoRA file for llama.cpp, a PEFT adapter folder for vLLM.
    Or `demo:pirate` / `demo:robot`: the project's demonstration adapters for the shipped SmolLM2,
    trained on first use and cached."""
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 checked before every load (for a vLLM folder, of its adapter_model.safetensors);
    required for a file of your own, left out for a `demo:` adapter."""
    revision: str = "unversioned"
    """Free-text revision of the adapter, reported in `x-switchyard-adapter-revision`."""
    allowed_tenants: list[str] = []
    """Tenant ids that may use it (`*` = every tenant); the key's `allowed_adapters` must allow it
    too."""

    @property
    def demo(self) -> str | None:
        """The demonstration adapter this names, if it names one."""
        return self.path.removeprefix(DEMO_PREFIX) if self.path.startswith(DEMO_PREFIX) else None

    @property
    def digest(self) -> str:
        """The sha256 to check before a load (a demonstration adapter's once trained)."""
        if self.sha256 is None:
            raise ValueError(
                f"adapter {self.name}: {self.path} is not trained yet "
                "(switchyard.engines.lora_train.resolve makes it)"
            )
        return self.sha256

    @model_validator(mode="after")
    def _named_or_pinned(self) -> AdapterConfig:
        if self.demo is not None:
            if self.demo not in DEMO_ADAPTERS:
                raise ValueError(
                    f"path: {self.path!r} names no demonstration adapter; there are "
                    + ", ".join(DEMO_PREFIX + d for d in DEMO_ADAPTERS)
                )
            if self.sha256 is not None:
                raise ValueError(
                    "sha256: a demonstration adapter is made by the gateway, which checks "
                    "its own sha256; leave it out"
                )
        elif self.sha256 is None:
            raise ValueError("sha256: required for an adapter file (the gateway checks it)")
        return self
