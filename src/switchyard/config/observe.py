"""What the gateway records about itself: metrics, decision traces, their retention, and
OpenTelemetry spans."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from switchyard.config.base import Strict


class OtelConfig(Strict):
    exporter: Literal["none", "otlp", "file"] = "none"
    """`none`: no OpenTelemetry; `otlp`: spans over OTLP/HTTP to `endpoint` (or the
    OTEL_EXPORTER_OTLP_* variables); `file`: JSON lines to `path`."""
    endpoint: str | None = None
    """With `otlp`: the collector's OTLP/HTTP traces URL, used as given (e.g.
    http://collector:4318/v1/traces); null = the OTEL_EXPORTER_OTLP_* variables decide."""
    path: str | None = None
    """With `file` (required then): the file the spans are appended to as JSON lines."""
    service_name: str = "switchyard"
    """The spans' `service.name` resource attribute."""

    @model_validator(mode="after")
    def _file_needs_path(self) -> OtelConfig:
        if self.exporter == "file" and not self.path:
            raise ValueError("observe.otel.path is required when exporter is 'file'")
        return self


class ObserveConfig(Strict):
    metrics: bool = True
    """Serve Prometheus metrics at /metrics (see `metrics_public`)."""
    metrics_public: bool = False
    """/metrics names tenants and their spend, so by default it answers only the admin key
    (`Authorization: Bearer <admin key>`); true serves it to anyone who reaches the port (a scrape
    network the operator trusts)."""
    metrics_tenant_label: Literal["id", "hashed", "off"] = "id"
    """The `tenant` label of switchyard_requests_total and switchyard_cost_usd_total: `id` (the
    tenant id), `hashed` (a keyed hash of it: stable, but no one without the key can tell which
    tenant it is or test a guessed id), `off` (no tenant label at all)."""
    metrics_tenant_key_env: str = "SWITCHYARD_METRICS_TENANT_KEY"
    """Environment variable holding the secret that keys `hashed` (the admin key when it is unset).
    Changing it renames every hashed tenant series."""
    traces: bool = True
    """Keep a decision trace per request in the store (never prompt or reply bodies)."""
    traces_retention_days: float = Field(7.0, gt=0)
    """Days a decision trace is kept; older ones are deleted by the retention pass."""
    traces_max_rows: int = Field(1_000_000, ge=1)
    """Most decision traces kept; the retention pass deletes the oldest beyond it."""
    traces_sample_ok: float = Field(1.0, ge=0, le=1)
    """Share of plain successes (ok on the first attempt, no cache, no task, faster than
    `traces_slow_ms`) that keep their trace; every refused, failed, retried, fallen-back, cached,
    replayed, slow or task request keeps its own. Usage rows are always kept; 1.0 = trace
    everything."""
    max_disk_mb: float = Field(2048.0, gt=0)
    """MiB of data in the database past which the oldest traces, then the oldest rollout records,
    then `Idempotency-Key` replies, then stored responses (these two from the tenant holding the
    most of them first), then the oldest raw usage rows are deleted, down to 90 % of it (the
    daily rollups stay); checked every `retention_interval_s`."""
    traces_slow_ms: float = Field(1000.0, ge=0)
    """Milliseconds past which a successful request counts as slow and always keeps its trace (see
    `traces_sample_ok`)."""
    retention_interval_s: float = Field(300.0, gt=0)
    """Seconds between retention passes (`traces_retention_days`, `traces_max_rows`, `max_disk_mb`,
    `rl.retention_days`, `responses.retention_days`, `idempotency.ttl_s`)."""
    ledger_flush_ms: float = Field(20.0, ge=0, le=1000)
    """Group-commit window of the usage ledger, in milliseconds: the most a crash can lose of
    finished requests' rows. 0 commits every row as soon as the writer is free."""
    otel: OtelConfig = OtelConfig()
    """OpenTelemetry spans per request, pipeline stage and upstream attempt."""
