"""The cache's cross-encoder, built in the background the first time a gateway runs the
semantic cache without it (`cache.build_encoder`, on by default).

`make serve` does not train it: the default gateway has the cache off, and a first
answer should not wait ~7 minutes for a model it does not use. A gateway whose config
asks for semantic hits starts with exact hits only; once it is ready (the models and
the embedding model loaded, so the build never competes with the start), it runs
`switchyard cache build-verifier` in a child process at a lower CPU priority, logs its
progress, and then completes the candidate check (decide/candidate.py) in place. Until
then every semantic candidate is vetoed with the reason below, and `/admin/cache/stats`
says the same in `semantic_checks`. The built model is cached per machine, keyed by the
data and recipe (decide/pair_encoder.py), so this happens once.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from switchyard.config import CacheConfig, EmbeddingsConfig
from switchyard.decide.candidate import CandidateCheck, load_encoder
from switchyard.decide.pair_encoder import EncoderMissing, PairEncoder

log = logging.getLogger("switchyard.cache")

# What the build takes on 2 cores (train, export, quantise, choose the cuts), for the
# message; scaled by the core count.
EXPECTED_S_ON_2_CORES = 420


def expected_minutes(cores: int) -> int:
    return max(1, round(EXPECTED_S_ON_2_CORES * 2 / max(1, cores) / 60))


def command(directory: Path, threshold: float) -> list[str]:
    """The child process: the CLI's own build into the gateway's cache folder, for its
    threshold, under `nice` where there is one."""
    argv = [sys.executable, "-m", "switchyard", "cache", "build-verifier"]
    argv += ["--dir", str(directory), "--threshold", repr(threshold)]
    nice = shutil.which("nice")
    return [nice, "-n", "10", *argv] if nice else argv


async def build_in_background(
    check: CandidateCheck,
    load: Callable[[], PairEncoder],
    ready: Callable[[], bool],
    describe: Callable[[str], None],
    argv: list[str],
    cores: int,
) -> None:
    """Wait for `ready`, build, then `check.attach` what `load` returns. `describe` is
    told the chain's description at each change (the cache's stats show it)."""
    while not ready():
        await asyncio.sleep(0.5)
    started = time.strftime("%H:%M:%S")
    t0 = time.monotonic()
    check.unavailable = (
        f"the cache's cross-encoder is being built in the background (since {started}, "
        f"about {expected_minutes(cores)} min on {cores} cores, once per machine); "
        "exact hits only until then"
    )
    describe(check.describe())
    log.info("building the cache's cross-encoder in the background: %s", " ".join(argv))
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    last = ""
    try:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                last = line
                log.info("cross-encoder build (%.0f s): %s", time.monotonic() - t0, line[:300])
        code = await proc.wait()
    except asyncio.CancelledError:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if code != 0:
        check.unavailable = (
            f"the cache's cross-encoder build failed (exit {code}: {last[:200]}); semantic "
            "hits stay off: run `switchyard cache build-verifier` and restart"
        )
        describe(check.describe())
        log.error("semantic cache hits stay off: %s", check.unavailable)
        return
    loop = asyncio.get_running_loop()
    try:
        encoder = await loop.run_in_executor(None, load)
    except Exception as exc:  # a build that wrote nothing loadable
        check.unavailable = f"the cache's cross-encoder was built but does not load ({exc})"
        describe(check.describe())
        log.error("semantic cache hits stay off: %s", check.unavailable)
        return
    check.attach(encoder)
    describe(check.describe())
    log.info(
        "the cache's cross-encoder is built (%.0f s): semantic hits are on (%s)",
        time.monotonic() - t0,
        check.describe(),
    )


async def follow_build(
    check: CandidateCheck, load: Callable[[], PairEncoder], describe: Callable[[str], None]
) -> None:
    """A worker of several (`serve --workers N`): the control plane builds the encoder
    once; each worker attaches it when it exists (a check every FOLLOW_S)."""
    while check.missing:
        await asyncio.sleep(FOLLOW_S)
        try:
            encoder = load()
        except EncoderMissing:
            continue
        check.attach(encoder)
        describe(check.describe())
        log.info("the cache's cross-encoder the control plane built is attached")


FOLLOW_S = 15.0


def start(
    check: CandidateCheck | None,
    cache_cfg: CacheConfig,
    embeddings_cfg: EmbeddingsConfig,
    ready: Callable[[], bool],
    describe: Callable[[str], None],
    cores: int,
    follow: bool = False,
) -> asyncio.Task[None] | None:
    """The background build's task, when the check is missing its encoder; with
    `follow` (a worker of several), the task that attaches the control plane's build."""
    from switchyard.embed import cache_dir

    if check is None or not check.missing or not cache_cfg.build_encoder:
        return None
    if follow:
        return asyncio.create_task(
            follow_build(check, lambda: load_encoder(cache_cfg, embeddings_cfg), describe)
        )
    return asyncio.create_task(
        build_in_background(
            check,
            lambda: load_encoder(cache_cfg, embeddings_cfg),
            ready,
            describe,
            command(cache_dir(embeddings_cfg), cache_cfg.threshold),
            cores,
        )
    )
