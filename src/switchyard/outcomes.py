"""What a decision says happened: one `StrEnum` of outcomes per stage.

A decision's `outcome` is stored, traced and served as the plain string it always was
(`"hit-exact"`, `"reject:rpm"`, `"deployment:qwen-a"`): every enum here is a `StrEnum`,
so its members are `str` constants that compare, hash, format and encode (msgspec,
orjson, json) exactly as those strings do. `RequestContext.record` and `Verdict` take
an `Outcome`, so a bare string literal is refused by mypy: each stage says what it
decided with a member of its own enum.

Some outcomes carry a value after a colon: a refusal's error code (`reject:rpm`), a
route (`route:reasoning`), a deployment (`deployment:qwen-a`), a count (`blocked:2`).
The fixed ones are members of their stage's enum like any other; the ones whose value
is known only per request are built by `tagged(kind, value)` (or `reject(code)`): a
`Tagged` string, plain `str` at run time (so building one costs the f-string it
replaces and the stored bytes stay the same), a type of its own for mypy. `parse` gives
any outcome's kind and value back, as recorded or as read from a stored trace, so no
reader splits outcome strings itself.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple, NewType

# -- the outcomes that carry a value -------------------------------------------------


class Kind(StrEnum):
    """The kind of an outcome that carries a value: the part before its colon."""

    REJECT = "reject"  # refused; the value is the error code
    ADMIT = "admit"  # admitted anyway (fail_open)
    ADMITTED = "admitted"  # admitted, with a qualifier (cap_shrunk)
    ROUTE = "route"  # the router's route
    DEPLOYMENT = "deployment"  # the deployment selected
    REVISION = "revision"  # the revision served (RL-managed models)
    LEASE = "lease"  # the revision a rollout holds
    TOOLS = "tools"  # tools kept / offered
    BLOCKED = "blocked"  # tool calls removed
    FLAGGED = "flagged"  # tool calls relayed though not allowed
    DUPLICATE = "duplicate"  # tool results for calls that already had one
    MISS = "miss"  # a cache miss, with why
    SHADOW = "shadow"  # a shadow cache hit, with its kind
    ENTER = "enter"  # a device condition began
    EXIT = "exit"  # a device condition ended
    SKIP = "skip"  # passed over: a deployment, a fallback target, the deadline
    TRY = "try"  # a fallback or failover target tried
    NONE = "none"  # no failover target left
    BREAKER_OPEN = "breaker_open"  # a deployment's circuit breaker is open
    ERROR = "error"  # an attempt's error, by class or code
    DENIED = "denied"  # a retry refused, with why


# An outcome built per request from a `Kind` and its value ("reject:rpm"): its own
# type for mypy, so only `tagged` and `reject` make one; a plain str at run time, where
# `Tagged(s)` is `str(s)`, which returns an exact str as it is (no wrapper call).
if TYPE_CHECKING:
    Tagged = NewType("Tagged", str)
else:
    Tagged = str


def tagged(kind: Kind, value: object) -> Tagged:
    """The outcome `kind:value`, `value` formatted as an f-string does (the enum's
    `_value_`: formatting the member itself goes through Enum.__format__, slower)."""
    return Tagged(f"{kind._value_}:{value}")


def reject(code: str) -> Tagged:
    """A refusal's outcome, `reject:<code>` (the code of the error the client gets)."""
    return Tagged("reject:" + code)


class Parsed(NamedTuple):
    """An outcome taken apart: its kind (the whole outcome when it carries no value)
    and its value (None when it carries none)."""

    kind: str
    value: str | None


def parse(outcome: str) -> Parsed:
    """`outcome`'s kind and value: `parse("reject:rpm") == ("reject", "rpm")`,
    `parse("hit-exact") == ("hit-exact", None)`. A value may itself hold colons."""
    kind, sep, value = outcome.partition(":")
    return _new_parsed(Parsed, (kind, value if sep else None))


_new_parsed = tuple.__new__  # a NamedTuple's own __new__ is Python code: slower


def refusal(outcome: str) -> str | None:
    """The error code of a refusal's outcome (`reject:<code>`); None for any other
    (a bare `reject` refuses with no code: "")."""
    kind, _, value = outcome.partition(":")
    return value if kind == "reject" else None


# -- one enum per stage, in pipeline order -------------------------------------------


class Authenticate(StrEnum):
    OK = "ok"
    SKIP = "skip"  # auth.mode is disabled


class Validate(StrEnum):
    OK = "ok"


class Idempotency(StrEnum):
    OWNER = "owner"  # the first request with its key: it runs
    REPLAY = "replay"  # the stored reply answers


class Authorize(StrEnum):
    ALLOWED = "allowed"
    SKIP = "skip"
    REJECT_UNKNOWN = "reject:unknown_model"  # a model the gateway serves none of


class Window(StrEnum):
    OK = "ok"
    REJECT_CONTEXT_LENGTH = "reject:context_length_exceeded"


class Admit(StrEnum):
    """The limit stages' (`admit`, `deployment_limits`); the refused limit's is
    `reject(limit)`."""

    ADMITTED = "admitted"
    ADMITTED_CAP_SHRUNK = "admitted:cap_shrunk"
    FAIL_OPEN = "admit:fail_open"
    REJECT_LIMITER_UNAVAILABLE = "reject:limiter_unavailable"
    SKIP = "skip"


class Queue(StrEnum):
    """A refusal while waiting is `reject(code)`."""

    ADMITTED = "admitted"
    WAITED = "waited"
    REJECT_INVALID_HEADER = "reject:invalid_header"


class Pii(StrEnum):
    CLEAN = "clean"
    MASKED = "masked"
    OBSERVED = "observed"
    SKIP = "skip"
    REJECT_MASKING_FAILED = "reject:masking_failed"
    REJECT_PII_DETECTED = "reject:pii_detected"


class Task(StrEnum):
    """The task budget's, for model and tool calls; a refusal by the task's budget
    is `reject(refused)`."""

    ADMITTED = "admitted"
    FAIL_OPEN = "admit:fail_open"
    SKIP = "skip"
    STOPPED = "stopped"  # the task was cancelled while the call ran
    REJECT_INVALID_HEADER = "reject:invalid_header"
    REJECT_UNAVAILABLE = "reject:unavailable"


class ToolResults(StrEnum):
    """Duplicates are `tagged(Kind.DUPLICATE, n)`; a bad message `reject(code)`."""

    OK = "ok"
    SKIP = "skip"
    REJECT_INVALID_HEADER = "reject:invalid_header"
    REJECT_APPROVAL_REQUIRED = "reject:approval_required"


class Media(StrEnum):
    """A failed fetch or decode is `reject(code)`."""

    PROCESSED = "processed"
    SKIP = "skip"
    REJECT_TOO_LARGE = "reject:media_too_large"


class Embed(StrEnum):
    """The embed stage's, and the embeddings endpoint's."""

    OK = "ok"
    SKIP = "skip"


class Cache(StrEnum):
    BYPASS = "bypass"
    MISS = "miss"
    MISS_VETO = "miss:veto"  # a semantic match the verifier refused
    HIT_EXACT = "hit-exact"
    HIT_SEMANTIC = "hit-semantic"
    SHADOW_HIT_EXACT = "shadow:hit-exact"
    SHADOW_HIT_SEMANTIC = "shadow:hit-semantic"
    SKIP = "skip"


class CacheShadow(StrEnum):
    COMPARED = "compared"


class CacheStore(StrEnum):
    STORED = "stored"
    SKIP = "skip"


class Route(StrEnum):
    """A routed request's is `tagged(Kind.ROUTE, name)`."""

    EXPLICIT = "explicit"


class Tools(StrEnum):
    """A shortlist's is `tagged(Kind.TOOLS, f"{kept}/{offered}")`."""

    SKIP = "skip"


class ToolCalls(StrEnum):
    """Removed or flagged calls are `tagged(Kind.BLOCKED | Kind.FLAGGED, n)`."""

    OK = "ok"


class Select(StrEnum):
    """The deployment selected is `tagged(Kind.DEPLOYMENT, name)`."""

    REJECT = "reject"
    REJECT_REGION = "reject:region_not_allowed"
    REJECT_PLACEMENT = "reject:placement"


class Canary(StrEnum):
    CUT = "cut"


class Place(StrEnum):
    """A device condition's change is `tagged(Kind.ENTER | Kind.EXIT, condition)`."""

    LOCAL = "local"
    REMOTE = "remote"
    DEGRADED = "degraded"
    REFUSED = "refused"
    REJECT_PRIVACY = "reject:privacy"


class Residency(StrEnum):
    """An RL-managed model's revision is `tagged(Kind.REVISION, revision)`."""

    HOT = "hot"
    COLD_LOAD = "cold-load"
    ADAPTER_LOAD = "adapter-load"
    PROMOTE = "promote"
    REJECT = "reject"
    SKIP = "skip"


class Attempt(StrEnum):
    """Passed-over deployments are `tagged(Kind.SKIP, name)`, open breakers
    `tagged(Kind.BREAKER_OPEN, name)`, failures `tagged(Kind.ERROR, class_or_code)`."""

    OK = "ok"
    ENGINE_CRASHED = "engine_crashed"
    SKIP_DEADLINE = "skip:deadline"


class Retry(StrEnum):
    BACKOFF = "backoff"
    SKIP_DEADLINE = "skip:deadline"
    # A further call refused: the deployment's retry budget is spent, or the request's
    # reservation could not be extended to pay for it (its evidence says which).
    DENIED_BUDGET = "denied:budget"
    # The request's reservation was extended by one more call's estimate before a
    # further call (a call so far may have been billed: execute/executor.py).
    EXTENDED = "extended"


class Settle(StrEnum):
    """What settle.py billed when the upstream's usage did not say (a call cut, a reply
    without usage or with counts no request could have): an estimate."""

    ESTIMATED = "estimated"


# `fallback` and `failover` record only tagged outcomes: `tagged(Kind.SKIP | Kind.TRY,
# alias)` and `tagged(Kind.TRY | Kind.NONE, deployment or alias)`; a rollout's
# `revision` stage `tagged(Kind.LEASE, revision)`.


class ToolAuth(StrEnum):
    OK = "ok"
    REJECT_UNKNOWN = "reject:unknown"
    REJECT_FORBIDDEN = "reject:forbidden"


class ToolOnce(StrEnum):
    """A tool call's claim on its call id (state/ tool-call store's states)."""

    OWNER = "owner"
    SKIP = "skip"
    DONE = "done"
    IN_DOUBT = "in_doubt"
    RESOLVED_RAN = "resolved_ran"
    TOO_LARGE = "too_large"
    CONFLICT = "conflict"
    IN_FLIGHT = "in_flight"


class ToolCallId(StrEnum):
    MATCHED = "matched"


class Approval(StrEnum):
    APPROVED = "approved"
    REJECT_APPROVAL = "reject:approval"


class ToolExec(StrEnum):
    OK = "ok"
    TOOL_ERROR = "tool_error"  # the tool ran and reported an error
    ERROR = "error"  # the server refused the call
    FAILED = "failed"
    IN_DOUBT = "in_doubt"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    TOO_LARGE = "too_large"
    REJECT_CIRCUIT_OPEN = "reject:circuit_open"


class Worker(StrEnum):
    """The supervisor's record of a request whose `serve --workers` process died."""

    EXITED = "exited"


# Each stage's enum by the stage names it records under (tests and readers).
BY_STAGE: dict[str, type[StrEnum]] = {
    "authenticate": Authenticate,
    "validate": Validate,
    "idempotency": Idempotency,
    "authorize": Authorize,
    "window": Window,
    "admit": Admit,
    "admit_call": Admit,  # a Responses continuation's call, before its store read
    "deployment_limits": Admit,
    "queue": Queue,
    "pii": Pii,
    "task": Task,
    "tool_results": ToolResults,
    "media": Media,
    "embed": Embed,
    "cache": Cache,
    "cache_shadow": CacheShadow,
    "cache_store": CacheStore,
    "route": Route,
    "tools": Tools,
    "tool_calls": ToolCalls,
    "select": Select,
    "canary": Canary,
    "place": Place,
    "residency": Residency,
    "attempt": Attempt,
    "retry": Retry,
    "settle": Settle,
    "tool_auth": ToolAuth,
    "tool_once": ToolOnce,
    "tool_call_id": ToolCallId,
    "approval": Approval,
    "tool_exec": ToolExec,
    "worker": Worker,
}

# What `RequestContext.record` and a static `Verdict` take: a member of a stage's
# enum, or a tagged outcome.
Outcome = (
    Authenticate
    | Validate
    | Idempotency
    | Authorize
    | Window
    | Admit
    | Queue
    | Pii
    | Task
    | ToolResults
    | Media
    | Embed
    | Cache
    | CacheShadow
    | CacheStore
    | Route
    | Tools
    | ToolCalls
    | Select
    | Canary
    | Place
    | Residency
    | Attempt
    | Retry
    | Settle
    | ToolAuth
    | ToolOnce
    | ToolCallId
    | Approval
    | ToolExec
    | Worker
    | Tagged
)
