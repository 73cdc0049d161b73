"""Decision outcomes (outcomes.py): one StrEnum per stage, stored as the plain strings
they always were; tagged outcomes (`reject:<code>`, `deployment:<name>`) built from a
kind and a value and taken apart again by `parse`, never by a reader's own split."""

from __future__ import annotations

import json
import time
from enum import StrEnum

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard import outcomes
from switchyard.outcomes import BY_STAGE, Kind, parse, refusal, reject, tagged
from switchyard.pipeline import Decision, decision_dict

STAGE_ENUMS = sorted(set(BY_STAGE.values()), key=lambda e: e.__name__)
MEMBERS = [m for enum in STAGE_ENUMS for m in enum]

# A value after the colon: codes, route, deployment and revision names as configs
# and errors spell them (colons, slashes and dots included), and counts.
values = st.one_of(
    st.text(
        alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF),
        min_size=0,
        max_size=40,
    ),
    st.from_regex(r"[a-z][a-z0-9_./:-]{0,30}", fullmatch=True),
    st.integers(min_value=0, max_value=10**6),
)


def test_every_stage_enum_is_a_str_enum_of_that_stage() -> None:
    assert all(issubclass(e, StrEnum) for e in STAGE_ENUMS)
    # Every enum the record type accepts is some stage's, and every stage's is in it.
    union = set(outcomes.Outcome.__args__) - {outcomes.Tagged}
    assert union == set(STAGE_ENUMS)
    # The names a stage records under are the pipeline's (a typo would file a stage's
    # outcomes under no stage).
    assert {"admit", "cache", "select", "attempt", "tool_exec"} <= set(BY_STAGE)


@pytest.mark.parametrize("member", MEMBERS, ids=lambda m: f"{type(m).__name__}.{m.name}")
def test_members_are_the_stored_strings(member: StrEnum) -> None:
    """A member is its value for every reader: equality, hashing, formatting, str()
    and each JSON encoder the traces go through."""
    value = member.value
    assert member == value and hash(member) == hash(value)
    assert str(member) == value and f"{member}" == value
    assert msgspec.json.encode(member) == msgspec.json.encode(value)
    assert orjson.dumps(member) == orjson.dumps(value)
    assert json.dumps(member) == json.dumps(value)
    # A member that carries a value is spelled as its kind's tagged form.
    kind, detail = parse(member)
    if detail is not None:
        assert kind in set(Kind), member
        assert tagged(Kind(kind), detail) == member


def test_fixed_refusals_are_reject_outcomes() -> None:
    refusals = [m for m in MEMBERS if m.startswith("reject")]
    assert refusals, "the stages refuse"
    for m in refusals:
        assert parse(m).kind == Kind.REJECT
        assert refusal(m) == (parse(m).value or "")
    assert refusal(outcomes.Admit.REJECT_LIMITER_UNAVAILABLE) == "limiter_unavailable"
    assert refusal(outcomes.Select.REJECT) == ""  # refused, with no code of its own
    assert refusal(outcomes.Admit.ADMITTED) is None
    assert refusal(outcomes.Admit.FAIL_OPEN) is None  # "admit:...", not "reject:..."


@given(kind=st.sampled_from(list(Kind)), value=values)
def test_tagged_round_trip(kind: Kind, value: object) -> None:
    """(kind, value) -> the stored string -> parse -> the same (kind, value), whatever
    the value holds (colons too: only the first one separates)."""
    out = tagged(kind, value)
    assert type(out) is str  # a plain str at run time: encoders see no wrapper
    assert out == f"{kind.value}:{value}"  # the f-string it replaces, byte for byte
    got = parse(out)
    assert got == (kind.value, str(value))
    assert got.kind == kind and got.value == str(value)
    assert parse(tagged(Kind(got.kind), got.value)) == got
    assert refusal(out) == (str(value) if kind is Kind.REJECT else None)


@given(code=values.map(str))
def test_reject_is_the_reject_kind(code: str) -> None:
    assert reject(code) == tagged(Kind.REJECT, code) == "reject:" + code
    assert refusal(reject(code)) == code


@given(st.text(max_size=30))
def test_parse_of_any_string_gives_it_back(outcome: str) -> None:
    kind, value = parse(outcome)
    assert (kind if value is None else f"{kind}:{value}") == outcome
    assert ":" not in kind


@given(
    member=st.sampled_from(MEMBERS),
    kind=st.sampled_from(list(Kind)),
    value=values,
    t0=st.floats(min_value=0, max_value=1e6),
)
def test_decision_encodes_as_the_string_form(
    member: StrEnum, kind: Kind, value: object, t0: float
) -> None:
    """The stored array of a decision recorded with an enum member or a tagged
    outcome is byte for byte the array of one recorded with the plain string."""
    for outcome in (member, tagged(kind, value)):
        typed = Decision("stage", outcome, "why", {"n": 1}, t0, t0 + 0.5)
        plain = Decision("stage", str.__str__(outcome), "why", {"n": 1}, t0, t0 + 0.5)
        assert msgspec.json.encode(typed) == msgspec.json.encode(plain)
        assert msgspec.json.encode([typed]) == msgspec.json.encode([plain])
        assert orjson.dumps(decision_dict(typed, 0.0)) == orjson.dumps(decision_dict(plain, 0.0))
        back = msgspec.json.decode(msgspec.json.encode(typed), type=Decision)
        assert back.outcome == outcome and type(back.outcome) is str


def test_a_recorded_decision_is_the_string_form() -> None:
    """Through the pipeline's own `record`: the stored form of a request's decisions."""
    from switchyard.pipeline import RequestContext, RequestInput, Timings
    from switchyard.request import Embedding

    now = time.perf_counter()
    ctx = RequestContext(
        input=RequestInput("req_1", "embeddings", {}, time.time()),
        request=Embedding(model="m", input=["x"]),
        timings=Timings(received=now),
        deadline=now + 10,
    )
    ctx.record("admit", outcomes.Admit.ADMITTED, "within every limit", now)
    ctx.record("queue", reject("deadline_exceeded"), "waited too long", now)
    encoded = msgspec.json.decode(msgspec.json.encode(ctx.decisions))
    assert [d[:3] for d in encoded] == [
        ["admit", "admitted", "within every limit"],
        ["queue", "reject:deadline_exceeded", "waited too long"],
    ]
