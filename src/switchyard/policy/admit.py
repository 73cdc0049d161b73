"""Admission decisions: what a request may reserve, and how a refusal reads.

Pure functions over the request body, the principal and the limiter's verdict; the
gateway wires them to the limiter and the ledger.
"""

from __future__ import annotations

import math

from switchyard.config import ModelConfig, Price
from switchyard.errors import QuotaExceeded, RateLimited, SwitchyardError, TokensExceedLimit
from switchyard.identity import Limits, Principal
from switchyard.state.limits import Period, ScopeLimits, Verdict


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
    return f"{s if s > 0.0 else 0.0:.3f}s"


def rate_headers(verdict: Verdict) -> dict[str, str]:
    """OpenAI-style x-ratelimit-* headers from the tightest scope of each kind, of the
    key's and its tenant's own: a deployment's window is every tenant's traffic, so
    its remaining count would let one tenant count another's requests."""
    req = tok = None
    for scope, i in verdict.state.items():
        if scope.startswith("deployment:"):
            continue
        if "limit_requests" in i and (
            req is None or i["remaining_requests"] < req["remaining_requests"]
        ):
            req = i
        if "limit_tokens" in i and (tok is None or i["remaining_tokens"] < tok["remaining_tokens"]):
            tok = i
    h: dict[str, str] = {}
    if req is not None:
        h["x-ratelimit-limit-requests"] = str(int(req["limit_requests"]))
        h["x-ratelimit-remaining-requests"] = str(int(req["remaining_requests"]))
        h["x-ratelimit-reset-requests"] = _fmt_s(req["reset_requests_s"])
    if tok is not None:
        h["x-ratelimit-limit-tokens"] = str(int(tok["limit_tokens"]))
        h["x-ratelimit-remaining-tokens"] = str(int(tok["remaining_tokens"]))
        h["x-ratelimit-reset-tokens"] = _fmt_s(tok["reset_tokens_s"])
    return h


def refusal(verdict: Verdict) -> SwitchyardError:
    retry = verdict.retry_after_s
    headers = rate_headers(verdict)
    if math.isfinite(retry):
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    scope = verdict.scope or "?"
    if verdict.limit == "budget":
        left = verdict.state.get(scope, {}).get("budget_remaining_usd")
        left_s = f": ${left:.6f} left, less than this request needs" if left is not None else ""
        return QuotaExceeded(
            f"budget exhausted for {scope}{left_s}; it resets in {retry:.0f}s", headers=headers
        )
    if verdict.limit == "tpm" and not math.isfinite(retry):
        return TokensExceedLimit(
            f"the request needs more tokens than the tokens-per-minute limit of {scope}; "
            "lower max_tokens",
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


class FullWindows:
    """The scopes whose requests-per-minute window a reserve found full, and until when
    (the limiter's own answer: `Verdict.retry_after_s`), so that another request of the
    key or tenant is refused before its body is read (`refused`, asked by
    service.py `begin`): a client that keeps calling past its limit (an agent's loop
    retrying without backing off) costs no body read, parse, validation or count.

    Exact, not a guess: nothing gives a request back to an rpm window (a settle only
    adjusts tokens, concurrency and budget), so a window the limiter found full stays
    full until its oldest requests age out, whichever process asks; a refusal of tokens,
    concurrency or budget can end sooner (a settle gives back) and is not kept. Kept with
    the limit it was found at: a limit changed since (the admin API) is asked again.
    One per gateway process, shared by its reservers; bounded."""

    MAX = 4096

    def __init__(self) -> None:
        # scope -> (until, in time.time() seconds as the limiters count; its rpm then)
        self.until: dict[str, tuple[float, int]] = {}

    def note(self, verdict: Verdict, scopes: list[ScopeLimits], now: float) -> None:
        """A refusal `verdict` of a reserve against `scopes`, if its rpm's."""
        retry = verdict.retry_after_s
        if verdict.limit != "rpm" or not math.isfinite(retry) or retry <= 0.0:
            return
        rpm = next((s.rpm for s in scopes if s.scope == verdict.scope), None)
        if rpm is None or verdict.scope is None:
            return
        if len(self.until) >= self.MAX:
            self.until.clear()
        self.until[verdict.scope] = (now + retry, rpm)

    def refused(self, p: Principal, now: float) -> tuple[SwitchyardError, str, float] | None:
        """(the refusal, its scope, seconds left) if a scope of `p` is known full now."""
        until = self.until
        for lim in principal_scopes(p):
            noted = until.get(lim.scope)
            if noted is None:
                continue
            end, rpm = noted
            if end <= now or rpm != lim.rpm:
                del until[lim.scope]  # aged out, or the limit changed: the limiter decides
                continue
            left = end - now
            state = {"limit_requests": rpm, "remaining_requests": 0, "reset_requests_s": left}
            verdict = Verdict(False, lim.scope, "rpm", left, {lim.scope: state})
            return refusal(verdict), lim.scope, left
        return None
