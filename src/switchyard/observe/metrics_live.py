"""Live gauges of balanced deployments, read from their balancers at scrape time."""

from __future__ import annotations

from typing import Any


class _LiveCollector:
    """switchyard_deployment_in_flight and _ewma_ttft_seconds / _ewma_tpot_seconds."""

    def __init__(self, deployments: list[Any]) -> None:
        self._deps = deployments

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["model", "deployment"]
        flight = GaugeMetricFamily(
            "switchyard_deployment_in_flight", "Requests in flight per deployment", labels=labels
        )
        ttft = GaugeMetricFamily(
            "switchyard_deployment_ewma_ttft_seconds",
            "EWMA of time to first token per deployment",
            labels=labels,
        )
        tpot = GaugeMetricFamily(
            "switchyard_deployment_ewma_tpot_seconds",
            "EWMA of time per output token per deployment",
            labels=labels,
        )
        weight = GaugeMetricFamily(
            "switchyard_deployment_weight",
            "Each deployment's weight now (a canary's share)",
            labels=labels,
        )
        for d in self._deps:
            key = [d.alias, d.name]
            flight.add_metric(key, d.live.in_flight)
            weight.add_metric(key, d.live.weight)
            if d.live.ttft_s is not None:
                ttft.add_metric(key, d.live.ttft_s)
            if d.live.tpot_s is not None:
                tpot.add_metric(key, d.live.tpot_s)
        yield flight
        yield weight
        yield ttft
        yield tpot
