"""The response cache against what answered and what the client asked: adapters,
routed aliases, the revision a hit names, a reasoning model's thinking, Cache-Control
values, the fields of the last user message and the invalidation's filters. Over
sockets against one real gateway in front of two scripted upstreams and a hostile
upstream of tests/support/hostile_upstream.py that answers as a reasoning model does
(`reasoning_content` beside the answer, whole or streamed); the adapter keys are read
from the planner the gateway builds, over the registry's own deployments (an adapter
needs a managed engine to answer).

Defects these tests found (each failed on the code before its fix, this stop):
- a LoRA adapter's answers are keyed by its base's revision alone
  (decide/stages_cache.py `CachePlanner.revision`): an adapter before and after a new
  revision or new weights (a restart with the shared cache in Redis) share answers;
  and a routed alias is keyed by the routing policy's version alone, so a route
  model's new weights (or the route naming another model) are served its old answers
  through `auto`;
- an invalidation by model misses the answers stored under a routed alias that this
  model wrote (decide/cache.py `invalidate`, state/cache_redis.py `matches` read the
  alias asked for): the purged answer is still served through `auto`;
- a cache hit carries no `x-switchyard-revision` (and a routed hit names `auto` as its
  model), where the miss that stored it named the revision that answered;
- a stream stored for a reasoning model loses its `reasoning_content`
  (decide/cacheability.py `assemble` keeps `delta.content` alone), and a whole reply
  replayed as a stream drops it (api/sse.py `replay`);
- `Cache-Control: max-age=0` (a client that will take no stored answer) is served the
  stored one: only `no-store` and `no-cache` were read, and `no-cache="x"` not even
  that;
- the last user message's `name` is in neither key (decide/cache.py `cache_keys` reads
  its text alone), and a system message's place among the turns is not either: one
  user is served the answer given to another, one conversation another's;
- an invalidation's filters may be empty or of any length (api/admin/cache.py), a
  partition is matched only whole while decisions show its first 12 characters (an
  operator's purge from a trace removes nothing, answered 200), and `switchyard cache
  invalidate --tenant "$UNSET" --model m` drops the empty tenant and purges the model
  for every tenant (cli/cache.py);
- a client's `x-switchyard-data-version` replaced `cache.data_version` in the key
  (decide/stages_cache.py `CachePlanner.plan`): the answers an operator retired by
  moving the version (a restart, the entries in Redis) are still served to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.gateways import ADMIN_KEY, Gateway, start_gateway
from support.hostile_upstream import Hostile, hostile_upstream, json_reply, sse_reply
from support.upstreams import Scripted
from switchyard.config.settings import parse_settings
from switchyard.decide.cache import cache_keys
from switchyard.decide.stages_cache import CachePlanner
from switchyard.engines.registry import Registry
from switchyard.request import Generation
from switchyard.state.cache import Entry
from switchyard.state.cache_redis import pack, unpack

A_SAYS, C_SAYS = "answer from upstream A", "answer from upstream C"
THOUGHT = "Six times seven is forty-two, so the answer is 42."
ANSWER = "42."


def _event(obj: dict[str, Any] | bytes) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return _event(
        {
            "id": "t1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }
    )


# A reasoning model: its thinking beside its answer, as a whole reply and as a stream.
THINKER_JSON = json.dumps(
    {
        "id": "t1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
    }
).encode()
THINKER_SSE = sse_reply(
    _chunk({"role": "assistant", "reasoning_content": THOUGHT[:20]}),
    _chunk({"reasoning_content": THOUGHT[20:]}),
    _chunk({"content": ANSWER}),
    _chunk({}, "stop"),
    _event(b"[DONE]"),
)


@pytest.fixture(scope="module")
def up() -> Iterator[Hostile]:
    with hostile_upstream({"json": json_reply(THINKER_JSON), "sse": THINKER_SSE}) as hostile:
        yield hostile


def _openai(url: str, alias: str, revision: str) -> dict[str, Any]:
    return {
        "alias": alias,
        "revision": revision,
        "engine": {"kind": "openai", "base_url": url},
        "resilience": {"retries": 0},
    }


@pytest.fixture(scope="module")
def gw(two: tuple[Scripted, Scripted], up: Hostile) -> Iterator[Gateway]:
    a, c = two
    for s, says in ((a, A_SAYS), (c, C_SAYS)):
        s.content(says)
    g = start_gateway(
        {
            "models": [
                _openai(a.url + "/v1", "premium", "p1"),
                _openai(c.url + "/v1", "cheap", "c1"),
                _openai(up.base_url("json"), "thinker", "th1"),
                _openai(up.base_url("sse"), "thinker-sse", "th1"),
            ],
            # One route, also the default: `auto` is `premium` for every request.
            "router": {
                "enabled": True,
                "policy_version": "s70",
                "default_route": "premium-route",
                "routes": [{"name": "premium-route", "model": "premium", "examples": ["poem"]}],
            },
            "cache": {"enabled": True, "semantic": False},
        }
    )
    yield g
    g.proc.stop()


def _chat(
    gw: Gateway,
    model: str,
    text: str | list[dict[str, Any]],
    key: str | None = None,
    headers: dict[str, str] | None = None,
    **fields: Any,
) -> httpx.Response:
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8, **fields}
    auth = {"Authorization": f"Bearer {key or gw.key}", **(headers or {})}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)


def _said(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _purge(gw: Gateway, **body: Any) -> httpx.Response:
    return httpx.post(gw.url + "/admin/cache/invalidate", json=body, headers=gw.admin)


# -- adapters and routed aliases: whose weights an answer is keyed by ---------------------


def _settings(
    tmp: Path, lora_a_rev: str = "v1", premium_rev: str = "p1", route_to: str = "premium"
) -> Any:
    """A local base `smol` (lazy: never started) with two adapters, and `auto` routed
    to `route_to`."""

    def adapter(name: str, revision: str) -> dict[str, Any]:
        path = tmp / f"{name}.gguf"
        if not path.exists():
            path.write_bytes(os.urandom(256))
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return {
            "name": name,
            "base": "smol",
            "base_revision": "smol-rev",
            "path": str(path),
            "sha256": digest,
            "revision": revision,
            "allowed_tenants": ["*"],
        }

    return parse_settings(
        {
            "models": [
                {
                    "alias": "smol",
                    "revision": "smol-rev",
                    "engine": {"kind": "llamacpp", "gguf": "auto", "lazy": True},
                },
                _openai("http://127.0.0.1:9/v1", "premium", premium_rev),
            ],
            "adapters": [adapter("lora-a", lora_a_rev), adapter("lora-b", "v1")],
            "router": {
                "enabled": True,
                "policy_version": "s70",
                "default_route": "r",
                "routes": [{"name": "r", "model": route_to, "examples": ["poem"]}],
            },
            "embeddings": {"enabled": False},
        }
    )


def _partition(planner: CachePlanner, alias: str) -> str:
    req = Generation(model=alias, messages=[{"role": "user", "content": "Say hello"}])
    keys = cache_keys(
        req, "chat.completions", "tenant:t", "t", alias, planner.revision(alias), None, None
    )
    return keys.partition


def test_an_adapters_answers_are_keyed_by_its_own_weights(tmp_path: Path) -> None:
    """Each adapter, its base, and one adapter before and after a new revision: four
    partitions. Before, an adapter's answers were keyed by its base's revision alone,
    so `lora-a` at v2 (a restart, the shared cache in Redis) was served v1's answers.
    Each adapter's own deployment answers the revision its partition keys (its
    replies are stored, not refused as another revision's)."""
    v1 = CachePlanner(_settings(tmp_path))
    v2 = CachePlanner(_settings(tmp_path, lora_a_rev="v2"))
    parts = {_partition(v1, m) for m in ("smol", "lora-a", "lora-b")} | {_partition(v2, "lora-a")}
    assert len(parts) == 4
    assert v1.revision("smol") == "smol-rev"
    registry = Registry(_settings(tmp_path))
    for alias in ("smol", "lora-a", "lora-b"):
        assert v1.answered(registry.deployments[alias]) == v1.revision(alias)
    assert v1.answered(registry.deployments["smol"]) != v1.revision("lora-a")


def test_a_routed_alias_is_keyed_by_its_route_models_weights(tmp_path: Path) -> None:
    """`auto` routes to `premium` under policy `s70`. Before, its partition keyed the
    policy's version alone: `premium` at a new revision, or the route naming another
    model, under the same policy version, was served the old answers."""
    base = CachePlanner(_settings(tmp_path))
    newer = CachePlanner(_settings(tmp_path, premium_rev="p2"))
    to_smol = CachePlanner(_settings(tmp_path, route_to="smol"))
    parts = {_partition(p, "auto") for p in (base, newer, to_smol)}
    assert len(parts) == 3


def test_what_answered_travels_with_a_shared_entry() -> None:
    """The model and revision that answered are packed for the other processes (an
    invalidation by model there finds a routed alias's entry too)."""
    req = Generation(model="auto", messages=[{"role": "user", "content": "Say hello"}])
    keys = cache_keys(req, "chat.completions", "tenant:t", "t", "auto", "router:x", None, None)
    keys = replace(keys, answered_model="premium", answered_revision="p1")
    got = unpack(pack("origin", Entry(keys, b"{}", 1.0, 2.0, 10), None))
    assert got is not None and got[1] == keys


# -- invalidation ---------------------------------------------------------------------


def test_a_purge_by_model_removes_its_answers_stored_under_a_routed_alias(gw: Gateway) -> None:
    """`auto` routes to `premium`; its answer is stored under `auto`. An invalidation
    of `premium` (the model whose weights changed) must take it: before, it matched
    the alias asked for alone (0 entries) and the old answer was still served."""
    tenant, key = gw.new_tenant("s70-purge")
    text = "Write a poem about harbours"
    first = _chat(gw, "auto", text, key)
    assert _said(first) == A_SAYS and first.headers["x-switchyard-cache"] == "miss"
    assert _chat(gw, "auto", text, key).headers["x-switchyard-cache"] == "hit-exact"
    dry = _purge(gw, tenant=tenant, model="premium", dry_run=True)
    assert dry.status_code == 200 and dry.json()["matched"] == 1, dry.text
    gone = _purge(gw, tenant=tenant, model="premium")
    assert gone.status_code == 200 and gone.json()["removed"] == 1, gone.text
    assert _chat(gw, "auto", text, key).headers["x-switchyard-cache"] == "miss"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tenant": ""}, "tenant"),
        ({"model": "", "tag": "x"}, "model"),
        ({"tenant": "t" * 257}, "tenant"),
        ({"partition": "abc"}, "partition"),
    ],
)
def test_an_empty_short_or_oversized_filter_is_refused(
    gw: Gateway, body: dict[str, Any], param: str
) -> None:
    """An empty filter matched nothing and was answered 200 `removed: 0`; a partition
    shorter than the 12 characters decisions show could match many; a filter past any
    name's size is not one. Each is a 400 naming the field."""
    r = _purge(gw, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_partition_is_purged_by_the_start_a_decision_shows(gw: Gateway) -> None:
    """Decisions show a partition's first 12 characters; a purge naming them matched
    nothing (the filter compared the whole key) and said so with a 200."""
    _, key = gw.new_tenant("s70-part")
    text = "Describe the lighthouse keeper's day"
    rid = "s70-part-" + os.urandom(4).hex()
    assert _said(_chat(gw, "cheap", text, key, headers={"x-request-id": rid})) == C_SAYS
    rec = gw.trace(rid)
    shown = next(d for d in rec["decisions"] if d["stage"] == "cache")["evidence"]["partition"]
    assert len(shown) == 12
    r = _purge(gw, partition=shown)
    assert r.status_code == 200 and r.json()["removed"] == 1, r.text
    assert _chat(gw, "cheap", text, key).headers["x-switchyard-cache"] == "miss"


def test_the_cli_refuses_an_empty_filter_instead_of_dropping_it(gw: Gateway) -> None:
    """`switchyard cache invalidate --tenant "$UNSET" --model cheap` dropped the empty
    tenant and purged `cheap` for every tenant. It must refuse, purging nothing."""
    _, key = gw.new_tenant("s70-cli")
    text = "Name three harbour birds"
    assert _said(_chat(gw, "cheap", text, key)) == C_SAYS
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard",
            "cache",
            "invalidate",
            "--url",
            gw.url,
            "--tenant",
            "",
            "--model",
            "cheap",
        ],
        env={**os.environ, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2 and "--tenant is empty" in cli.stderr, (cli.stdout, cli.stderr)
    assert _chat(gw, "cheap", text, key).headers["x-switchyard-cache"] == "hit-exact"


# -- what a hit says ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "model", "revision"), [("premium", "premium", "p1"), ("auto", "premium", "p1")]
)
def test_a_hit_names_the_model_and_revision_that_answered(
    gw: Gateway, alias: str, model: str, revision: str
) -> None:
    """The miss says which model and revision answered (`x-switchyard-model`,
    `x-switchyard-revision`); the hit of its stored answer must say the same. Before,
    a hit had no revision, and a routed one named `auto` as its model."""
    _, key = gw.new_tenant("s70-rev")
    text = f"Which weights wrote this? ({alias})"
    miss = _chat(gw, alias, text, key)
    assert miss.headers["x-switchyard-cache"] == "miss"
    assert (miss.headers["x-switchyard-model"], miss.headers["x-switchyard-revision"]) == (
        model,
        revision,
    )
    hit = _chat(gw, alias, text, key)
    assert hit.headers["x-switchyard-cache"] == "hit-exact"
    assert hit.headers.get("x-switchyard-model") == model, hit.headers
    assert hit.headers.get("x-switchyard-revision") == revision, hit.headers


# -- a reasoning model's thinking -----------------------------------------------------------


def _stream(gw: Gateway, model: str, text: str) -> tuple[str, str, str]:
    """(x-switchyard-cache, the reasoning, the answer) a chat stream carried."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 8,
        "stream": True,
    }
    with gw.stream(body) as st:
        assert st.status_code == 200
        raw = st.read().decode()
        cache = st.headers["x-switchyard-cache"]
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    thought = "".join(str(d.get("reasoning_content") or "") for d in deltas)
    return cache, thought, "".join(str(d.get("content") or "") for d in deltas)


def test_a_stored_streams_thinking_is_served_to_a_whole_request(gw: Gateway) -> None:
    """A reasoning model's stream carries `reasoning_content` beside the answer. Stored,
    it kept `delta.content` alone: a whole request served from it had no thinking."""
    text = "What is six times seven?"
    assert _stream(gw, "thinker-sse", text) == ("miss", THOUGHT, ANSWER)
    hit = _chat(gw, "thinker-sse", text)
    assert hit.status_code == 200 and hit.headers["x-switchyard-cache"] == "hit-exact"
    message = hit.json()["choices"][0]["message"]
    assert (message["content"], message.get("reasoning_content")) == (ANSWER, THOUGHT)


def test_a_whole_replys_thinking_is_replayed_in_a_stream(gw: Gateway) -> None:
    """A whole reply of a reasoning model is stored with its `reasoning_content` (a
    whole hit serves it); replayed as a stream it carried the answer alone."""
    text = "What is seven times six?"
    miss = _chat(gw, "thinker", text)
    assert miss.headers["x-switchyard-cache"] == "miss"
    assert miss.json()["choices"][0]["message"]["reasoning_content"] == THOUGHT
    assert _stream(gw, "thinker", text) == ("hit-exact", THOUGHT, ANSWER)


# -- what the client asked ------------------------------------------------------------------


def test_cache_control_max_age_bounds_the_age_of_a_served_answer(gw: Gateway) -> None:
    """`max-age=N`: the client takes no stored answer older than N seconds (RFC 9111
    5.2.1.1); an invalid one reads as 0. Before, only `no-store` and `no-cache` were
    read: `max-age=0` was served the stored answer."""
    _, key = gw.new_tenant("s70-age")
    text = "How old may this answer be?"
    assert _chat(gw, "cheap", text, key).headers["x-switchyard-cache"] == "miss"
    for value, outcome in (
        ("max-age=3600", "hit-exact"),
        ("max-age=0", "miss"),  # and the fresh answer replaces the stored one
        ("max-age=60", "hit-exact"),
        ('max-age="soon"', "miss"),
        ('no-cache="set-cookie"', "bypass"),
    ):
        r = _chat(gw, "cheap", text, key, headers={"Cache-Control": value})
        assert r.headers["x-switchyard-cache"] == outcome, (value, r.headers)


def test_the_last_messages_name_is_part_of_the_key(gw: Gateway) -> None:
    """Two users of one tenant named in the last message (`name`), same words: the
    model answers each by name. Before, the key read the message's text alone: the
    second was served the answer given to the first."""
    _, key = gw.new_tenant("s70-name")
    said = "What is my name?"
    ask = [{"role": "user", "content": said, "name": "alice"}]
    assert _chat(gw, "cheap", ask, key).headers["x-switchyard-cache"] == "miss"
    assert _chat(gw, "cheap", ask, key).headers["x-switchyard-cache"] == "hit-exact"
    bob = [{"role": "user", "content": said, "name": "bob"}]
    assert _chat(gw, "cheap", bob, key).headers["x-switchyard-cache"] == "miss"


def test_a_system_messages_place_among_the_turns_is_part_of_the_key(gw: Gateway) -> None:
    """A developer instruction given before the conversation and the same one given
    midway are two conversations. Before, system messages were keyed apart from the
    turns, in no place: the second was served the first's answer."""
    _, key = gw.new_tenant("s70-order")
    system = {"role": "system", "content": "Answer in French from now on."}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    last = {"role": "user", "content": "How are you?"}
    first = _chat(gw, "cheap", [system, *turns, last], key)
    assert first.headers["x-switchyard-cache"] == "miss"
    assert _chat(gw, "cheap", [system, *turns, last], key).headers["x-switchyard-cache"] == (
        "hit-exact"
    )
    midway = _chat(gw, "cheap", [*turns, system, last], key)
    assert midway.headers["x-switchyard-cache"] == "miss"


def _shared(gw: Gateway) -> dict[str, Any]:
    stats = httpx.get(gw.url + "/admin/cache/stats", headers=gw.admin, timeout=10).json()
    return {"entries": stats["entries"], **stats["shared"]}


def test_a_client_data_version_never_reaches_answers_the_operator_retired(
    two: tuple[Scripted, Scripted], redis_url: str
) -> None:
    """The operator retires every answer by moving `cache.data_version` from d1 to d2
    (a restart; the entries live on in Redis). A client that sends its own
    `x-switchyard-data-version` replaced the operator's in the key: after the move it
    was still served the retired answer. Both versions bound an answer."""
    c = two[1]
    c.content(C_SAYS)

    def config(version: str) -> dict[str, Any]:
        return {
            "models": [_openai(c.url + "/v1", "cheap", "c1")],
            "cache": {"enabled": True, "semantic": False, "data_version": version},
            "storage": {"redis_url": redis_url, "redis_timeout_s": 3},
            "embeddings": {"enabled": False},
        }

    app = {"x-switchyard-data-version": "app-7"}
    old = start_gateway(config("d1"))
    try:
        text = "What does the returns policy say?"
        assert _chat(old, "cheap", text, headers=app).headers["x-switchyard-cache"] == "miss"
        assert _chat(old, "cheap", text, headers=app).headers["x-switchyard-cache"] == "hit-exact"
    finally:
        old.proc.stop()
    new = start_gateway(config("d2"), db=old.db)
    try:
        deadline = time.monotonic() + 10
        while not ((s := _shared(new))["subscribed"] and s["entries"] == 1):
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        r = _chat(new, "cheap", text, key=old.key, headers=app)
        assert r.status_code == 200 and r.headers["x-switchyard-cache"] == "miss", r.headers
    finally:
        new.proc.stop()
