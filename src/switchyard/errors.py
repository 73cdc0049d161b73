"""One error hierarchy, mapped once to each protocol's error body and an HTTP status.

Callers raise the class that names what went wrong; the API boundary turns any
`SwitchyardError` into its protocol's body with the class's status: OpenAI's
`{"error": {"message", "type", "param", "code"}}` (`body`), or on the Anthropic
Messages routes `{"type": "error", "error": {"type", "message"}}` (`anthropic_body`). Anything else becomes a 500 with a generic message: no stack trace
ever reaches a client.

Every error a client can see is a class below, with its status and code; a raise site
names the class and never passes its own code string (tests/unit/test_error_tree.py checks
this tree against the classes, and the raise sites). `UpstreamStatusError` answers with
the upstream's own 4xx status.

    SwitchyardError               500  internal_error
      InvalidRequest              400  invalid_request
        CallIdRequired            400  call_id_required
        ChecksumMismatch          400  checksum_mismatch
        ContextLengthExceeded     400  context_length_exceeded
        DuplicateJsonKey          400  duplicate_key
        InvalidCallId             400  invalid_call_id
        InvalidHeader             400  invalid_header
          VersionNotNegotiated    400  invalid_header
        InvalidHttpFraming        400  invalid_http
        MediaFetchRefused         400  media_fetch_refused
        MediaTimeout              400  media_timeout
        MediaTooLarge             400  media_too_large
        MediaUnsupported          400  media_unsupported
        MissingRequiredParameter  400  missing_required_parameter
        PiiDetected               400  pii_detected
        TooManyToolResults        400  too_many_tool_results
        UnknownTool               400  unknown_tool
        UnstorableValue           400  invalid_request
      AuthenticationError         401  invalid_api_key
        InvalidAdminKey           401  invalid_admin_key
      PermissionDenied            403  model_not_allowed
        AdapterNotAllowed         403  adapter_not_allowed
        AdminDisabled             403  admin_disabled
        ApprovalRequired          403  approval_required
        CsrfFailed                403  csrf_failed
        ModelNotAllowed           403  model_not_allowed
        NoEligibleRoute           403  no_eligible_route
        PathNotAllowed            403  path_not_allowed
        RegionNotAllowed          403  region_not_allowed
        RevisionPinNotAllowed     403  revision_pin_not_allowed
        ToolNotAllowed            403  tool_not_allowed
        WeightsLoadingDisabled    403  weights_loading_disabled
      ModelNotFound               404  model_not_found
      NotFound                    404  not_found
      RevisionNotFound            404  revision_not_found
      RouteNotFound               404  not_found
        SessionNotFound           404  session_not_found
      MethodNotAllowed            405  method_not_allowed
      RequestTimeout              408  request_timeout
      Conflict                    409  conflict
        CallIdConflict            409  call_id_conflict
        ToolCallDone              409  tool_call_done
        ToolCallInFlight          409  tool_call_in_flight
        ToolCallRefused           409  tool_call_refused
      RevisionConflict            409  revision_conflict
      TaskCancelled               409  task_cancelled
      ToolCallInDoubt             409  tool_call_in_doubt
      PayloadTooLarge             413  request_too_large
      UnsupportedMediaType        415  unsupported_media_type
      IdempotencyConflict         422  idempotency_key_reused
      RateLimited                 429  rate_limit_exceeded
        BackgroundLimitReached    429  background_limit
        MediaQueueFull            429  media_queue_full
        QueueFull                 429  queue_full
        QuotaExceeded             429  insufficient_quota
        TaskBudgetExceeded        429  task_budget_exceeded
        TokensExceedLimit         429  tokens_exceed_limit
        TooManySessions           429  too_many_sessions
        UpstreamRateLimited       429  upstream_rate_limited
      UpstreamStatusError         4xx  upstream_rejected
      ClientDisconnected          499  client_disconnected
      AssetMissing                500  asset_missing
      InternalError               500  internal_error
      PiiFailure                  500  pii_masking_failed
      StoredResponseUnreadable    500  stored_response_unreadable
      UpstreamError               502  upstream_error
        EngineCrashed             502  engine_crashed
        ToolResultTooLarge        502  tool_result_too_large
        ToolServerError           502  tool_server_error
        UpstreamUnreachable       502  upstream_unreachable
        UpstreamOverloaded        503  upstream_overloaded
      DatabaseUnavailable         503  store_unavailable
      EngineNotReady              503  engine_not_ready
        AdapterBusy               503  adapter_busy
        CircuitOpen               503  circuit_open
        EngineFailed              503  engine_failed
        LimiterDown               503  limiter_unavailable
        ModelLoading              503  model_loading
        NoActiveRevision          503  no_active_revision
        RouterNotReady            503  router_not_ready
        TaskStateUnavailable      503  task_state_unavailable
      Overloaded                  503  overloaded
      PlacementRefused            503  placement_refused
      SharedStateUnavailable      503  shared_state_unavailable
      ToolServerUnavailable       503  tool_server_unavailable
        ToolCircuitOpen           503  tool_circuit_open
      DeadlineExceeded            504  deadline_exceeded
        DeadlineUnreachable       504  deadline_unreachable
      TaskDeadlineExceeded        504  task_deadline_exceeded
      UpstreamTimeout             504  upstream_timeout
        MediaDeadlineExceeded     504  deadline_exceeded
        ToolTimeout               504  tool_timeout
"""

from __future__ import annotations

import sqlite3
from typing import Any


class SwitchyardError(Exception):
    """Base of every error a client may see."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    # For upstream failures: the retry class ("connect", "timeout", "429", "500", ...,
    # "broken"); None means final (never retried).
    retry_class: str | None = None
    retry_after_s: float | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message  # for the client: stable, no exception text
        # For the log and the trace only (exception text, an upstream's own words);
        # the trace masks PII in it before it is stored.
        self.detail = detail
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error body (every OpenAI route, the admin API)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def jsonrpc_error(self) -> dict[str, Any]:
        """The JSON-RPC error object (`/mcp`): its code from the status (JSONRPC_CODES),
        our type and code in `data`."""
        return {
            "code": jsonrpc_code(self.status),
            "message": self.message,
            "data": {"type": self.type, "code": self.code, "status": self.status},
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The Anthropic error body (`/v1/messages`): its `type` from the status, as
        the Messages API types errors (ANTHROPIC_TYPES); our `code` beside it."""
        return {
            "type": "error",
            "error": {
                "type": anthropic_type(self.status),
                "message": self.message,
                "code": self.code,
            },
        }


# The Anthropic error type of each status the gateway answers (others: invalid_request_error
# below 500, api_error from 500).
ANTHROPIC_TYPES = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


# The JSON-RPC error code of each status on `/mcp`: the protocol's own where one fits
# (invalid params, invalid request, internal error), else one of the range JSON-RPC
# leaves to servers (-32000 to -32099).
JSONRPC_CODES = {
    400: -32602,
    401: -32040,
    403: -32043,
    404: -32602,
    409: -32049,
    413: -32600,
    429: -32029,
    503: -32053,
    504: -32054,
}


def jsonrpc_code(status: int) -> int:
    return JSONRPC_CODES.get(status) or (-32603 if status >= 500 else -32600)


def anthropic_type(status: int) -> str:
    """The Anthropic error type of an HTTP status."""
    return ANTHROPIC_TYPES.get(status) or (
        "api_error" if status >= 500 else "invalid_request_error"
    )


class InvalidRequest(SwitchyardError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnstorableValue(InvalidRequest, sqlite3.DataError):
    """A value the database cannot hold: a NUL character in text (PostgreSQL refuses it
    in `text`; SQLite's connections refuse it alike, state/sql.py), or a value too long
    for an index (PostgreSQL's B-tree entries hold about 2.7 kB). A client that sent it
    gets a 400 naming the rule, never the database's text; the ledger writer keeps the
    rest of a batch that holds one (state/ledger_batch.py). A `sqlite3.DataError` too,
    so each store's handling of a value error holds for it."""

    def __init__(
        self,
        message: str = "a value holds a NUL character (\\u0000), which the gateway cannot store",
    ) -> None:
        super().__init__(message)


class AuthenticationError(SwitchyardError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(SwitchyardError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class AdapterNotAllowed(PermissionDenied):
    code = "adapter_not_allowed"


class ModelNotFound(SwitchyardError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    @classmethod
    def unknown(cls, alias: str) -> ModelNotFound:
        """A model the gateway serves none of: its name quoted within a bound."""
        return cls(
            f"the model '{alias[:128]}' does not exist; GET /v1/models lists the available ones",
            param="model",
        )


class RouteNotFound(SwitchyardError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(SwitchyardError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(SwitchyardError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(SwitchyardError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RequestTimeout(SwitchyardError):
    """The client did not send its body (or headers) in time; the connection closes."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Connection", "close")


class ClientDisconnected(SwitchyardError):
    """The client closed its connection before its request body had all arrived (or
    its body was so malformed that the HTTP layer closed it). Nobody is left to
    answer: the request is recorded as cancelled, not as a gateway error, so a client
    that hangs up cannot fill the error log or the error rate. 499 is nginx's
    "client closed request"; no client ever reads it."""

    status = 499
    type = "invalid_request_error"
    code = "client_disconnected"


class RateLimited(SwitchyardError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class InternalError(SwitchyardError):
    status = 500
    type = "server_error"
    code = "internal_error"


class UpstreamError(SwitchyardError):
    """The upstream answered with a server error or an unreadable reply."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"


class UpstreamOverloaded(UpstreamError):
    """The upstream answered 503 with a Retry-After: it is at capacity (a Serve
    deployment's queue is full while it scales out, a provider shedding load), not
    broken. The client gets 503 and the upstream's Retry-After; breakers do not count it
    as a failure."""

    status = 503
    code = "upstream_overloaded"


class UpstreamUnreachable(UpstreamError):
    status = 502
    code = "upstream_unreachable"


class ToolResultTooLarge(UpstreamError):
    """A tool's result past what the gateway passes on or keeps (`mcp.max_result_bytes`,
    or nested too deep): the call ran, its result is not kept, and a repeat of its id
    is refused the same way rather than run again."""

    code = "tool_result_too_large"


class DatabaseUnavailable(SwitchyardError):
    """The store's database (PostgreSQL) cannot be reached for a lookup the request
    needs (its key, its idempotency claim, an approval): refused, never guessed."""

    status = 503
    type = "server_error"
    code = "store_unavailable"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", "2")


class SharedStateUnavailable(SwitchyardError):
    """Redis cannot be reached for an operation that must reach every gateway
    process (a cache invalidation): it did not happen everywhere, and the caller must
    know."""

    status = 503
    type = "server_error"
    code = "shared_state_unavailable"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", "2")


class PlacementRefused(SwitchyardError):
    """The request's data may not leave the device (PII, or x-switchyard-data-boundary:
    device) and no device deployment can serve it now: refused, never sent elsewhere."""

    status = 503
    type = "server_error"
    code = "placement_refused"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", "2")


class EngineNotReady(SwitchyardError):
    """The model exists but its engine cannot serve yet (loading, restarting)."""

    status = 503
    type = "server_error"
    code = "engine_not_ready"

    def __init__(self, message: str, *, retry_after_s: int = 2, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(retry_after_s))


class EngineFailed(EngineNotReady):
    """The model's engine cannot start (it crashed at every start); the message says why.
    No Retry-After: retrying will not help until an operator acts."""

    code = "engine_failed"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.pop("Retry-After", None)


class ModelLoading(EngineNotReady):
    """The model is not loaded and this request cannot wait for its load (deadline,
    load queue, or no room in the pool); Retry-After says when to try again."""

    code = "model_loading"

    def __init__(self, message: str, *, retry_after: int = 2, **kw: Any) -> None:
        super().__init__(message, retry_after_s=retry_after, **kw)


class AdapterBusy(EngineNotReady):
    """The request's adapter could not be made active in time: every active-adapter
    slot (or every loaded adapter) of its engine was in use until its deadline, or the
    engine could not drain to load it; Retry-After says when to try again."""

    code = "adapter_busy"

    def __init__(self, message: str, *, retry_after: int = 1, **kw: Any) -> None:
        super().__init__(message, retry_after_s=retry_after, **kw)


class EngineCrashed(UpstreamError):
    """The local engine died while serving this request. Not retried on that engine
    (the same prompt may crash it again); a fallback model may still serve it."""

    code = "engine_crashed"


class UpstreamTimeout(SwitchyardError):
    status = 504
    type = "timeout_error"
    code = "upstream_timeout"


class UpstreamStatusError(SwitchyardError):
    """A 4xx reply from the upstream, passed to the client with its own status."""

    type = "invalid_request_error"
    code = "upstream_rejected"

    def __init__(self, status: int, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class TaskBudgetExceeded(RateLimited):
    """A task (`x-task-id`) has used what its budget allows; the message names the
    budget and what is left."""

    code = "task_budget_exceeded"


class TaskCancelled(SwitchyardError):
    """The task was cancelled (DELETE /v1/tasks/{id}): its calls are refused, and
    those in flight were stopped."""

    status = 409
    type = "invalid_request_error"
    code = "task_cancelled"


class TaskDeadlineExceeded(SwitchyardError):
    status = 504
    type = "timeout_error"
    code = "task_deadline_exceeded"


class ApprovalRequired(PermissionDenied):
    """A tool result for a tool that `requires_approval` came without a valid approval."""

    code = "approval_required"


# -- raised in one part of the gateway, defined here with every other client-visible error --


class AssetMissing(SwitchyardError):
    """A file the gateway needs (a model's weights, the embedding model) is not
    installed; the message says which and how to install it."""

    code = "asset_missing"


class CircuitOpen(EngineNotReady):
    """The model's circuit breaker is open after repeated failures; retry after
    `Retry-After`."""

    code = "circuit_open"


class Conflict(SwitchyardError):
    """A tenant that already exists (admin API)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class DeadlineExceeded(SwitchyardError):
    """The request's deadline (`server.default_deadline_s`, or a shorter
    `x-request-timeout`) passed while it waited or ran."""

    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


class DeadlineUnreachable(DeadlineExceeded):
    """The request could no longer finish before its deadline (the deadline minus the
    model's current service-time estimate has passed): refused at once, never sent upstream
    (`scheduling.policy: task_aware`)."""

    code = "deadline_unreachable"

    def __init__(self, message: str, *, evidence: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.evidence = evidence  # for the queue's decision record, never the client


class Overloaded(SwitchyardError):
    """The model is saturated and this request opens a new task: the queue had room, but the
    new task would take capacity that the tasks already admitted need to meet their deadlines
    (`scheduling.policy: task_aware`). Distinct from 429 `queue_full`; Retry-After says when the
    admitted work should have drained."""

    status = 503
    type = "server_error"
    code = "overloaded"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: int = 1,
        evidence: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(max(1, retry_after_s)))
        self.evidence = evidence  # for the queue's decision record, never the client


class IdempotencyConflict(SwitchyardError):
    """An `Idempotency-Key` already used by this tenant for a different request body."""

    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class MediaFetchRefused(InvalidRequest):
    """An image URL the fetch policy refuses (scheme, domain, address, redirects,
    `media.fetch.enabled` off)."""

    code = "media_fetch_refused"


class MediaQueueFull(RateLimited):
    """The image-processing queue (`media.queue`) is full; retry after `Retry-After`."""

    code = "media_queue_full"


class MediaTimeout(InvalidRequest):
    """An image could not be fetched within `media.fetch.timeout_s`."""

    code = "media_timeout"


class MediaTooLarge(InvalidRequest):
    """An image over `media.fetch.max_bytes` or `media.max_pixels`, or more images than
    `media.max_images`."""

    code = "media_too_large"


class MediaUnsupported(InvalidRequest):
    """An image that is not a decodable PNG, JPEG, GIF or WebP, or a data: URI that is
    not base64."""

    code = "media_unsupported"


class NoEligibleRoute(PermissionDenied):
    """Every route is excluded for this request (tenant allow lists, context bands)."""

    code = "no_eligible_route"

    def __init__(self, message: str, evidence: dict[str, Any]) -> None:
        super().__init__(message, param="model")
        self.evidence = evidence


class NotFound(SwitchyardError):
    """A tenant, key, request or task the admin API was asked for does not exist."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class StoredResponseUnreadable(SwitchyardError):
    """A stored response (`/v1/responses`) that does not open with this gateway's key:
    sealed with another key (gateways sharing PostgreSQL without the same
    `responses.encryption_key_env`), or altered at rest."""

    status = 500
    type = "server_error"
    code = "stored_response_unreadable"


class PiiFailure(SwitchyardError):
    """PII masking failed for a request that must be masked: it is refused rather than
    sent unmasked."""

    status = 500
    type = "server_error"
    code = "pii_masking_failed"


class QuotaExceeded(RateLimited):
    """A budget (tenant, key or task) has less left than this request needs, even at a
    minimal answer; the message names what is left."""

    code = "insufficient_quota"


class RevisionConflict(SwitchyardError):
    """A model revision that is already registered, or a change its state does not
    allow."""

    status = 409
    type = "invalid_request_error"
    code = "revision_conflict"


class RevisionNotFound(SwitchyardError):
    """A model revision the RL admin API was asked for does not exist."""

    status = 404
    type = "invalid_request_error"
    code = "revision_not_found"


class ToolCallInDoubt(SwitchyardError):
    """A side-effecting tool call whose outcome is unknown (it timed out or lost its
    connection after it was sent): never run again automatically."""

    status = 409
    type = "invalid_request_error"
    code = "tool_call_in_doubt"


class ToolServerUnavailable(SwitchyardError):
    """An MCP tool server is not connected, or all its call slots stayed busy: the call
    was not sent."""

    status = 503
    type = "server_error"
    code = "tool_server_unavailable"


# -- one class per refusal that keeps its base's status and type, and names its own code --


class MissingRequiredParameter(InvalidRequest):
    """A required body field (`model`, `messages`, `prompt`, `input`, `max_tokens`) is absent."""

    code = "missing_required_parameter"


class InvalidHeader(InvalidRequest):
    """A request header the gateway reads has a value it does not accept (`param` names it)."""

    code = "invalid_header"


class VersionNotNegotiated(InvalidHeader):
    """An MCP-Protocol-Version other than the one its session negotiated: 400, as the
    transport has it for a version the server does not support, with JSON-RPC's
    Invalid Request (-32600), as the MCP SDK answers its other header refusals."""

    def jsonrpc_error(self) -> dict[str, Any]:
        return {**super().jsonrpc_error(), "code": -32600}  # JSON-RPC's Invalid Request


class DuplicateJsonKey(InvalidRequest):
    """The JSON request body repeats a key within one object."""

    code = "duplicate_key"


class InvalidHttpFraming(InvalidRequest):
    """The request body's chunked framing is not valid HTTP/1.1."""

    code = "invalid_http"


class ContextLengthExceeded(InvalidRequest):
    """The prompt is longer than the model's context window: by the gateway's lower
    bound of it (the window stage), or by the engine's own count, with the output it
    asks for (engines/upstream.py maps the engine's refusal)."""

    code = "context_length_exceeded"


class PiiDetected(InvalidRequest):
    """The request holds personal data and the model's PII policy refuses it."""

    code = "pii_detected"


class TooManyToolResults(InvalidRequest):
    """A request carries more tool results (tool and function messages) than allowed."""

    code = "too_many_tool_results"


class ChecksumMismatch(InvalidRequest):
    """Weights registered with a `sha256` that the file does not match (RL admin API)."""

    code = "checksum_mismatch"


class InvalidCallId(InvalidRequest):
    """A tool call id (`_meta.call_id`) that is not 1 to 128 of A-Z a-z 0-9 . _ : -."""

    code = "invalid_call_id"


class CallIdRequired(InvalidRequest):
    """A side-effecting tool called without a call id while `mcp.require_call_id` is on."""

    code = "call_id_required"


class UnknownTool(InvalidRequest):
    """An MCP `tools/call` for a tool that no configured tool server offers."""

    code = "unknown_tool"


class InvalidAdminKey(AuthenticationError):
    """An admin API call whose bearer token is not the admin key."""

    code = "invalid_admin_key"


class ModelNotAllowed(PermissionDenied):
    """The API key may not use the model it asked for (or the one the router chose)."""

    code = "model_not_allowed"


class RegionNotAllowed(PermissionDenied):
    """Every deployment of the model asked for (or of its pinned revision) runs outside
    the tenant's regions: a refusal, never a wait (no Retry-After)."""

    code = "region_not_allowed"


class AdminDisabled(PermissionDenied):
    """The admin API is off: the environment variable holding its key is not set."""

    code = "admin_disabled"


class CsrfFailed(PermissionDenied):
    """A console change from another origin, or without the session's CSRF token."""

    code = "csrf_failed"


class RevisionPinNotAllowed(PermissionDenied):
    """A model revision pin from a key whose `may_pin_revisions` is off."""

    code = "revision_pin_not_allowed"


class WeightsLoadingDisabled(PermissionDenied):
    """Weights registered at run time while `rl.weights_dirs` is empty (RL admin API)."""

    code = "weights_loading_disabled"


class PathNotAllowed(PermissionDenied):
    """A weights path outside every folder of `rl.weights_dirs` (RL admin API)."""

    code = "path_not_allowed"


class ToolNotAllowed(PermissionDenied):
    """The API key may not run the MCP tool it called, or have a model call the tool
    its `tool_choice` forces."""

    code = "tool_not_allowed"


class SessionNotFound(RouteNotFound):
    """An `Mcp-Session-Id` this key does not hold (unknown, ended, or another key's)."""

    code = "session_not_found"


class QueueFull(RateLimited):
    """The model's admission queue is full; retry after `Retry-After`."""

    code = "queue_full"


class TokensExceedLimit(RateLimited):
    """The request alone needs more tokens than the whole tokens-per-minute limit."""

    code = "tokens_exceed_limit"


class UpstreamRateLimited(RateLimited):
    """The upstream answered 429; its `Retry-After` is passed on."""

    code = "upstream_rate_limited"


class TooManySessions(RateLimited):
    """The key already holds as many open MCP sessions as one key may."""

    code = "too_many_sessions"


class BackgroundLimitReached(RateLimited):
    """The tenant already runs `responses.max_background_per_tenant` background responses."""

    code = "background_limit"


class LimiterDown(EngineNotReady):
    """The rate limiter's state cannot be reached and limits fail closed."""

    code = "limiter_unavailable"


class TaskStateUnavailable(EngineNotReady):
    """The task state cannot be reached and task limits fail closed."""

    code = "task_state_unavailable"


class RouterNotReady(EngineNotReady):
    """The router has not loaded yet and no `routing.default_route` is set."""

    code = "router_not_ready"


class NoActiveRevision(EngineNotReady):
    """The RL model has no active revision whose engine is ready to serve."""

    code = "no_active_revision"


class ToolServerError(UpstreamError):
    """A read-only MCP tool call failed on its tool server's side."""

    code = "tool_server_error"


class ToolTimeout(UpstreamTimeout):
    """A read-only MCP tool call got no answer from its tool server in time."""

    code = "tool_timeout"


class MediaDeadlineExceeded(UpstreamTimeout):
    """The request's deadline passed while its images were fetched or processed."""

    code = "deadline_exceeded"


class ToolCircuitOpen(ToolServerUnavailable):
    """The tool server's circuit breaker is open after repeated failures: the call was not sent."""

    code = "tool_circuit_open"


class CallIdConflict(Conflict):
    """A tool call id already used for another tool or other arguments."""

    code = "call_id_conflict"


class ToolCallInFlight(Conflict):
    """A repeated tool call id whose first call is still running."""

    code = "tool_call_in_flight"


class ToolCallDone(Conflict):
    """A repeated tool call id that an operator resolved as run, with no stored result."""

    code = "tool_call_done"


class ToolCallRefused(Conflict):
    """The tool server refused a side-effecting call (a JSON-RPC error) before running it."""

    code = "tool_call_refused"
