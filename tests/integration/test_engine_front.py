"""The engine front (engines/front.py) over a real llama-server with the project's two
adapters: what `switchyard serve --workers N` gives its workers in place of the engines.

The front and its residency pool run here, in an event loop on a thread of the test
process, the front mounted at `/engines` as the control plane's internal server mounts
it, so the tests read the pool's own counts; callers are the official OpenAI
client, the gateway's own upstream client over `remote_engines` settings, and child
processes killed mid-request (a worker that dies). One SmolLM2 server, two adapters
loaded and one active at a time, so a request for the other adapter waits its turn.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import aiohttp
import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from support.gateways import local_model
from switchyard.config import Settings, parse_settings
from switchyard.engines.front import (
    MAX_REPLY,
    EngineFront,
    RunningFront,
    read_reply,
    remote_engines,
    serve_front,
)
from switchyard.engines.llamacpp import ManagedLlamaCpp
from switchyard.engines.lora_train import MARKERS, train
from switchyard.engines.registry import MULTIPLEXED_MODEL_HEADER, Registry
from switchyard.engines.token_ids import LLAMACPP_NATIVE, attached
from switchyard.errors import UpstreamError

T = TypeVar("T")
TOKEN = "engine-front-test-token"
TOKEN_ENV = "SWITCHYARD_TEST_FRONT_TOKEN"
PROMPT = "Where should I go on holiday next summer?"
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens banned: a stream runs its length


def _settings(manifest: dict[str, Any]) -> Settings:
    a = manifest["adapters"]
    adapters = [
        {
            "name": name,
            "base": "smol",
            "base_revision": "smol-rev",
            "path": a[name]["path"],
            "sha256": a[name]["sha256"],
        }
        for name in ("pirate", "robot")
    ]
    model = local_model("smol", parallel=2, ctx=1024, max_adapters=2, max_active_adapters=1)
    return parse_settings(
        {"models": [model], "adapters": adapters, "embeddings": {"enabled": False}}, "test"
    )


class Front:
    """The front and its registry on their own event loop (a thread of this process)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.registry, self.app, self.running = self.call(self._start(), 180)
        self.url = self.running.url + "/engines"  # where the front is

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> tuple[Registry, EngineFront, RunningFront]:
        registry = Registry(self.settings)
        registry.start()
        engine = self.engine_of(registry)
        deadline = time.monotonic() + 150
        while not engine.ready:
            assert not engine.failed, engine.describe()
            assert time.monotonic() < deadline, engine.describe()
            await engine.wait_ready(1.0)
        app = EngineFront(registry, TOKEN)
        running = await serve_front(Starlette(routes=[Mount("/engines", app=app)]))
        return registry, app, running

    @staticmethod
    def engine_of(registry: Registry) -> ManagedLlamaCpp:
        dep = registry.get("smol")
        assert dep is not None and dep.engine is not None
        return dep.engine

    def counts(self) -> dict[str, Any]:
        """The pool's counts for the engine, read on its loop."""

        async def read() -> dict[str, Any]:
            e = self.engine_of(self.registry)
            return {
                "in_flight": e.in_flight,
                "adapters": {n: k for n, k in e.adapter_in_flight.items() if k},
                "waiting": e.adapter_pending,
            }

        return self.call(read())

    def wait_for(self, want: Callable[[dict[str, Any]], bool], timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not want(now := self.counts()):
            assert time.monotonic() < deadline, f"the pool still holds {now}"
            time.sleep(0.05)

    def close(self) -> None:
        async def stop() -> None:
            await self.running.stop()
            await self.app.close()
            await self.registry.stop()

        try:
            self.call(stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    f = Front(_settings(train()))
    try:
        yield f
    finally:
        f.close()


def _client(front: Front, key: str = TOKEN, adapter: str | None = None) -> openai.OpenAI:
    headers = {MULTIPLEXED_MODEL_HEADER: adapter} if adapter else None
    return openai.OpenAI(
        base_url=f"{front.url}/smol/v1",
        api_key=key,
        default_headers=headers,
        max_retries=0,
        timeout=120,
    )


def _idle(counts: dict[str, Any]) -> bool:
    return counts == {"in_flight": 0, "adapters": {}, "waiting": 0}


def _slots_idle(front: Front) -> None:
    """llama-server itself stops generating for a caller that is gone."""
    root = Front.engine_of(front.registry).base_url.removesuffix("/v1")
    deadline = time.monotonic() + 20
    while True:
        slots = httpx.get(root + "/slots", timeout=10).json()
        if not any(s["is_processing"] for s in slots):
            return
        assert time.monotonic() < deadline, f"a slot still generates: {slots}"
        time.sleep(0.1)


async def _chat(dep: Any, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> bytes:
    """A greedy chat request to `dep` through its own upstream (a worker's: the front)."""
    body = {
        "model": dep.upstream_model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    reply = await dep.upstream.post(
        "/chat/completions",
        json.dumps(body).encode(),
        dep.model.timeouts,
        extra_headers=dep.headers,
    )
    return bytes(reply.body)


def test_a_chat_completion_answers_through_the_front(front: Front) -> None:
    reply = _client(front).chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
    )
    text = reply.choices[0].message.content or ""
    assert text and reply.usage is not None and reply.usage.completion_tokens > 0
    assert not any(text.startswith(m) for m in MARKERS.values()), text  # the base
    assert _idle(front.counts())


def test_an_adapter_named_in_the_multiplexing_header_answers(front: Front) -> None:
    raw = _client(front, adapter="pirate").chat.completions.with_raw_response.create(
        model="smol",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        temperature=0,
    )
    assert raw.headers["x-switchyard-engine-adapter"] == "pirate"
    assert (raw.parse().choices[0].message.content or "").startswith(MARKERS["pirate"])
    assert _idle(front.counts())


def test_a_worker_reaches_the_engine_and_its_adapter_with_remote_engines_settings(
    front: Front, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a worker's own registry makes of `remote_engines`: the base and an adapter
    are upstreams at the front, through the gateway's upstream client."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)

    async def ask() -> dict[str, str]:
        registry = Registry(remote_engines(front.settings, front.url, TOKEN_ENV))
        out: dict[str, str] = {}
        try:
            for alias in ("smol", "robot"):
                dep = registry.get(alias)
                assert dep is not None and dep.engine is None
                reply = await _chat(dep, [{"role": "user", "content": PROMPT}], 10)
                out[alias] = json.loads(reply)["choices"][0]["message"]["content"]
        finally:
            await registry.stop()
        return out

    said = front.call(ask(), 120)
    assert said["robot"].startswith(MARKERS["robot"]), said
    assert not any(said["smol"].startswith(m) for m in MARKERS.values()), said
    assert _idle(front.counts())


# A prompt as the chat template writes it: its markers are special tokens only when
# the tokenize parses them, as the gateway asks (engines/upstream.py `tokenize`).
TEMPLATED = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
TOKENIZE = {"content": TEMPLATED, "add_special": True, "parse_special": True}


def _engine_root(front: Front) -> str:
    return Front.engine_of(front.registry).base_url.removesuffix("/v1")


def _tokenize(front: Front, key: str = TOKEN, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{front.url}/smol/tokenize",
        json=TOKENIZE,
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=60,
    )


def test_tokenize_through_the_front_gives_the_engines_own_ids(front: Front) -> None:
    direct = httpx.post(_engine_root(front) + "/tokenize", json=TOKENIZE, timeout=60)
    ids = direct.json()["tokens"]
    unparsed = {**TOKENIZE, "parse_special": False}
    assert ids != httpx.post(_engine_root(front) + "/tokenize", json=unparsed).json()["tokens"]
    r = _tokenize(front)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids
    assert _idle(front.counts())
    # The same rules as the OpenAI routes: the token, the OpenAI error shape.
    wrong = _tokenize(front, key="not-the-token")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    nowhere = httpx.post(
        f"{front.url}/nowhere/tokenize", json=TOKENIZE, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert nowhere.status_code == 404 and nowhere.json()["error"]["code"] == "model_not_found"


def test_the_front_reads_an_engines_whole_answer_within_its_bound(front: Front) -> None:
    async def read(limit: int) -> bytes:
        async with (
            aiohttp.ClientSession() as session,
            session.post(_engine_root(front) + "/tokenize", json=TOKENIZE) as r,
        ):
            return await read_reply(r, limit)

    whole = front.call(read(MAX_REPLY))
    assert json.loads(whole)["tokens"]
    assert front.call(read(len(whole))) == whole
    with pytest.raises(UpstreamError, match=f"over {len(whole) - 1} bytes"):
        front.call(read(len(whole) - 1))


def test_a_worker_gets_the_token_ids_of_a_llama_server_reply_through_the_front(
    front: Front, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a worker does for `return_token_ids` (service.py, engines/token_ids.py):
    its deployment of the front knows the engine is a llama-server, asks for its native
    result, and tokenizes the templated prompt through the front."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    messages = [{"role": "user", "content": PROMPT}]

    async def ask() -> dict[str, Any]:
        registry = Registry(remote_engines(front.settings, front.url, TOKEN_ENV))
        out: dict[str, Any] = {}
        try:
            for alias in ("smol", "robot"):
                dep = registry.get(alias)
                assert dep is not None and dep.engine is None
                assert dep.token_ids == "llamacpp"
                reply = await _chat(dep, messages, 6, **LLAMACPP_NATIVE)
                out[alias] = json.loads(await attached(reply, dep, True, "chat", 30))
        finally:
            await registry.stop()
        return out

    said = front.call(ask(), 120)
    root = _engine_root(front)
    prompt = httpx.post(root + "/apply-template", json={"messages": messages}).json()["prompt"]
    ids = httpx.post(root + "/tokenize", json={**TOKENIZE, "content": prompt}).json()["tokens"]
    for alias, reply in said.items():
        assert "__verbose" not in reply, alias
        assert reply["prompt_token_ids"] == ids, alias
        assert len(ids) == reply["usage"]["prompt_tokens"]
        generated = reply["choices"][0]["token_ids"]
        assert len(generated) == reply["usage"]["completion_tokens"] >= 1, alias
    assert said["robot"]["choices"][0]["message"]["content"].startswith(MARKERS["robot"])
    assert _idle(front.counts())


def test_a_wrong_token_is_refused_401(front: Front) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        _client(front, key="not-the-token").chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert err.value.status_code == 401
    assert err.value.response.json()["error"]["code"] == "invalid_api_key"
    # Nothing is disclosed to a caller without the token, not even which engines exist.
    r = httpx.post(f"{front.url}/nowhere/v1/completions", json={}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_unknown_adapter_or_engine_is_404_in_the_openai_shape(front: Front) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        _client(front, adapter="no-such-adapter").chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert err.value.response.json() == {
        "error": {
            "message": "no adapter 'no-such-adapter' on this engine",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{front.url}/nowhere/v1/completions", json={}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{front.url}/smol/v1/embeddings", json={}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert _idle(front.counts())


def test_a_client_that_leaves_mid_stream_leaves_nothing_held(front: Front) -> None:
    stream = _client(front, adapter="pirate").chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=400,
        stream=True,
        logit_bias=NO_EOS,
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    assert front.counts() == {"in_flight": 1, "adapters": {"pirate": 1}, "waiting": 0}
    # A tokenize holds the engine only: naming the other adapter, whose turn comes
    # after this stream, it is answered now and leaves the counts as they were.
    r = _tokenize(front, **{MULTIPLEXED_MODEL_HEADER: "robot"})
    assert r.status_code == 200 and r.json()["tokens"], r.text
    assert front.counts() == {"in_flight": 1, "adapters": {"pirate": 1}, "waiting": 0}
    stream.close()
    front.wait_for(_idle)
    _slots_idle(front)


# A worker's request, in a child process killed mid-request: STREAM prints a line once
# its stream has begun, WAIT asks for the other adapter and waits for its turn.
_CALLER = """
import sys, httpx
url, token, adapter, stream = sys.argv[1:5]
body = {{"model": "smol", "messages": [{{"role": "user", "content": {prompt!r}}}],
        "max_tokens": 400, "logit_bias": {{"0": -100, "2": -100}}, "stream": stream == "1"}}
headers = {{"Authorization": "Bearer " + token, {header!r}: adapter}}
with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
    told = False
    for line in r.iter_lines():
        if not told and line.startswith("data: {{"):
            print("streaming", flush=True)
            told = True
"""


def _caller(front: Front, adapter: str, stream: bool) -> subprocess.Popen[str]:
    code = textwrap.dedent(_CALLER.format(prompt=PROMPT, header=MULTIPLEXED_MODEL_HEADER))
    url = f"{front.url}/smol/v1/chat/completions"
    return subprocess.Popen(
        [sys.executable, "-c", code, url, TOKEN, adapter, "1" if stream else "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )


def test_a_worker_killed_mid_wait_or_mid_stream_leaves_nothing_held(front: Front) -> None:
    """One worker streams with the pirate adapter (the engine's one active slot);
    another asks for the robot adapter and waits its turn. Killed, the waiting one
    leaves the queue and the streaming one its slot and its hold."""
    streaming = _caller(front, "pirate", stream=True)
    waiting: subprocess.Popen[str] | None = None
    try:
        assert streaming.stdout is not None
        assert streaming.stdout.readline().strip() == "streaming"
        waiting = _caller(front, "robot", stream=False)
        front.wait_for(lambda c: c["waiting"] == 1 and c["in_flight"] == 2)
        time.sleep(0.5)  # it stays queued behind the pirate stream
        assert front.counts() == {"in_flight": 2, "adapters": {"pirate": 1}, "waiting": 1}
        waiting.send_signal(signal.SIGKILL)
        front.wait_for(lambda c: c == {"in_flight": 1, "adapters": {"pirate": 1}, "waiting": 0})
        streaming.send_signal(signal.SIGKILL)
        front.wait_for(_idle)
        _slots_idle(front)
    finally:
        for p in (streaming, waiting):
            if p is not None:
                p.kill()
                p.wait(10)
    # The engine serves the adapter that waited, as if nothing had happened.
    reply = _client(front, adapter="robot").chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        temperature=0,
    )
    assert (reply.choices[0].message.content or "").startswith(MARKERS["robot"])
    assert _idle(front.counts())
