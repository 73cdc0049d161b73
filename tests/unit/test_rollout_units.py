"""The rollout API's request checks, logprob alignment and the determinism
comparison, without an engine."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard.config import Settings
from switchyard.engines.determinism import compare
from switchyard.engines.rollout import align_logprobs
from switchyard.errors import InvalidRequest
from switchyard.rollouts import SEED_MAX, validate_rollout

SETTINGS = Settings.model_validate(
    {
        "models": [{"alias": "m", "engine": {"kind": "llamacpp", "gguf": "auto"}}],
        "rl": {"models": {"m": {}}, "max_prompts": 4, "max_n": 3, "max_samples": 6},
    }
)
OK: dict[str, Any] = {"model": "m", "prompts": ["hello"]}


def test_a_valid_request_becomes_its_plan() -> None:
    plan = validate_rollout(
        {
            "model": "m",
            "prompts": ["a", {"id": "q/2", "messages": [{"role": "user", "content": "b"}]}],
            "n": 3,
            "seed": 40,
            "stop": "\n",
            "temperature": 0,
            "dataset_revision": "ds:1",
            "deterministic": True,
        },
        SETTINGS,
    )
    assert [p.id for p in plan.prompts] == ["0", "q/2"]
    assert plan.prompts[0].text == "a" and plan.prompts[1].messages is not None
    assert plan.seeds == [40, 41, 42] and plan.stop == ("\n",) and plan.temperature == 0.0
    assert plan.dataset_revision == "ds:1" and plan.deterministic


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"prompts": ["a"] * 5}, "prompts"),
        ({"prompts": ["a", "b", "c"], "n": 3}, "n"),  # 9 samples > max_samples 6
        ({"n": 4}, "n"),
        ({"n": True}, "n"),
        ({"seeds": [1, 2]}, "seeds"),
        ({"seeds": [1, 2], "n": 2, "seed": 3}, "seeds"),
        ({"seeds": [SEED_MAX + 1]}, "seeds"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_logprobs": 6}, "top_logprobs"),
        ({"stop": ["x"] * 5}, "stop"),
        ({"dataset_revision": "a b"}, "dataset_revision"),
        ({"deterministic": "yes"}, "deterministic"),
        ({"prompts": [{"id": "x", "prompt": "a", "messages": []}]}, "prompts[0]"),
        ({"prompts": [{"id": "x"}]}, "prompts[0]"),
        ({"prompts": [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}]}, "prompts"),
        ({"prompts": [{"messages": [{"role": "user", "content": [{"type": "text"}]}]}]}, None),
        ({"prompts": [""]}, "prompts[0].prompt"),
        ({"stream": True}, "stream"),
    ],
)
def test_each_bad_field_is_a_400_naming_it(change: dict[str, Any], param: str | None) -> None:
    with pytest.raises(InvalidRequest) as exc:
        validate_rollout({**OK, **change}, SETTINGS)
    if param is not None:
        assert exc.value.param == param


def test_llama_servers_dropped_entries_align_by_token_id() -> None:
    # Observed: "✏" is tokens 4636, 246, 233; only 233 (the character's end) has an entry.
    ids = [4636, 246, 233, 4636, 246, 233, 17]
    probs = [{"id": 233, "logprob": -0.1}, {"id": 233, "logprob": -0.2}, {"id": 17, "logprob": -1}]
    lps, tops, missing = align_logprobs(ids, probs, 0)
    assert lps == [None, None, -0.1, None, None, -0.2, -1.0]
    assert missing == [0, 1, 3, 4] and tops == []


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.booleans(), st.floats(-30, 0)), min_size=0, max_size=40
    )
)
def test_alignment_keeps_every_reported_logprob_at_its_token(
    tokens: list[tuple[int, bool, float]],
) -> None:
    ids = [t for t, _, _ in tokens]
    probs = [{"id": t, "logprob": lp, "top_logprobs": []} for t, kept, lp in tokens if kept]
    lps, tops, missing = align_logprobs(ids, probs, 1)
    assert len(lps) == len(tops) == len(ids)
    assert [lp for lp in lps if lp is not None] == [p["logprob"] for p in probs]
    assert missing == [i for i, lp in enumerate(lps) if lp is None]
    # Every reported value sits at a token with its id.
    k = 0
    for i, lp in enumerate(lps):
        if lp is not None:
            assert ids[i] == probs[k]["id"]
            k += 1


def test_compare_reports_the_first_divergence_and_the_logprob_gap() -> None:
    ref = {"token_ids": [1, 2, 3, 4], "logprobs": [-0.5, -1.0, -2.0, -0.1]}
    same = compare(ref, {"token_ids": [1, 2, 3, 4], "logprobs": [-0.5, -1.25, -2.0, -0.1]})
    assert same == {"equal": True, "first_divergence": None, "max_logprob_diff": 0.25}
    split = compare(ref, {"token_ids": [1, 2, 9], "logprobs": [-0.5, -1.0, None]})
    assert split["equal"] is False and split["first_divergence"] == 2
    shorter = compare(ref, {"token_ids": [1, 2], "logprobs": [-0.5, -1.0]})
    assert shorter["first_divergence"] == 2 and not shorter["equal"]


def test_rollout_records_older_than_retention_go_and_newer_stay(tmp_path: Any) -> None:
    from switchyard.observe.rollouts import (
        enforce_rollout_retention,
        export_rollouts,
        write_rollouts,
    )
    from switchyard.state.sql import connect

    conn = connect(str(tmp_path / "r.db"))

    def rec(i: int, at: float) -> dict[str, Any]:
        return {
            "sample_id": f"r{i}",
            "request_id": "req",
            "tenant_id": "t",
            "finished_at": at,
            "provenance": {"model": "m", "revision": "v1" if i % 2 else "v2"},
        }

    now = 1_900_000_000.0
    write_rollouts(conn, [rec(i, now - i * 86400) for i in range(10)])
    write_rollouts(conn, [rec(0, now)])  # a repeat keeps the stored row
    assert [r["sample_id"] for r in export_rollouts(conn, 0, batch=3)] == [
        f"r{i}" for i in range(9, -1, -1)
    ]
    assert enforce_rollout_retention(conn, 3.5, now) == 6
    assert [r["sample_id"] for r in export_rollouts(conn, 0)] == ["r3", "r2", "r1", "r0"]
    assert [r["sample_id"] for r in export_rollouts(conn, 0, revision="v1")] == ["r3", "r1"]


def test_which_models_return_token_ids_and_what_a_fallback_is_skipped_for() -> None:
    from switchyard.execute.compat import incompatibility, request_needs
    from switchyard.request import Generation

    cfg = Settings.model_validate(
        {
            "models": [
                {"alias": "server", "engine": {"kind": "llamacpp", "gguf": "auto"}},
                {
                    "alias": "worker",
                    "engine": {"kind": "llamacpp", "gguf": "auto", "runtime": "worker"},
                },
                {"alias": "vllm", "engine": {"kind": "vllm"}},
                {"alias": "remote", "engine": {"kind": "openai", "base_url": "http://h:1/v1"}},
                {
                    "alias": "remote-vllm",
                    "engine": {"kind": "openai", "base_url": "http://h:2/v1"},
                    "capabilities": {"supports_token_ids": True},
                },
            ]
        }
    )
    models = {m.alias: m for m in cfg.models}

    def why(alias: str, **body: Any) -> str | None:
        needs = request_needs(Generation(model=alias, messages=[], **body), 10, 10)
        return incompatibility(needs, models[alias], None)

    for alias in models:  # without the option nothing is refused for it
        assert why(alias, stream=True, n=3) is None
    asked = {"return_token_ids": True}
    assert [a for a in models if why(a, **asked) is None] == ["server", "vllm", "remote-vllm"]
    assert "does not return token ids" in (why("worker", **asked) or "")
    assert "does not return token ids" in (why("remote", **asked) or "")
    assert "streaming" in (why("server", stream=True, **asked) or "")
    assert "n = 1" in (why("server", n=2, **asked) or "")
    assert why("vllm", stream=True, n=2, **asked) is None  # vLLM gives both natively
    assert why("server", return_token_ids=False, stream=True) is None


@pytest.mark.parametrize(
    ("engine", "ok"),
    [
        ({"kind": "llamacpp", "gguf": "auto"}, True),
        ({"kind": "vllm"}, True),
        ({"kind": "llamacpp", "gguf": "auto", "runtime": "worker"}, False),
        ({"kind": "openai", "base_url": "http://h:1/v1"}, False),
    ],
)
def test_rl_models_are_llama_servers_or_vllm(engine: dict[str, Any], ok: bool) -> None:
    cfg = {"models": [{"alias": "m", "engine": engine}], "rl": {"models": {"m": {}}}}
    if ok:
        assert Settings.model_validate(cfg).rl.models["m"].drain_timeout_s > 0
    else:
        with pytest.raises(ValueError, match="revisions are managed for llamacpp"):
            Settings.model_validate(cfg)


def _stored(prompt_id: str, dataset: str | None, text: str = "four") -> dict[str, Any]:
    """A record as `RolloutService` streams it and the form it would be stored in."""
    from switchyard.policy.pii import PiiMasker
    from switchyard.rollouts import RolloutService

    pii = PiiMasker()
    none: Any = None
    service = RolloutService(SETTINGS, none, none, {}, None, pii.mask, pii.contains_pii)
    rec: dict[str, Any] = {
        "prompt_id": prompt_id,
        "text": text,
        "token_ids": [1, 2],
        "prompt_token_ids": [3],
        "provenance": {"model": "m", "dataset_revision": dataset},
    }
    stored = service._at_rest(rec, set())
    assert rec["prompt_id"] == prompt_id and rec["provenance"]["dataset_revision"] == dataset
    return stored


def test_a_credential_sent_as_a_prompt_id_or_dataset_revision_is_masked_at_rest() -> None:
    key, key2 = (
        "sk-proj-Rv7wQ2nL9xB4tK1mZ6yH3pC8sD0fG5jA",
        "sk-proj-Tb4yN8cE1vQ6rM3kW9uJ2hX5pD7gL0aF",
    )
    stored = _stored(key, key2)
    assert stored["prompt_id"] == "<SECRET_1>", stored
    assert stored["provenance"] == {"model": "m", "dataset_revision": "<SECRET_1>"}, stored
    # Only the ids were the secret: the sample's text and token ids are kept.
    assert (stored["text"], stored["token_ids"], stored["prompt_token_ids"]) == (
        "four",
        [1, 2],
        [3],
    )
    assert "pii_masked" not in stored


def test_ordinary_ids_are_stored_as_sent() -> None:
    stored = _stored("q-17", "gsm-v3")
    assert stored["prompt_id"] == "q-17"
    assert stored["provenance"]["dataset_revision"] == "gsm-v3"
    assert _stored("q-18", None)["provenance"]["dataset_revision"] is None
