"""Every request header the gateway reads, validated and bounded where it is read.

A value outside its bounds is refused with 400 `invalid_header` naming the header —
never carried along to fail later (an integer too large for the ledger, a timeout
written `1_0`, an id long enough to bloat every row). `check` returns the first
problem (or None) so that the caller can refuse the request after its context exists:
a refused request is still settled, with its usage row and trace.
"""

from __future__ import annotations

import datetime as _dt
import re
import time
from collections.abc import Mapping
from typing import Any

from switchyard.errors import InvalidHeader, InvalidRequest
from switchyard.ids import ID_PATTERN as ID_PATTERN
from switchyard.pipeline import RequestContext, RequestInput, Timings
from switchyard.policy.admission import PRIORITIES
from switchyard.policy.pii_secrets import credential_shaped
from switchyard.request import NOT_READ

MAX_PARENTS = 32
MAX_PLANNED_STEPS = 1_000_000
MAX_TIMEOUT_S = 86_400.0
# Plain decimal seconds: "2", "0.5", "30.25". Not Python's float(): that also takes
# "1_0" (10), "inf", "nan", " 2 " and "1e3".
_SECONDS = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no spaces
_TEXT = re.compile(r"[\x20-\x7e]*")  # ASCII text with spaces
MAX_IDEMPOTENCY_KEY = 255
MAX_TAGS = 32
MAX_TAG = 64

# (name, longest value accepted, pattern) of the free-text headers read elsewhere.
_BOUNDED = (
    ("cache-control", 256, _TEXT),
    ("x-switchyard-locale", 64, _PRINTABLE),
    ("accept-language", 256, _TEXT),
    ("x-switchyard-data-version", 128, _PRINTABLE),
    ("x-switchyard-cache-tags", MAX_TAGS * (MAX_TAG + 1), _TEXT),
    ("traceparent", 128, _PRINTABLE),
)


# Every header `read` looks at: a request with none of them skips it.
READ = frozenset(
    {
        "x-client-request-id",
        "x-request-id",
        "x-task-id",
        "x-parent-request-id",
        "x-task-planned-steps",
        "x-switchyard-priority",
        *(name for name, _, _ in _BOUNDED),
    }
)


def _bad(name: str, why: str) -> InvalidRequest:
    return InvalidHeader(f"header {name}: {why}", param=name)


# An id is kept in usage rows, traces and tables as sent: one that is a credential by its
# shape (an API key pasted as an id) is refused, never stored (the message never
# quotes it).
CREDENTIAL_SHAPED = (
    "has the shape of a credential (an API key or token) or of personal data (a card "
    "number, an IBAN, a national id); send an id, never a key or a personal number"
)


def client_request_id(headers: Mapping[str, str]) -> tuple[str | None, InvalidRequest | None]:
    """The client's own id for its request (`x-client-request-id`, or `x-request-id`
    as many clients send it): kept beside the gateway's id, never in its place."""
    for name in ("x-client-request-id", "x-request-id"):
        value = headers.get(name)
        if value is not None:
            if not ID_PATTERN.fullmatch(value):
                return None, _bad(name, "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
            if credential_shaped(value):
                return None, _bad(name, CREDENTIAL_SHAPED)
            return value, None
    return None, None


def task_id(headers: Mapping[str, str]) -> tuple[str | None, InvalidRequest | None]:
    value = headers.get("x-task-id")
    if value is None:
        return None, None
    if not ID_PATTERN.fullmatch(value):
        return None, _bad("x-task-id", "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    if credential_shaped(value):
        return None, _bad("x-task-id", CREDENTIAL_SHAPED)
    return value, None


def parent_request_ids(
    headers: Mapping[str, str],
) -> tuple[tuple[str, ...], InvalidRequest | None]:
    value = headers.get("x-parent-request-id")
    if not value:
        return (), None
    if len(value) > MAX_PARENTS * 130:
        return (), _bad("x-parent-request-id", f"at most {MAX_PARENTS} request ids")
    ids = tuple(p.strip() for p in value.split(",") if p.strip())
    if len(ids) > MAX_PARENTS:
        return (), _bad("x-parent-request-id", f"at most {MAX_PARENTS} request ids")
    for p in ids:
        if not ID_PATTERN.fullmatch(p):
            return (), _bad("x-parent-request-id", "a comma-separated list of request ids")
        if credential_shaped(p):
            return (), _bad("x-parent-request-id", CREDENTIAL_SHAPED)
    return ids, None


def planned_steps(headers: Mapping[str, str]) -> tuple[int | None, InvalidRequest | None]:
    value = headers.get("x-task-planned-steps")
    if value is None:
        return None, None
    if value.isascii() and value.isdigit() and len(value) <= 7:
        steps = int(value)
        if 1 <= steps <= MAX_PLANNED_STEPS:
            return steps, None
    return None, _bad("x-task-planned-steps", f"an integer from 1 to {MAX_PLANNED_STEPS}")


def _seconds(name: str, value: str, most: float) -> float:
    """Plain decimal seconds in (0, most]; raises InvalidRequest naming the header."""
    if _SECONDS.fullmatch(value):
        seconds = float(value)
        if 0 < seconds <= most:
            return seconds
    raise _bad(name, f"a number of seconds greater than 0 and at most {most:.0f}, like 30 or 2.5")


def request_timeout(value: str) -> float:
    """`x-request-timeout` in seconds."""
    return _seconds("x-request-timeout", value, MAX_TIMEOUT_S)


def idempotency_key(value: str) -> str:
    """The client's `Idempotency-Key`, bounded; one with a credential's shape is
    refused (the store keeps only a keyed hash of a key: state/idempotency.py)."""
    if 0 < len(value) <= MAX_IDEMPOTENCY_KEY and _PRINTABLE.fullmatch(value):
        if credential_shaped(value):
            raise _bad("Idempotency-Key", CREDENTIAL_SHAPED)
        return value
    raise _bad("Idempotency-Key", f"1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters, no spaces")


MAX_TASK_TIMEOUT_S = 7 * 86400.0
MAX_TASK_BUDGET_HEADER = 256
_TASK_BUDGET_INTS = {"calls": 10**9, "tokens": 10**12, "tool_calls": 10**9}
_TASK_BUDGET_SECONDS = {"cost_usd": 10**9, "wall_s": MAX_TASK_TIMEOUT_S}
_DECIMAL = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")
# RFC 3339: a date, T, a time, an offset (Z or ±hh:mm); fractions of a second allowed.
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def task_budget(value: str) -> dict[str, float]:
    """`x-task-budget: calls=10, tokens=50000, cost_usd=0.50, wall_s=120, tool_calls=5`
    (any subset, each at most once) as {name: value}; raises InvalidRequest naming the
    header."""
    why = "name=value pairs of calls, tokens, tool_calls (integers), cost_usd, wall_s (numbers > 0)"
    if len(value) > MAX_TASK_BUDGET_HEADER or not _TEXT.fullmatch(value):
        raise _bad("x-task-budget", why)
    out: dict[str, float] = {}
    for part in value.split(","):
        name, eq, raw = part.strip().partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or name in out:
            raise _bad("x-task-budget", why)
        if name in _TASK_BUDGET_INTS:
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 13):
                raise _bad("x-task-budget", why)
            number: float = int(raw)
            ceiling: float = _TASK_BUDGET_INTS[name]
        elif name in _TASK_BUDGET_SECONDS:
            if not _DECIMAL.fullmatch(raw):
                raise _bad("x-task-budget", why)
            number, ceiling = float(raw), _TASK_BUDGET_SECONDS[name]
        else:
            raise _bad("x-task-budget", why)
        if not 0 < number <= ceiling:
            raise _bad("x-task-budget", f"{name} must be greater than 0 and at most {ceiling:g}")
        out[name] = number
    if not out:
        raise _bad("x-task-budget", why)
    return out


def task_timeout(value: str) -> float:
    """`x-task-timeout`: seconds from the task's first request."""
    return _seconds("x-task-timeout", value, MAX_TASK_TIMEOUT_S)


def task_deadline(value: str, now: float | None = None) -> float:
    """`x-task-deadline`: an RFC 3339 timestamp with its offset, as unix seconds; at
    most `MAX_TASK_TIMEOUT_S` after `now` (as `x-task-timeout` and `wall_s` are: a
    deadline in the year 9999 would be no deadline)."""
    if len(value) <= 40 and _RFC3339.fullmatch(value):
        try:
            when = _dt.datetime.fromisoformat(value.replace("z", "Z").replace("Z", "+00:00"))
        except ValueError:
            when = None
        if when is not None and when.tzinfo is not None:
            at = when.timestamp()
            if at - (time.time() if now is None else now) > MAX_TASK_TIMEOUT_S:
                raise _bad(
                    "x-task-deadline", f"at most {MAX_TASK_TIMEOUT_S / 86400:g} days from now"
                )
            return at
    raise _bad("x-task-deadline", "an RFC 3339 timestamp with an offset, like 2026-12-01T12:00:00Z")


def approval_token(value: str) -> str:
    if 0 < len(value) <= 128 and _PRINTABLE.fullmatch(value):
        return value
    raise _bad("x-switchyard-approval", "1 to 128 visible ASCII characters")


def cache_tags(value: str | None) -> tuple[str, ...]:
    """The tags of `x-switchyard-cache-tags` (already bounded by `check`)."""
    if not value:
        return ()
    return tuple(t.strip() for t in value.split(",") if t.strip())


def repeated(headers: Mapping[str, str]) -> InvalidRequest | None:
    """The refusal of a single-valued header sent on two lines with different values
    (api/body.py `header_map` names them, `SINGLE_HEADERS`): which one counts is a
    guess (a proxy, the MCP SDK or the upstream may read the other), so the request is
    refused 400 naming the first such header; None when there is none. Every endpoint
    that reads headers asks this first (the model endpoints in `read`; /mcp)."""
    twice = getattr(headers, "conflicting", None)
    if twice:
        return _bad(twice[0], "sent more than once with different values; send it once")
    return None


def read(
    headers: Mapping[str, str],
) -> tuple[str | None, tuple[str, ...], str | None, int | None, InvalidRequest | None]:
    """(task id, parent ids, client request id, planned steps, the first problem)."""
    twice = repeated(headers)
    if twice is not None:
        return None, (), None, None, twice
    task, bad_task = task_id(headers)
    parents, bad_parents = parent_request_ids(headers)
    client_id, bad_id = client_request_id(headers)
    steps, bad_steps = planned_steps(headers)
    bad = bad_id or bad_task or bad_parents or bad_steps or check(headers)
    return task, parents, client_id, steps, bad


def check(headers: Mapping[str, str]) -> InvalidRequest | None:
    """The first problem with a bounded free-text header, or None."""
    for name, longest, pattern in _BOUNDED:
        value = headers.get(name)
        if value is None:
            continue
        if len(value) > longest:
            return _bad(name, f"longer than {longest} characters")
        if not pattern.fullmatch(value):
            return _bad(name, "has characters outside printable ASCII")
    priority = headers.get("x-switchyard-priority")
    # Read by the scheduling queue (policy/stages_queue.py), after routing and selection:
    # a value it would refuse is refused here, before any costly work.
    if priority is not None and (len(priority) > 32 or priority.strip().lower() not in PRIORITIES):
        return _bad("x-switchyard-priority", "one of interactive, standard, batch")
    tags = headers.get("x-switchyard-cache-tags")
    if tags:
        parts = cache_tags(tags)
        if len(parts) > MAX_TAGS or any(len(t) > MAX_TAG for t in parts):
            return _bad(
                "x-switchyard-cache-tags", f"at most {MAX_TAGS} tags of {MAX_TAG} characters"
            )
    return None


def opened(
    request_id: str,
    endpoint: str,
    headers: Mapping[str, str],
    received: float,
    deadline: float,
    principal: Any,
    api: str | None = None,
) -> RequestContext:
    """A request's context, with the values read from its headers (`read`); a bad one
    is kept as the context's header_error, refused once its handling starts (so it is
    settled like any refusal)."""
    parents: tuple[str, ...]
    # Nearly every request: none of them, and no header repeated (a plain dict).
    if type(headers) is dict and READ.isdisjoint(headers):
        task, parents, client_id, planned, bad = None, (), None, None, None
    else:
        task, parents, client_id, planned, bad = read(headers)
    # Positional, in field order: a dataclass this wide matches keywords slowly.
    ctx = RequestContext(
        RequestInput(
            request_id,
            endpoint,
            time.time() - (time.perf_counter() - received),
            headers,
            task,
            parents,
            client_id,
            planned,
            api,
        ),
        NOT_READ,
        Timings(received),
        deadline,
        principal,
    )
    ctx.header_error = bad
    return ctx


def begin(ctx: RequestContext, most_s: float) -> None:
    """What every request checks first: its headers, then its own deadline
    (`x-request-timeout`, which can only shorten the gateway's `most_s`)."""
    if ctx.header_error is not None:
        raise ctx.header_error
    headers = ctx.input.headers
    timeout = headers.get("x-request-timeout") if headers is not None else None
    if timeout is not None:
        ctx.deadline = ctx.timings.received + min(most_s, request_timeout(timeout))
