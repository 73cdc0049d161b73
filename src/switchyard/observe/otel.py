"""OpenTelemetry: a span per request, per pipeline stage and per upstream attempt.

The request span is started when the request arrives, as a child of the client's
W3C `traceparent` when one is sent; each attempt span is live while the upstream
call runs, and its context goes upstream in `traceparent`. Stage spans are written
when the request ends, from the recorded decisions (exact start and duration), so
the hot path pays nothing for them. Attributes follow the GenAI semantic
conventions (`gen_ai.*`). Export: OTLP over HTTP to a collector, or JSON lines to a
file (handy for local debugging and for tests).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from switchyard.pipeline import RequestContext
from switchyard.request import Generation

OPERATION = {
    "chat.completions": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "tools.call": "execute_tool",  # an MCP tool call through /mcp (mcp_service/)
}


class JsonLinesExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object per line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            assert ctx is not None
            lines.append(
                json.dumps(
                    {
                        "name": s.name,
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_span_id": f"{s.parent.span_id:016x}" if s.parent else None,
                        "start_ns": s.start_time,
                        "end_ns": s.end_time,
                        "status": s.status.status_code.name,
                        "attributes": dict(s.attributes or {}),
                    },
                    default=str,
                )
            )
        with self._lock, open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class Tracing:
    def __init__(
        self, exporter: SpanExporter, service_name: str = "switchyard", batch: bool = True
    ) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        # Batching keeps export (serialization, I/O) off the event loop.
        processor = (
            BatchSpanProcessor(exporter, schedule_delay_millis=500)
            if batch
            else SimpleSpanProcessor(exporter)
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("switchyard")

    def start_request(self, ctx: RequestContext, headers: Any, start_ns: int) -> None:
        parent = (
            extract({"traceparent": headers["traceparent"]}) if headers.get("traceparent") else None
        )
        span = self.tracer.start_span(
            f"{OPERATION.get(ctx.input.endpoint, ctx.input.called)}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=start_ns,
            attributes={"switchyard.request_id": ctx.input.request_id},
        )
        if ctx.input.client_request_id is not None:
            span.set_attribute("switchyard.client_request_id", ctx.input.client_request_id)
        ctx.otel_span = span

    def start_attempt(
        self, ctx: RequestContext, alias: str, upstream: str
    ) -> tuple[Span | None, dict[str, str]]:
        """A live span for one upstream call, and the headers that carry it upstream."""
        parent: Span | None = ctx.otel_span
        if parent is None:
            return None, {}
        span = self.tracer.start_span(
            f"attempt {alias}",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes={
                "switchyard.request_id": ctx.input.request_id,
                "gen_ai.request.model": alias,
                "server.address": upstream,
            },
        )
        carrier: dict[str, str] = {}
        inject(carrier, context=trace.set_span_in_context(span))
        return span, carrier

    @staticmethod
    def end_attempt(span: Span | None, error: str | None) -> None:
        if span is None:
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def finish(self, ctx: RequestContext, status: str, inp: int, out: int, end_ns: int) -> None:
        span: Span | None = ctx.otel_span
        if span is None:
            return
        parent_ctx = trace.set_span_in_context(span)
        base = ctx.clock_base
        for d in ctx.decisions:
            stage, outcome, reason, t0, t1 = d.stage, d.outcome, d.reason, d.t0, d.t1
            start = int((base + t0) * 1e9)
            s = self.tracer.start_span(
                f"stage {stage}",
                context=parent_ctx,
                start_time=start,
                attributes={
                    "switchyard.stage": stage,
                    "switchyard.outcome": outcome,
                    "switchyard.reason": reason[:500],
                    "switchyard.request_id": ctx.input.request_id,
                },
            )
            s.end(end_time=start + int((t1 - t0) * 1e9))
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": OPERATION.get(ctx.input.endpoint, ctx.input.called),
            "gen_ai.system": "openai",
            "gen_ai.request.model": ctx.alias or "",
            "gen_ai.usage.input_tokens": inp,
            "gen_ai.usage.output_tokens": out,
            "switchyard.status": status,
            "switchyard.attempts": ctx.run.attempts,
        }
        if ctx.deployment is not None:
            attrs["gen_ai.response.model"] = ctx.deployment.alias
            attrs["switchyard.revision"] = ctx.deployment.model.revision
            attrs["server.address"] = ctx.deployment.label
        if ctx.principal is not None:
            attrs["switchyard.tenant"] = ctx.principal.tenant_id
        if ctx.input.task_id:
            attrs["switchyard.task_id"] = ctx.input.task_id
        if ctx.input.endpoint == "tools.call":  # GenAI conventions for tool execution
            attrs["gen_ai.tool.name"] = ctx.alias or ""
            attrs["gen_ai.system"] = "mcp"
        req = ctx.request
        if isinstance(req, Generation) and req.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = req.max_tokens
        span.set_attributes(attrs)
        if status not in ("ok",):
            span.set_status(Status(StatusCode.ERROR, ctx.error_code or status))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()


def build_tracing(
    exporter: str, endpoint: str | None, path: str | None, service: str
) -> Tracing | None:
    if exporter == "none":
        return None
    if exporter == "file":
        assert path is not None
        return Tracing(JsonLinesExporter(path), service)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return Tracing(OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter(), service)
