"""Observability: the Prometheus metrics (observe/metrics.py) and the OpenTelemetry
tracing (observe/otel.py) of one gateway, each None when switched off.

The metrics are built first: the registry's engine pool and the revision managers
take their hooks at construction (`engine_events`).
"""

from __future__ import annotations

from switchyard.config import Settings
from switchyard.engines.registry import PoolEvents
from switchyard.observe import otel
from switchyard.observe.metrics import Metrics, tenant_key


def build_metrics(settings: Settings) -> Metrics | None:
    """The metrics (observe.metrics), knowing the configured aliases: those, and only
    those, may label a request refused before its model was resolved."""
    obs = settings.observe
    if not obs.metrics:
        return None
    known = frozenset([m.alias for m in settings.models] + [settings.embeddings.alias])
    return Metrics(obs.metrics_tenant_label, tenant_key(settings), known)


def engine_events(metrics: Metrics | None) -> PoolEvents | None:
    """The residency pool's events, fed to the metrics (the registry builds the pool)."""
    if metrics is None:
        return None
    return PoolEvents(metrics.engine_event, metrics.engine_memory_mb, metrics.adapter_event)


def build_tracing(settings: Settings) -> otel.Tracing | None:
    """The tracer of observe.otel (None with exporter `none`)."""
    o = settings.observe.otel
    return otel.build_tracing(o.exporter, o.endpoint, o.path, o.service_name)
