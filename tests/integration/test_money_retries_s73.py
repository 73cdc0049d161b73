"""Money when a request makes a further upstream call after one that may have been
billed (s73): a retry, or a fallback, after a non-streamed call that timed out.

Defect these tests find (each failed before its fix in execute/executor.py
`Executor._covered`, policy/stages_admission.py `Reserver.extend` and settle.py
`Settler._charge`): a provider bills every call that may have generated (a
non-streamed generation runs to its end server-side after the gateway leaves), but a
request reserved one prompt and one output cap, once, whatever its retries and
fallbacks, and was billed one prompt and one cap however many of its calls were cut.
A request whose first call timed out was retried (or fell back) with nothing more
reserved: under a budget that holds one request's reservation, the tenant's real spend
passed its budget, and the ledger showed half of it. Now a further call first extends
the reservation by one more call's estimate, or is refused (`retry` `denied:budget`),
and each cut call is billed its prompt and cap.

Also here: the memory and Redis limiters hold and give back a further call's hold
(`spend_scopes`) alike, over generated sequences, and hold nothing once all is settled.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.cut_calls import CAP, NO_STORE, PRICE, STEADY, decisions
from support.gateways import Gateway, start_gateway
from support.upstreams import Scripted
from switchyard.state.limits import Ask, ScopeLimits, Verdict, spend_scopes
from switchyard.state.limits_memory import MemoryLimiter
from switchyard.state.limits_redis import RedisLimiter


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    """`slow`: the scripted upstream at PRICE, a 1 s attempt timeout, one retry;
    `first`: a tenth of PRICE, a 1 s timeout, no retry, falling back to `dear` (PRICE,
    a 1 s timeout): `first`'s chain reserves at `dear`'s price."""
    engine = {"kind": "openai", "base_url": scripted.url + "/v1"}
    timeouts = {"first_byte_s": 1.0}
    models = [
        {
            "alias": "slow",
            "engine": engine,
            "price": PRICE,
            "timeouts": timeouts,
            "resilience": {"retries": 1, **STEADY},
        },
        {
            "alias": "first",
            "engine": engine,
            "price": {"input": 0.0, "output": 100.0},
            "timeouts": timeouts,
            "resilience": {"retries": 0, **STEADY},
            "fallbacks": ["dear"],
        },
        {
            "alias": "dear",
            "engine": engine,
            "price": PRICE,
            "timeouts": timeouts,
            "resilience": {"retries": 0, **STEADY},
        },
    ]
    g = start_gateway({"models": models, "embeddings": {"enabled": False}})
    yield g
    g.proc.stop()


def _post(
    gw: Gateway, scripted: Scripted, key: str, model: str, hangs: int, cap: int = CAP
) -> tuple[httpx.Response, int]:
    """POST a non-streamed chat call for `model` while the upstream hangs (never
    answers) on its next `hangs` calls: the response and the upstream calls it made."""
    before = scripted.requests()
    scripted.fault("hang", count=hangs)
    try:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": cap}
        r = gw.post("/v1/chat/completions", key=key, json=body, headers=NO_STORE)
    finally:
        scripted.fault("hang", count=0)
    return r, scripted.requests() - before


def _prompt(gw: Gateway, r: httpx.Response) -> int:
    """The prompt tokens the request reserved (its admission's tokens less the cap)."""
    [admit] = decisions(gw, r, "admit")
    return int(admit["evidence"]["reserved_tokens"]) - CAP


def test_a_retry_after_a_timeout_is_refused_when_the_budget_holds_one_call(
    gw: Gateway, scripted: Scripted
) -> None:
    """A $0.50 budget holds one 500-token call of `slow`. Its call times out: the
    retry is refused (`retry` `denied:budget`), so the upstream is called once, and
    the request ends 504 billed that one call's prompt and cap ($0.50), never more
    than the budget. (Before: the retry was made, a second call the provider bills,
    with the row billing one.)"""
    tenant, key = gw.new_tenant("s73k-one", budget_usd=0.5)
    r, calls = _post(gw, scripted, key, "slow", hangs=2)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "upstream_timeout", r.text
    assert calls == 1
    [denied] = [d for d in decisions(gw, r, "retry") if d["outcome"] == "denied:budget"]
    assert denied["evidence"]["reservation"] == "not extended", denied
    assert (denied["evidence"]["limit"], denied["evidence"]["calls_billed"]) == ("budget", 1)
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"]) == ("error", 1), row
    assert row["output_tokens"] == CAP, row
    assert row["input_tokens"] == _prompt(gw, r) > 0, row
    assert row["cost_usd"] == pytest.approx(0.5), row
    [estimated] = decisions(gw, r, "settle")
    assert estimated["outcome"] == "estimated", estimated
    assert estimated["evidence"] == {
        "input_tokens": row["input_tokens"],
        "output_tokens": CAP,
        "attempts_billed": 1,
        "why": "cut",
    }


def test_a_retry_that_fits_runs_each_call_is_billed_and_nothing_stays_held(
    gw: Gateway, scripted: Scripted
) -> None:
    """A $1.20 budget holds two calls: the retry runs after the reservation is
    extended (`retry` `extended`, $0.50 more), both calls time out, and the row bills
    both ($1.00: two prompts, two caps). What the extension held is given back: a
    200-token call ($0.20, exactly what is left) is admitted whole (no cap shrunk).
    (Before: the row billed one call, $0.50.)"""
    tenant, key = gw.new_tenant("s73k-two", budget_usd=1.2)
    r, calls = _post(gw, scripted, key, "slow", hangs=2)
    assert r.status_code == 504, r.text
    assert calls == 2
    [extended] = [d for d in decisions(gw, r, "retry") if d["outcome"] == "extended"]
    assert extended["evidence"]["reserved_usd"] == pytest.approx(0.5), extended
    assert extended["evidence"]["calls_reserved"] == 2, extended
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"]) == ("error", 2), row
    assert row["output_tokens"] == 2 * CAP, row
    assert row["input_tokens"] == 2 * _prompt(gw, r), row
    assert row["cost_usd"] == pytest.approx(1.0), row
    [estimated] = decisions(gw, r, "settle")
    assert estimated["evidence"]["attempts_billed"] == 2, estimated

    rest, calls = _post(gw, scripted, key, "slow", hangs=0, cap=200)
    assert rest.status_code == 200, rest.text
    [admit] = decisions(gw, rest, "admit")
    assert admit["outcome"] == "admitted", admit  # not admitted:cap_shrunk
    assert admit["evidence"]["reserved_usd"] == pytest.approx(0.2), admit
    rows = gw.stored_rows(tenant, 2)
    assert sum(float(x["cost_usd"]) for x in rows) <= 1.2 + 1e-9, rows


def test_a_retry_that_answers_bills_the_cut_call_and_the_answer(
    gw: Gateway, scripted: Scripted
) -> None:
    """The first call times out and the retry answers: the row bills the cut call's
    prompt and cap and the answer's own usage. (Before: the answer's usage alone.)"""
    tenant, key = gw.new_tenant("s73k-answer", budget_usd=5.0)
    r, calls = _post(gw, scripted, key, "slow", hangs=1)
    assert r.status_code == 200, r.text
    assert calls == 2
    assert r.headers["x-switchyard-attempts"] == "2"
    usage = r.json()["usage"]
    [row] = gw.stored_rows(tenant, 1)
    assert (row["status"], row["attempts"]) == ("ok", 2), row
    assert row["output_tokens"] == CAP + usage["completion_tokens"], row
    assert row["input_tokens"] == _prompt(gw, r) + usage["prompt_tokens"], row
    assert row["cost_usd"] == pytest.approx((CAP + usage["completion_tokens"]) / 1000), row
    [estimated] = decisions(gw, r, "settle")
    assert estimated["evidence"]["attempts_billed"] == 2, estimated
    assert estimated["evidence"]["why"] == "cut", estimated


def test_a_fallback_after_a_cut_call_follows_the_same_rules(
    gw: Gateway, scripted: Scripted
) -> None:
    """`first` times out; its fallback `dear` is a further call. Under $0.50 (one call
    at the chain's price) it is refused: one upstream call, 504, billed `first`'s cut
    call at `first`'s price ($0.05). Under $1.00 it runs and answers: the row bills
    the cut call ($0.05) and `dear`'s usage. (Before: the fallback ran under $0.50,
    and each row billed the answer alone.)"""
    tenant, key = gw.new_tenant("s73k-fb-one", budget_usd=0.5)
    r, calls = _post(gw, scripted, key, "first", hangs=2)
    assert r.status_code == 504, r.text
    assert calls == 1
    [denied] = [d for d in decisions(gw, r, "retry") if d["outcome"] == "denied:budget"]
    assert denied["evidence"]["next"] == "dear", denied
    [row] = gw.stored_rows(tenant, 1)
    assert (row["output_tokens"], row["attempts"]) == (CAP, 1), row
    assert row["cost_usd"] == pytest.approx(0.05), row

    tenant, key = gw.new_tenant("s73k-fb-two", budget_usd=1.0)
    r, calls = _post(gw, scripted, key, "first", hangs=1)
    assert r.status_code == 200, r.text
    assert calls == 2
    assert r.headers["x-switchyard-fallback"], r.headers
    out = r.json()["usage"]["completion_tokens"]
    [row] = gw.stored_rows(tenant, 1)
    assert row["output_tokens"] == CAP + out, row
    assert row["cost_usd"] == pytest.approx(0.05 + out / 1000), row
    assert [d["outcome"] for d in decisions(gw, r, "retry")] == ["extended"]


# -- the limiters: a further call's hold, memory and Redis alike ---------------------

T0 = 1_750_000_000.0  # far from a day boundary
KEY = ScopeLimits("key:x", rpm=1000, tpm=6000, max_concurrency=3, budget_usd=2.0)
TENANT = ScopeLimits("tenant:x", tpm=9000, budget_usd=3.0, budget_period="month")
DEP = ScopeLimits("deployment:x", rpm=1000, max_concurrency=2)
SHAPES = [[KEY, TENANT, DEP], [TENANT, DEP], [KEY], [DEP]]

# A request: its shape, reserved tokens and cost, how many further calls it holds
# for, and what it used (fractions of all it holds).
requests = st.tuples(
    st.integers(0, len(SHAPES) - 1),
    st.sampled_from([100, 800, 2500]),
    st.sampled_from([0.05, 0.3, 0.9]),
    st.integers(0, 3),
    st.floats(0, 1),
    st.floats(0, 1),
)


def _same(mem: Verdict, red: Verdict) -> None:
    assert (red.allowed, red.scope, red.limit) == (mem.allowed, mem.scope, mem.limit)
    assert red.state.keys() == mem.state.keys()
    for scope, info in mem.state.items():
        assert red.state[scope] == pytest.approx(info, abs=1e-9), scope


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=st.lists(requests, min_size=2, max_size=12), data=st.data())
def test_a_further_calls_hold_is_held_and_given_back_alike(
    redis_url: str, plan: list[tuple[int, int, float, int, float, float]], data: st.DataObject
) -> None:
    """Requests reserved, extended (`spend_scopes`: tpm and budget only, a hold of its
    own) and settled (the charge on the first hold, 0 on the others, as
    `Reserver.settle` does), overlapping in any order: the memory and Redis limiters
    give the same verdicts, and once every request is settled each budget has all
    but what was charged, and every concurrency slot is free."""
    prefix = f"s73k{uuid.uuid4().hex[:8]}:"
    spent = {"key:x": 0.0, "tenant:x": 0.0}  # what was charged, per budget
    Holds = list[tuple[list[ScopeLimits], Ask]]

    async def settle(
        mem: MemoryLimiter, red: RedisLimiter, req: tuple[Holds, float, float], t: float
    ) -> None:
        holds, used, paid = req
        tokens = int(sum(a.tokens for _, a in holds) * used)
        cost = sum(a.cost_usd for _, a in holds) * paid
        for i, (scopes, ask) in enumerate(holds):
            real = (tokens, cost) if i == 0 else (0, 0.0)
            await mem.settle(scopes, ask, *real, now=t)
            await red.settle(scopes, ask, *real, now=t)
        for lim in holds[0][0]:
            if lim.scope in spent:
                spent[lim.scope] += cost

    async def main() -> None:
        mem, red = MemoryLimiter(), RedisLimiter(redis_url, prefix=prefix)
        try:
            held: list[tuple[Holds, float, float]] = []
            t = T0
            for n, (shape, tokens, usd, further, used, paid) in enumerate(plan):
                scopes = SHAPES[shape]
                ask = Ask(f"r{n}#admit", tokens, usd)
                m = await mem.reserve(scopes, ask, now=t)
                _same(m, await red.reserve(scopes, ask, now=t))
                if m.allowed:
                    holds: Holds = [(scopes, ask)]
                    spend = spend_scopes(scopes)
                    for k in range(1, further + 1 if spend else 1):
                        more = Ask(f"{ask.request_id}+{k}", tokens, usd)
                        m = await mem.reserve(spend, more, now=t)
                        _same(m, await red.reserve(spend, more, now=t))
                        if m.allowed:
                            holds.append((spend, more))
                    held.append((holds, used, paid))
                settle_one: bool = data.draw(st.booleans(), label="settle one")
                if held and settle_one:
                    i = data.draw(st.integers(0, len(held) - 1), label="which")
                    await settle(mem, red, held.pop(i), t)
                t += data.draw(st.sampled_from([0.0, 0.5, 7.0, 31.0]), label="wait")
            for req in held:
                await settle(mem, red, req, t)
            # Nothing held: each budget has all but what was charged, the same in both,
            # and every concurrency slot is free (the deployment's two, then none).
            big = Ask("big", 10**9, 10**6)
            m = await mem.reserve(SHAPES[0], big, now=t)
            _same(m, await red.reserve(SHAPES[0], big, now=t))
            for scope, budget in (("key:x", 2.0), ("tenant:x", 3.0)):
                left = max(0.0, budget - spent[scope])
                assert m.state[scope]["budget_remaining_usd"] == pytest.approx(left), scope
            verdicts = []
            for i in range(3):
                probe = Ask(f"probe{i}", 0, 0.0)
                m = await mem.reserve([KEY, DEP], probe, now=t)
                _same(m, await red.reserve([KEY, DEP], probe, now=t))
                verdicts.append((m.allowed, m.scope, m.limit))
            assert verdicts == [
                (True, None, None),
                (True, None, None),
                (False, "deployment:x", "concurrency"),
            ]
        finally:
            await red.close()

    asyncio.run(main())
