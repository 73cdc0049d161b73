"""Revision pins (`model: "alias@revision"`) on an RL-managed model, over sockets against
one real gateway whose `smol` (a real llama-server, SmolLM2) is managed by the RL
revision lifecycle (active revision: its base, `smol-rev`).

Defects these tests find (each fails on the code before 2026-12-07's fix):
- a key whose `may_pin_revisions` is off pins an RL-managed model: only a balancer's pins
  were checked (decide/stages_select.py `admit_model`), and an RL-managed model's select
  is a static verdict whose work never runs; its pin was served (chat, Messages) or
  counted (count_tokens), where it must be 403 `revision_pin_not_allowed`, recorded as a
  `select` decision before any costly work (admission, queue, residency);
- `/v1/messages/count_tokens` counted a pin of a revision the RL-managed model does not
  answer with (200), where `/v1/messages` is 404 ("answers with its active revision
  only"): both now ask one rule (`active_pin_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import Gateway, local_model, start_gateway

ACTIVE = "smol-rev"  # local_model's revision: the RL-managed model's base, active at boot
MESSAGES = [{"role": "user", "content": "Say hello"}]
ANTHROPIC = {"anthropic-version": "2023-06-01"}
# Stages a refused pin must not reach: the limits, the scheduling queue, the engine.
COSTLY = {"admit", "deployment_limits", "queue", "residency", "place"}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    g = start_gateway(
        {
            "models": [local_model("smol", parallel=1, ctx=512, threads=1)],
            "embeddings": {"enabled": False},
            "rl": {"models": {"smol": {}}},
        }
    )
    yield g
    g.proc.stop()


def _key(gw: Gateway, prefix: str, may_pin: bool) -> tuple[str, str]:
    tenant, _ = gw.new_tenant(prefix)
    return tenant, str(gw.create_key(tenant, may_pin_revisions=may_pin)["key"])


def _send(gw: Gateway, key: str, path: str, model: str) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": MESSAGES}
    if path != "/v1/messages/count_tokens":
        body["max_tokens"] = 2
    headers = {"x-api-key": key, **ANTHROPIC} if path.startswith("/v1/messages") else {}
    return gw.post(path, key=key, json=body, headers=headers, timeout=120)


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text[:400]
    err = r.json()["error"]
    if r.request.url.path.startswith("/v1/messages"):
        assert r.json()["type"] == "error", r.text[:400]  # Anthropic's error body
    else:
        assert err["param"] == "model", err
    assert err["code"] == code, err
    return str(err["message"])


def _select(gw: Gateway, r: httpx.Response) -> tuple[dict[str, Any], set[str]]:
    """The request's `select` decision, and the stages its trace recorded."""
    decisions = gw.trace(r.headers["x-request-id"])["decisions"]
    stages = {d["stage"] for d in decisions}
    return next(d for d in decisions if d["stage"] == "select"), stages


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"]
)
@pytest.mark.parametrize("revision", [ACTIVE, "r-other"])
def test_a_key_that_may_not_pin_is_refused_a_pin_of_an_rl_model_before_any_work(
    gw: Gateway, path: str, revision: str
) -> None:
    """The pin of an RL-managed model needs `may_pin_revisions`, as a version alias's
    does: 403 `revision_pin_not_allowed` (not the 404 naming the active revision), a
    `select` reject with the reason, and none of the stages that cost something."""
    tenant, key = _key(gw, "s72-nopin", may_pin=False)
    r = _send(gw, key, path, f"smol@{revision}")
    message = _error(r, 403, "revision_pin_not_allowed")
    assert "may_pin_revisions" in message and ACTIVE not in message, message
    select, stages = _select(gw, r)
    assert select["outcome"] == "reject" and "may_pin_revisions" in select["reason"], select
    assert select["evidence"]["pin"] == revision, select
    assert not stages & COSTLY, stages
    row = gw.stored_rows(tenant)[0]
    assert (row["model"], row["error_code"], row["output_tokens"]) == (
        "smol",
        "revision_pin_not_allowed",
        0,
    ), row


def test_count_tokens_holds_an_rl_pin_to_the_active_revision_as_messages_does(
    gw: Gateway,
) -> None:
    """For a key that may pin, a pin of a revision the model does not answer with is
    404 on /v1/messages (the residency stage, against its lease) and on count_tokens
    (admit_model, against the active revision): the same refusal. The active revision
    is counted, and served."""
    _, key = _key(gw, "s72-pin", may_pin=True)
    sent = _send(gw, key, "/v1/messages", "smol@r-other")
    counted = _send(gw, key, "/v1/messages/count_tokens", "smol@r-other")
    said = _error(sent, 404, "model_not_found")
    assert f"answers with its active revision only: '{ACTIVE}'" in said, said
    assert _error(counted, 404, "model_not_found") == said
    select, _ = _select(gw, counted)
    assert select["outcome"] == "reject", select
    assert select["evidence"] == {"pin": "r-other", "active": ACTIVE}, select

    ok = _send(gw, key, "/v1/messages/count_tokens", f"smol@{ACTIVE}")
    assert ok.status_code == 200, ok.text[:400]
    assert ok.json()["input_tokens"] > 0, ok.json()
    served = _send(gw, key, "/v1/messages", f"smol@{ACTIVE}")
    assert served.status_code == 200, served.text[:400]
    assert served.headers["x-switchyard-revision"] == ACTIVE, served.headers
