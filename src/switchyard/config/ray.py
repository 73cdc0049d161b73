"""`switchyard serve --ray`: the gateway and the local engines as Ray Serve deployments."""

from __future__ import annotations

from pydantic import Field, model_validator

from switchyard.config.base import Strict


class RayEngineScaling(Strict):
    """Ray Serve autoscaling of each local model's engine deployment (scale/ray_app.py)."""

    min_replicas: int = Field(1, ge=0, le=1000)
    """Fewest replicas Serve keeps of each local model's engine deployment."""
    max_replicas: int = Field(2, ge=1, le=1000)
    """Most replicas Serve scales each engine deployment to."""
    initial_replicas: int | None = Field(None, ge=0, le=1000)
    """Replicas each engine deployment starts with; null = Serve's default."""
    target_ongoing_requests: float = Field(2.0, gt=0, le=10_000)
    """Requests in flight per replica that Serve aims for; more adds replicas."""
    max_ongoing_requests: int = Field(8, ge=1, le=100_000)
    """Most requests Serve sends one engine replica at once; the rest queue at the proxy
    (`max_queued_requests`)."""
    max_queued_requests: int = Field(64, ge=-1, le=100_000)
    """Requests queued at each Serve proxy beyond what the replicas take (-1 = no bound). Past it
    Serve answers 503 with Retry-After at once, passed on as 503 `upstream_overloaded` unless a
    retry fits in the request's deadline."""
    retry_after_s: int = Field(2, ge=1, le=3600)
    """Seconds in the Retry-After of Serve's 503 when the queue is full."""
    upscale_delay_s: float = Field(5.0, ge=0, le=3600)
    """Seconds load must stay above the target before Serve adds a replica."""
    downscale_delay_s: float = Field(30.0, ge=0, le=86_400)
    """Seconds load must stay below the target before Serve removes a replica."""
    num_cpus: float = Field(1.0, ge=0, le=1024)
    """CPUs Ray reserves per engine replica."""
    num_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves per engine replica (fractions share one); 0 = none."""
    startup_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Seconds a new replica may take to answer its first real request (weight load)."""

    @model_validator(mode="after")
    def _bounds(self) -> RayEngineScaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas may not exceed max_replicas")
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests: -1 (no bound) or at least 1")
        return self


class RayConfig(Strict):
    """`switchyard serve --ray` and the Serve config (`switchyard ray-config`): the
    gateway as N replicas behind Ray Serve's proxy, each local model's engine as its own
    autoscaled deployment, reached by the gateway through that proxy."""

    gateway_replicas: int = Field(2, ge=1, le=1000)
    """Gateway replicas behind Serve's HTTP proxy."""
    gateway_num_cpus: float = Field(0.5, ge=0, le=1024)
    """CPUs Ray reserves per gateway replica."""
    host: str = "0.0.0.0"
    """Address of Serve's HTTP proxy: where clients call the gateway, and where the gateway calls
    the engines (/engines/{alias}/v1) on its own node."""
    port: int = Field(8000, ge=1, le=65535)
    """Port of Serve's HTTP proxy (see `host`)."""
    engines: RayEngineScaling = RayEngineScaling()
    """Autoscaling and resources of each local model's engine deployment."""
