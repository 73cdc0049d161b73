"""Observability: the Prometheus metrics (observe/metrics.py) and the OpenTelemetry
tracing (observe/otel.py) of one gateway, each None when switched off.
"""

from __future__ import annotations

from switchyard.config import Settings
from switchyard.engines.pool import EnginePool
from switchyard.observe import otel
from switchyard.observe.metrics import Metrics, tenant_key


def build_metrics(settings: Settings, pool: EnginePool) -> Metrics | None:
    """The metrics (observe.metrics), fed by the engine pool's events."""
    obs = settings.observe
    metrics = Metrics(obs.metrics_tenant_label, tenant_key(settings)) if obs.metrics else None
    # The pool is built inside the registry and Metrics takes no aliases at
    # construction, so these are set on the built objects.
    if metrics is not None:
        pool.on_event = metrics.engine_event
        pool.on_memory = metrics.engine_memory_mb
        pool.on_adapter = metrics.adapter_event
    if metrics is not None:  # aliases that may label a refused request
        metrics.known_models = frozenset(
            [m.alias for m in settings.models] + [settings.embeddings.alias]
        )
    return metrics


def build_tracing(settings: Settings) -> otel.Tracing | None:
    """The tracer of observe.otel (None with exporter `none`)."""
    o = settings.observe.otel
    return otel.build_tracing(o.exporter, o.endpoint, o.path, o.service_name)
