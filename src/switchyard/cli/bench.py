"""`switchyard bench ...`: each benchmark's options come from its own module in
switchyard.bench, which also runs it."""

from __future__ import annotations

import argparse


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from switchyard.bench.overhead import add_arguments as add_overhead

    add_overhead(bsub.add_parser("overhead", help="gateway overhead vs direct and a bare proxy"))
    from switchyard.bench.compare import add_compare_arguments
    from switchyard.bench.run import add_run_arguments

    add_run_arguments(
        bsub.add_parser(
            "run", help="load an OpenAI-compatible endpoint: latency, throughput, goodput"
        )
    )
    add_compare_arguments(
        bsub.add_parser("compare", help="two `bench run` results side by side, with ratios")
    )
    from switchyard.bench.cache import add_arguments as add_cache_bench

    add_cache_bench(bsub.add_parser("cache", help="cache lookup latency, embedding, hit vs miss"))
    from switchyard.bench.engine import add_arguments as add_engine_bench

    add_engine_bench(
        bsub.add_parser("engine", help="embedded engine: decode tok/s per build option")
    )
    from switchyard.bench.engines import add_arguments as add_engines_bench

    add_engines_bench(
        bsub.add_parser(
            "engines", help="engine pool: tok/s by concurrency, gateway vs direct, adapters"
        )
    )
    from switchyard.bench.balance import add_arguments as add_balance_bench

    add_balance_bench(
        bsub.add_parser(
            "balance", help="several deployments per alias: selection cost, skewed load"
        )
    )
    from switchyard.bench.placement import add_arguments as add_placement_bench

    add_placement_bench(
        bsub.add_parser(
            "placement", help="edge or cloud over a device and network trace, with hysteresis"
        )
    )
    from switchyard.bench.ray import add_arguments as add_ray_bench

    add_ray_bench(
        bsub.add_parser("ray", help="Ray Serve: gateway on Ray vs engine via Serve vs one machine")
    )
    from switchyard.bench.cache_shared import add_arguments as add_cache_shared

    add_cache_shared(
        bsub.add_parser(
            "cache-shared", help="cache entries shared through Redis: propagation and cost"
        )
    )
    from switchyard.bench.soak import add_arguments as add_soak

    add_soak(bsub.add_parser("soak", help="realistic config under steady load: RSS, disk, latency"))
    from switchyard.bench.media import add_arguments as add_media_bench

    add_media_bench(bsub.add_parser("media", help="image preprocessing stages: time, img/s, RSS"))
    from switchyard.bench.hotpath import add_arguments as add_hotpath

    add_hotpath(
        bsub.add_parser("hotpath", help="the gateway's own CPU and instructions per request")
    )
    from switchyard.bench.rollouts import add_arguments as add_rollouts_bench

    add_rollouts_bench(
        bsub.add_parser("rollouts", help="RL rollouts: tok/s at n = 1, 4, 8; revision swap times")
    )
    from switchyard.bench.tools import add_arguments as add_tools_bench

    add_tools_bench(bsub.add_parser("tools", help="MCP tools/call through /mcp vs direct"))
