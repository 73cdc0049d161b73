"""`switchyard determinism`: does a local model give the same tokens for the same
prompt alone, inside batches of other prompts (several sizes, the prompt first or
last), and after an engine restart? At temperature 0 and with a fixed seed at
temperature > 0. Per case: token-level equality, the first position where the
tokens differ, and the largest logprob difference over the tokens both share.

What llama.cpp documents: a fixed seed makes its sampler repeat; the numbers
themselves depend on the build, the CPU's kernels and the batch a sequence shares
(continuous batching changes the order of floating-point sums), with no batch-
invariance promise. vLLM likewise guarantees reproducibility only on the same
hardware and version, and its batch-invariant mode costs throughput. This command
measures what holds here rather than assuming it.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp

from switchyard.config import LlamaCppEngine, ModelConfig, VllmEngine
from switchyard.engines import rollout, vllm_sampling
from switchyard.engines.llamacpp import ManagedLlamaCpp
from switchyard.engines.vllm import ManagedVllm

GUARANTEES = {
    "llamacpp": (
        "llama.cpp: a fixed seed makes sampling repeat on the same build and hardware; "
        "no batch invariance is promised (a sequence's numbers may change with the batch "
        "it shares)"
    ),
    "vllm": (
        "vLLM: reproducible only on the same hardware and vLLM version, with a per-request "
        "seed; not batch-invariant unless run in its batch-invariant mode (at a cost)"
    ),
}


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Token equality, the first divergence and the largest shared-prefix logprob gap."""
    a, b = ref["token_ids"], got["token_ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    upto = len(a) if first is None else first
    diffs = [
        abs(x - y)
        for x, y in zip(ref["logprobs"][:upto], got["logprobs"][:upto], strict=False)
        if x is not None and y is not None
    ]
    finite = [d for d in diffs if math.isfinite(d)]
    return {
        "equal": first is None,
        "first_divergence": first,
        "max_logprob_diff": round(max(finite), 6) if finite else 0.0,
    }


async def _sample(
    session: aiohttp.ClientSession,
    engine: ManagedLlamaCpp,
    ids: list[int],
    s: rollout.Sampling,
) -> dict[str, Any]:
    if engine.kind == "vllm":
        return await vllm_sampling.sample(session, engine, ids, s)
    return await rollout.sample(session, engine, ids, s, None)


async def _prompt_ids(
    session: aiohttp.ClientSession, engine: ManagedLlamaCpp, p: dict[str, Any]
) -> list[int]:
    """The ids the engine reads for a prompt (a chat under the engine's own template)."""
    if engine.kind == "vllm":
        return await vllm_sampling.prompt_ids(session, engine, p)
    text = p.get("prompt")
    if text is None:
        text = await rollout.render_prompt(session, engine, p["messages"])
    return await rollout.tokenize(session, engine, str(text))


async def run(
    model: ModelConfig,
    prompts: list[dict[str, Any]],
    max_tokens: int = 32,
    seed: int = 1234,
    batches: str = "1,2,4",
) -> dict[str, Any]:
    """The report (see the module docstring)."""
    spec = model.engine
    sizes = sorted({max(1, int(x)) for x in batches.split(",") if x.strip()})
    name = f"{model.alias}-determinism"
    engine: ManagedLlamaCpp
    if isinstance(spec, VllmEngine):
        seqs = max(max(sizes), spec.max_num_seqs)
        engine = ManagedVllm(name, spec.model_copy(update={"lazy": False, "max_num_seqs": seqs}))
    elif isinstance(spec, LlamaCppEngine) and spec.runtime == "server":
        parallel = max(max(sizes), spec.parallel)
        engine = ManagedLlamaCpp(
            name, spec.model_copy(update={"lazy": False, "parallel": parallel})
        )
    else:
        raise SystemExit(
            "switchyard: determinism runs llamacpp models (server runtime) and vllm models"
        )
    settings = {
        "greedy": rollout.Sampling(0.0, 1.0, 0, 0.0, max_tokens, seed, (), 0),
        "seeded": rollout.Sampling(0.8, 0.95, 40, 0.0, max_tokens, seed, (), 0),
        # The rollout API's defaults: the whole vocabulary, where the least change in
        # the numbers can move a draw.
        "seeded, full vocabulary": rollout.Sampling(1.0, 1.0, 0, 0.0, max_tokens, seed, (), 0),
    }
    cases: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        engine.start()
        if not await engine.wait_ready(spec.startup_timeout_s):
            raise SystemExit(
                f"switchyard: the engine did not start: {engine.reason or engine.last_error}"
            )
        try:
            ids = [await _prompt_ids(session, engine, p) for p in prompts]
            facts = await (
                vllm_sampling.engine_facts(session, engine)
                if engine.kind == "vllm"
                else rollout.engine_facts(session, engine)
            )
            refs: dict[tuple[str, int], dict[str, Any]] = {}
            for mode, s in settings.items():
                for i, pid in enumerate(ids):
                    ref = await _sample(session, engine, pid, s)
                    refs[(mode, i)] = ref
                    again = await _sample(session, engine, pid, s)
                    cases.append(
                        {"prompt": i, "mode": mode, "case": "alone, again", **compare(ref, again)}
                    )
                    for size in sizes:
                        if size == 1 or len(ids) < 2:
                            continue
                        others = [ids[(i + k) % len(ids)] for k in range(1, size)]
                        for order in ("first", "last"):
                            batch = [pid, *others] if order == "first" else [*others, pid]
                            at = 0 if order == "first" else len(batch) - 1
                            outs = await asyncio.gather(
                                *(_sample(session, engine, b, s) for b in batch)
                            )
                            cases.append(
                                {
                                    "prompt": i,
                                    "mode": mode,
                                    "case": f"batch of {size}, {order}",
                                    **compare(ref, outs[at]),
                                }
                            )
                        # Joining a batch already decoding: its prompt is evaluated
                        # beside the others' decode steps (what a live server sees).
                        running = [
                            asyncio.create_task(_sample(session, engine, b, s)) for b in others
                        ]
                        await asyncio.sleep(0.05)
                        late = await _sample(session, engine, pid, s)
                        await asyncio.gather(*running)
                        cases.append(
                            {
                                "prompt": i,
                                "mode": mode,
                                "case": f"batch of {size}, joins mid-decode",
                                **compare(ref, late),
                            }
                        )
            await engine.stop()
            engine.start()
            if not await engine.wait_ready(engine.spec.startup_timeout_s):
                raise SystemExit("switchyard: the engine did not restart")
            for mode, s in settings.items():
                for i, pid in enumerate(ids):
                    got = await _sample(session, engine, pid, s)
                    cases.append(
                        {
                            "prompt": i,
                            "mode": mode,
                            "case": "after restart",
                            **compare(refs[(mode, i)], got),
                        }
                    )
        finally:
            await engine.stop()
    return {
        "model": model.alias,
        "engine": facts,
        "hardware": rollout.hardware(),
        "guarantee": GUARANTEES.get(engine.kind, ""),
        "max_tokens": max_tokens,
        "seed": seed,
        "batch_sizes": sizes,
        "sampling": {k: v.describe() for k, v in settings.items()},
        "cases": cases,
        "equal_all": all(c["equal"] for c in cases),
        "summary": _summary(cases),
    }


def _summary(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c in cases:
        key = f"{c['mode']}: {c['case'].split(',')[0]}"
        row = out.setdefault(key, {"cases": 0, "equal": 0, "max_logprob_diff": 0.0})
        row["cases"] += 1
        row["equal"] += bool(c["equal"])
        row["max_logprob_diff"] = max(row["max_logprob_diff"], c["max_logprob_diff"])
    return out


def render(report: dict[str, Any]) -> str:
    lines = [
        f"determinism of {report['model']} ({report['engine'].get('kind')} "
        f"{report['engine'].get('version')}) on {report['hardware']['cpu']}",
        report["guarantee"],
        "",
        f"{'case':<34} {'equal':>9} {'max |dlogprob|':>15}",
    ]
    for key, row in report["summary"].items():
        lines.append(
            f"{key:<34} {row['equal']:>4}/{row['cases']:<4} {row['max_logprob_diff']:>15.6f}"
        )
    lines.append("")
    lines.append("all equal" if report["equal_all"] else "NOT all equal: see the cases (--json)")
    return "\n".join(lines)
