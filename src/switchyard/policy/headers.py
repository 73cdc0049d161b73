"""Every request header the gateway reads, validated and bounded where it is read.

A value outside its bounds is refused with 400 `invalid_header` naming the header —
never carried along to fail later (an integer too large for the ledger, a timeout
written `1_0`, an id long enough to bloat every row). `check` returns the first
problem (or None) so that the caller can refuse the request after its context exists:
a refused request is still settled, with its usage row and trace.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from switchyard.errors import InvalidRequest

ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
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
        *(name for name, _, _ in _BOUNDED),
    }
)


def _bad(name: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"header {name}: {why}", param=name, code="invalid_header")


def client_request_id(headers: Mapping[str, str]) -> tuple[str | None, InvalidRequest | None]:
    """The client's own id for its request (`x-client-request-id`, or `x-request-id`
    as many clients send it): kept beside the gateway's id, never in its place."""
    for name in ("x-client-request-id", "x-request-id"):
        value = headers.get(name)
        if value is not None:
            if ID_PATTERN.fullmatch(value):
                return value, None
            return None, _bad(name, "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    return None, None


def task_id(headers: Mapping[str, str]) -> tuple[str | None, InvalidRequest | None]:
    value = headers.get("x-task-id")
    if value is None:
        return None, None
    if ID_PATTERN.fullmatch(value):
        return value, None
    return None, _bad("x-task-id", "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")


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


def request_timeout(value: str) -> float:
    """`x-request-timeout` in seconds; raises InvalidRequest naming the header."""
    if _SECONDS.fullmatch(value):
        seconds = float(value)
        if 0 < seconds <= MAX_TIMEOUT_S:
            return seconds
    raise _bad(
        "x-request-timeout",
        f"a number of seconds greater than 0 and at most {MAX_TIMEOUT_S:.0f}, like 30 or 2.5",
    )


def idempotency_key(value: str) -> str:
    if 0 < len(value) <= MAX_IDEMPOTENCY_KEY and _PRINTABLE.fullmatch(value):
        return value
    raise _bad("Idempotency-Key", f"1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters, no spaces")


def cache_tags(value: str | None) -> tuple[str, ...]:
    """The tags of `x-switchyard-cache-tags` (already bounded by `check`)."""
    if not value:
        return ()
    return tuple(t.strip() for t in value.split(",") if t.strip())


def read(
    headers: Mapping[str, str],
) -> tuple[str | None, tuple[str, ...], str | None, int | None, InvalidRequest | None]:
    """(task id, parent ids, client request id, planned steps, the first problem)."""
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
    tags = headers.get("x-switchyard-cache-tags")
    if tags:
        parts = cache_tags(tags)
        if len(parts) > MAX_TAGS or any(len(t) > MAX_TAG for t in parts):
            return _bad(
                "x-switchyard-cache-tags", f"at most {MAX_TAGS} tags of {MAX_TAG} characters"
            )
    return None
