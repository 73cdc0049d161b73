"""The s70b review's fixes, without servers: the engines' own request members refused by
name, the embeddings request's shape (empty texts, `user`, `dimensions`, unknown
fields), its PII stage, its deadline, and settling a reply whose usage counts fewer
output tokens than its choices show."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import orjson
import pytest

from switchyard import outcomes
from switchyard.api.codecs import Embeddings as EmbeddingsCodec
from switchyard.config import Settings, parse_settings
from switchyard.errors import DeadlineExceeded, InvalidRequest, PiiDetected
from switchyard.execute.embeddings import Embeddings, pii_stages
from switchyard.gateway import build_pipelines
from switchyard.pipeline import Pipeline, RequestContext, RequestInput, Timings
from switchyard.policy.admission import DeploymentGate
from switchyard.policy.cost import PromptOverhead, plan
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages import Reserver
from switchyard.policy.validate import (
    ENGINE_NATIVE,
    validate_chat,
    validate_completion,
    validate_embeddings,
)
from switchyard.request import Embedding, Generation, from_object
from switchyard.settle import Settler, proven_output
from switchyard.state.limits_memory import MemoryLimiter

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
EMAIL = "alice.one@example.com"


def _settings(**sections: Any) -> Settings:
    model = {
        "alias": "m",
        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
        "price": {"input": 0.0, "output": 1000.0},
    }
    return parse_settings({"models": [model], "embeddings": {"enabled": False}, **sections})


# -- the engines' own members ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENGINE_NATIVE))
@pytest.mark.parametrize("validate", [validate_chat, validate_completion], ids=["chat", "cmpl"])
def test_an_engine_native_member_is_refused_by_name(validate: Any, name: str) -> None:
    body = {**(CHAT if validate is validate_chat else COMPLETION), name: 4}
    with pytest.raises(InvalidRequest) as e:
        validate(body)
    assert e.value.param == name
    assert f"'{name}'" in e.value.message
    assert e.value.status == 400


def test_the_refused_members_name_what_to_send_instead() -> None:
    said = {name: why for name, why in ENGINE_NATIVE.items()}
    assert "'max_tokens'" in said["n_predict"]
    assert "'n'" in said["n_cmpl"]
    assert "'top_logprobs'" in said["n_probs"]
    for name in ("grammar", "json_schema", "structured_outputs", "guided_json"):
        assert "'response_format'" in said[name], name


@pytest.mark.parametrize(
    "name, value",
    [
        ("cache_prompt", False),
        ("n_keep", 8),
        ("ignore_eos", True),
        ("min_tokens", 2),
        ("top_k", 40),
        ("repeat_last_n", 64),
        ("mirostat", 2),
        ("n_predict", None),  # null: not sent (and never read by the engine)
    ],
)
def test_harmless_engine_members_pass(name: str, value: Any) -> None:
    assert validate_chat({**CHAT, name: value}) == "m"
    assert validate_completion({**COMPLETION, name: value}) == "m"


# -- the embeddings request's shape ------------------------------------------------------


@pytest.mark.parametrize(
    "inp, where", [("", "'input'"), ([""], "'input[0]'"), (["a", "b", ""], "'input[2]'")]
)
def test_an_empty_input_text_is_refused_on_input(inp: Any, where: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        validate_embeddings({"model": "e", "input": inp}, 8)
    assert e.value.param == "input"
    assert where in e.value.message


@pytest.mark.parametrize(
    "user, said",
    [
        ("end-user\nCRITICAL forged", "control characters"),
        ("u" * 513, "longer than 512"),
        (7, "must be a string"),
    ],
)
def test_the_embeddings_user_is_held_to_the_end_user_id_rules(user: Any, said: str) -> None:
    body = {"model": "e", "input": "hello", "user": user}
    for check in (lambda: validate_embeddings(body, 8), lambda: validate_chat({**CHAT, **body})):
        with pytest.raises(InvalidRequest) as e:
            check()
        assert e.value.param == "user"
        assert said in e.value.message
    assert validate_embeddings({**body, "user": "u" * 512}, 8) == ("e", ["hello"])


@pytest.mark.parametrize("dims", ["384", True, 0, 1.5])
def test_embeddings_dimensions_are_a_positive_integer(dims: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        validate_embeddings({"model": "e", "input": "x", "dimensions": dims}, 8)
    assert e.value.param == "dimensions"


def test_unknown_embeddings_fields_follow_the_policy() -> None:
    body = {"model": "e", "input": "x", "bogus_field": 1}
    assert validate_embeddings(body, 8) == ("e", ["x"])  # pass: the default
    with pytest.raises(InvalidRequest) as e:
        validate_embeddings(body, 8, "reject")
    assert e.value.param == "bogus_field"
    with pytest.raises(InvalidRequest) as e:
        EmbeddingsCodec(8, "reject").decode(body)
    assert e.value.param == "bogus_field"
    known = {"model": "e", "input": "x", "encoding_format": "base64", "dimensions": 4, "user": "u"}
    req, exact = EmbeddingsCodec(8, "reject").decode(known)
    assert exact and req.dimensions == 4 and req.user == "u"


# -- the embeddings PII stage ------------------------------------------------------------


def _embedding_ctx(body: dict[str, Any], deadline_s: float = 5.0) -> RequestContext:
    now = time.perf_counter()
    req = from_object(Embedding, {"model": "all-minilm-l6-v2", **body})[0]
    ctx = RequestContext(
        RequestInput("r", "embeddings", time.time()), req, Timings(now), now + deadline_s
    )
    ctx.alias = "all-minilm-l6-v2"
    return ctx


@pytest.mark.parametrize(
    "body",
    [{"input": ["fine", f"write to {EMAIL}"]}, {"input": "hello", "user": EMAIL}],
    ids=["input", "user"],
)
def test_block_refuses_an_embeddings_request_holding_pii(body: dict[str, Any]) -> None:
    pipeline = Pipeline(pii_stages(_settings(pii={"mode": "block"}), PiiMasker()))
    ctx = _embedding_ctx(body)
    with pytest.raises(PiiDetected) as e:
        pipeline.decide(ctx)
    assert e.value.code == "pii_detected" and e.value.status == 400
    assert EMAIL not in e.value.message
    (d,) = ctx.decisions
    assert (d.stage, d.outcome) == ("pii", outcomes.Pii.REJECT_PII_DETECTED)
    assert d.evidence == {"mode": "block", "found": {"EMAIL": 1}}


def test_block_passes_a_clean_embeddings_request() -> None:
    pipeline = Pipeline(pii_stages(_settings(pii={"mode": "block"}), PiiMasker()))
    ctx = _embedding_ctx({"input": ["one", "two"], "user": "u-1"})
    assert pipeline.decide(ctx) is None
    assert [(d.stage, d.outcome) for d in ctx.decisions] == [("pii", outcomes.Pii.CLEAN)]


@pytest.mark.parametrize("mode", ["observe_only", "mask_upstream"])
def test_other_modes_embed_the_texts_as_sent(mode: str) -> None:
    """The embedder runs in the gateway: nothing to mask for an upstream (the guide
    says why), so only `block` brings the stage."""
    assert pii_stages(_settings(pii={"mode": mode}), PiiMasker()) == []
    override = _settings(pii={"mode": "block", "models": {"all-minilm-l6-v2": mode}})
    assert pii_stages(override, PiiMasker()) == []


def test_a_per_model_mode_for_the_embedding_alias_applies() -> None:
    s = _settings(pii={"mode": "observe_only", "models": {"all-minilm-l6-v2": "block"}})
    with pytest.raises(PiiDetected):
        Pipeline(pii_stages(s, PiiMasker())).decide(_embedding_ctx({"input": EMAIL}))


@pytest.mark.parametrize(
    "mode, names",
    [
        ("block", ["authorize", "task", "admit", "pii"]),
        ("mask_upstream", ["authorize", "task", "admit"]),
    ],
)
def test_the_embeddings_pipeline_decides_pii_after_admission(mode: str, names: list[str]) -> None:
    s = _settings(pii={"mode": mode})

    async def spent(*_: Any) -> float:
        return 0.0

    pipelines = build_pipelines(
        s,
        {},
        Reserver(MemoryLimiter(), s, spent, {"limiter_fail_open": 0, "limiter_fail_closed": 0}),
        {"m": DeploymentGate("m", None, 8)},
        PiiMasker(),
        None,
        None,
        lambda: None,
    )
    assert pipelines.embeddings.names == names


# -- the embeddings deadline -------------------------------------------------------------


class _SlowEmbedder:
    """Answers after `delay_s` (the embedding model on a loaded CPU), counting calls."""

    dimensions = 4
    max_tokens = 256

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    async def embed(self, texts: list[str], scope: str = "") -> tuple[np.ndarray, list[int]]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return np.ones((len(texts), 4), dtype=np.float32), [3] * len(texts)


def _run(embedder: _SlowEmbedder, deadline_s: float) -> tuple[RequestContext, Any]:
    run = Embeddings(_settings(embeddings={"enabled": True}), embedder)  # type: ignore[arg-type]  # a stand-in embedder
    ctx = _embedding_ctx({"input": ["a", "b"]}, deadline_s)

    async def go() -> Any:
        try:
            return await run.run(ctx, ["a", "b"])
        except DeadlineExceeded as exc:
            return exc

    return ctx, asyncio.run(go())


def test_an_embedding_past_its_deadline_ends_at_the_deadline() -> None:
    started = time.perf_counter()
    ctx, out = _run(_SlowEmbedder(2.0), 0.2)
    took = time.perf_counter() - started
    assert isinstance(out, DeadlineExceeded), out
    assert out.status == 504 and out.code == "deadline_exceeded"
    assert took < 1.0, took
    assert ctx.run.usage is None  # nothing came back: nothing to bill


def test_an_embedding_already_past_its_deadline_never_starts() -> None:
    embedder = _SlowEmbedder(0.0)
    _, out = _run(embedder, -0.01)
    assert isinstance(out, DeadlineExceeded)
    assert embedder.calls == 0


def test_an_embedding_within_its_deadline_is_answered() -> None:
    ctx, out = _run(_SlowEmbedder(0.01), 5.0)
    assert isinstance(out, dict) and len(out["data"]) == 2
    assert ctx.run.usage == {"prompt_tokens": 6, "total_tokens": 6}


# -- billing every choice a reply shows ----------------------------------------------------


def _settled(choices: list[str | None], completion_tokens: Any, n: int = 1) -> RequestContext:
    s = _settings()
    body = {"model": "m", "prompt": "One,", "max_tokens": 3, "n": n}
    req = from_object(Generation, body)[0]
    now = time.perf_counter()
    ctx = RequestContext(RequestInput("r", "completions", time.time()), req, Timings(now), now + 5)
    ctx.alias, ctx.model = "m", s.models[0]
    ctx.cost = plan(req, 40, "m", 4096, 64, 0, PromptOverhead())
    ctx.run.attempts = 1
    reply = {
        "choices": [{"index": i, "text": "x", "finish_reason": f} for i, f in enumerate(choices)],
        "usage": {"prompt_tokens": 2, "completion_tokens": completion_tokens},
    }
    ctx.run.reply_body = orjson.dumps(reply)
    Settler(s, None, None, None, PromptOverhead())._charge(ctx)  # type: ignore[arg-type]
    return ctx


def test_every_choice_cut_at_its_cap_is_billed() -> None:
    """llama-server counts one choice of four: each was cut at the 3-token cap."""
    ctx = _settled(["length"] * 4, 3, n=4)
    assert proven_output(ctx) == 12
    assert ctx.run.tokens_out == 12
    assert ctx.run.cost_usd == pytest.approx(12 * 1000.0 / 1_000_000)


def test_choices_that_stopped_prove_nothing_beyond_the_count() -> None:
    ctx = _settled(["stop", "length", "stop"], 1, n=3)
    assert ctx.run.tokens_out == 3  # the one choice cut at its cap
    assert _settled(["stop", "stop"], 2, n=2).run.tokens_out == 2


def test_no_more_choices_are_proven_than_were_asked_for() -> None:
    """An upstream that answers more choices than `n` asked (or repeats one) proves
    no more than the sequences reserved: 2 asked, 5 shown cut, 6 billed."""
    assert _settled(["length"] * 5, 1, n=2).run.tokens_out == 6


def test_a_count_above_what_the_reply_shows_is_kept() -> None:
    assert _settled(["length", "stop"], 5, n=2).run.tokens_out == 5


def test_a_reply_whose_choices_are_not_in_shape_proves_nothing() -> None:
    s = _settings()
    ctx = _settled(["length"], 1)
    ctx.run.reply_body = b'{"choices": "length", "usage": {"completion_tokens": 1}}'
    assert proven_output(ctx) == 0
    Settler(s, None, None, None, PromptOverhead())._charge(ctx)  # type: ignore[arg-type]
    assert ctx.run.tokens_out == 1
