"""Serving inside RL training: rollout limits, revisions of local models and the checks a
revision must pass, the rollout store."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from switchyard.config.base import Strict


class RlValidationPrompt(Strict):
    """One validation prompt a revision must pass before it may become active: greedy
    decoding of `prompt` (text) or `messages` (chat, the engine's template)."""

    prompt: str | None = Field(None, max_length=4000)
    """A text prompt, completed greedily; give exactly one of `prompt` and `messages`."""
    messages: list[dict[str, Any]] | None = Field(None, max_length=32)
    """A chat conversation (OpenAI messages), rendered with the engine's chat template; give exactly
    one of `prompt` and `messages`."""
    max_tokens: int = Field(16, ge=1, le=256)
    """Tokens generated for the check."""
    expect_any: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    """One of these must appear in the output (case-insensitive); [] = no check."""
    forbid: list[Annotated[str, Field(min_length=1, max_length=200)]] = []
    """None of these may appear in the output (case-insensitive)."""
    min_mean_logprob: float = Field(-6.0, le=0)
    """Every generated token's logprob must be finite and <= 0, and their mean at least this."""

    @model_validator(mode="after")
    def _one_prompt(self) -> RlValidationPrompt:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


def _default_validation() -> list[RlValidationPrompt]:
    return [RlValidationPrompt(prompt="The capital of France is", max_tokens=8)]


class RlModel(Strict):
    """A local model whose revisions the RL lifecycle manages (rl.models[alias])."""

    validation: list[RlValidationPrompt] = Field(
        default_factory=_default_validation, min_length=1, max_length=32
    )
    """Prompts a new revision must pass before it may become active."""
    drain_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """Seconds a draining revision may take to finish its admitted rollouts before its engine is
    stopped anyway (its records then end with finish_reason `error`)."""


class RlConfig(Strict):
    """Serving inside RL training (capability 12): `POST /v1/rollouts`, revisions of a
    local model that activate behind a barrier, the rollout store."""

    weights_dirs: list[str] = []
    """Directories new revisions' weights may load from (llama.cpp: GGUF files and GGUF LoRA
    adapters; vLLM: PEFT adapter folders), symlinks resolved; [] = loading new weights is off."""
    models: dict[str, RlModel] = {}
    """Local models whose revisions the RL lifecycle manages, by alias (llamacpp on the server
    runtime, or vllm)."""
    max_prompts: int = Field(64, ge=1, le=4096)
    """Prompts per rollout request."""
    max_n: int = Field(16, ge=1, le=256)
    """Samples per prompt (`n`) of a rollout request."""
    max_samples: int = Field(256, ge=1, le=65_536)
    """Samples per rollout request (prompts x n)."""
    max_tokens: int = Field(1024, ge=1, le=32_768)
    """Tokens generated per sample."""
    max_top_logprobs: int = Field(5, ge=0, le=20)
    """Largest `top_logprobs` a rollout request may ask for."""
    max_prompt_chars: int = Field(32_000, ge=1, le=1_000_000)
    """Characters per prompt (a text prompt, or a chat's message contents together)."""
    max_weights_mb: float = Field(16_384.0, gt=0)
    """Largest weights file a revision may register, in MiB."""
    store: bool = True
    """Keep each rollout record in the rollout store for `switchyard rollouts export`; a record
    whose text holds PII is stored masked, without token ids."""
    retention_days: float = Field(30.0, gt=0)
    """Days a stored rollout record is kept."""
