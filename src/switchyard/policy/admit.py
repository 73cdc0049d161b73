"""Admission decisions: what a request may reserve, and how a refusal reads.

Pure functions over the request body, the principal and the limiter's verdict; the
gateway wires them to the limiter and the ledger.
"""

from __future__ import annotations

import math
from typing import Any

from switchyard.config import ModelConfig, Price
from switchyard.errors import RateLimited, SwitchyardError
from switchyard.policy.keys import Limits, Principal
from switchyard.policy.limits import Period, ScopeLimits, Verdict


class QuotaExceeded(RateLimited):
    code = "insufficient_quota"


def _text_len(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap estimate leaning high (≈3 characters per token plus framing) used
    for reservations; the real count from the upstream replaces it at settle."""
    if "messages" in body:
        chars = sum(_text_len(m.get("content")) for m in body["messages"] if isinstance(m, dict))
        return chars // 3 + 8 * len(body["messages"]) + 8
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return sum(len(str(p)) for p in prompt) // 3 + 8
    return len(str(prompt or "")) // 3 + 8


class PromptOverhead:
    """Tokens a model's prompts carry beyond what `estimate_prompt_tokens` counts (its
    chat template, a default system prompt the template adds), learned from replies:
    the largest excess an upstream reported per model. Added to every reservation's
    estimate, so that a budget is not overshot by prompts that cost more than their
    text. Until a model's first reply with usage, its estimate has no overhead."""

    def __init__(self, cap: int = 4096) -> None:
        self.tokens: dict[str, int] = {}  # per configured alias
        self.cap = cap  # an upstream's odd count cannot make every estimate absurd

    def get(self, alias: str) -> int:
        return self.tokens.get(alias, 0)

    def observe(self, alias: str, body: dict[str, Any], reported: int) -> None:
        excess = min(reported - estimate_prompt_tokens(body), self.cap)
        if excess > self.tokens.get(alias, 0):
            self.tokens[alias] = excess


def max_output_tokens(body: dict[str, Any], default: int) -> int:
    v = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(v) if isinstance(v, int) and v > 0 else default


def cost_usd(price: Price, input_tokens: int, output_tokens: int) -> float:
    return (input_tokens * price.input + output_tokens * price.output) / 1_000_000


def _limited(lim: Limits) -> bool:
    return not (
        lim.rpm is None
        and lim.tpm is None
        and lim.max_concurrency is None
        and lim.budget_usd is None
    )


def _scope(name: str, lim: Limits) -> ScopeLimits:
    period: Period = "month" if lim.budget_period == "month" else "day"
    return ScopeLimits(name, lim.rpm, lim.tpm, lim.max_concurrency, lim.budget_usd, period)


def principal_scopes(p: Principal) -> list[ScopeLimits]:
    """Key first, then tenant: the most specific refusal is reported."""
    out = []
    if _limited(p.key_limits):
        out.append(_scope(f"key:{p.key_id}", p.key_limits))
    if _limited(p.tenant_limits):
        out.append(_scope(f"tenant:{p.tenant_id}", p.tenant_limits))
    return out


def deployment_scope(model: ModelConfig) -> list[ScopeLimits]:
    lim = model.limits
    if lim.rpm is None and lim.tpm is None:
        return []
    return [ScopeLimits(f"deployment:{model.alias}", rpm=lim.rpm, tpm=lim.tpm)]


def _fmt_s(s: float) -> str:
    return f"{max(0.0, s):.3f}s"


def rate_headers(verdict: Verdict) -> dict[str, str]:
    """OpenAI-style x-ratelimit-* headers from the tightest scope of each kind."""
    h: dict[str, str] = {}
    req = [i for i in verdict.state.values() if "limit_requests" in i]
    if req:
        tight = min(req, key=lambda i: i["remaining_requests"])
        h["x-ratelimit-limit-requests"] = str(int(tight["limit_requests"]))
        h["x-ratelimit-remaining-requests"] = str(int(tight["remaining_requests"]))
        h["x-ratelimit-reset-requests"] = _fmt_s(tight["reset_requests_s"])
    tok = [i for i in verdict.state.values() if "limit_tokens" in i]
    if tok:
        tight = min(tok, key=lambda i: i["remaining_tokens"])
        h["x-ratelimit-limit-tokens"] = str(int(tight["limit_tokens"]))
        h["x-ratelimit-remaining-tokens"] = str(int(tight["remaining_tokens"]))
        h["x-ratelimit-reset-tokens"] = _fmt_s(tight["reset_tokens_s"])
    return h


def refusal(verdict: Verdict) -> SwitchyardError:
    retry = verdict.retry_after_s
    headers = rate_headers(verdict)
    if math.isfinite(retry):
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    scope = verdict.scope or "?"
    if verdict.limit == "budget":
        return QuotaExceeded(
            f"budget exhausted for {scope}; it resets in {retry:.0f}s", headers=headers
        )
    if verdict.limit == "tpm" and not math.isfinite(retry):
        return RateLimited(
            f"the request needs more tokens than the tokens-per-minute limit of {scope}; "
            "lower max_tokens",
            code="tokens_exceed_limit",
            headers=headers,
        )
    what = {
        "rpm": "requests per minute",
        "tpm": "tokens per minute",
        "concurrency": "concurrent requests",
    }
    return RateLimited(
        f"rate limit reached for {scope}: {what.get(verdict.limit or '', verdict.limit)}",
        code=f"rate_limit_{verdict.limit}",
        headers=headers,
    )
