"""`switchyard bench engine`: prompt and decode speed of the embedded engine's build.

Issue #16 chose how llama.cpp is compiled (a portable x86-64-v3 baseline, no AVX-512 or
AMX) and whether its extra CPU buffer types (AMX tiles, repacked weights) are used.
This measures what those choices cost, in the same run: for each option, a fresh
process loads the shipped GGUF, evaluates a chat prompt of ~60 tokens and generates
`--tokens` tokens with end-of-sequence banned, `--rounds` times. It reports the median
prompt and decode tokens/s of each option and their ratio to the first (the default).

To compare two builds of the engine, run it once per build, e.g. with a native wheel
installed into a folder: `PYTHONPATH=/tmp/native switchyard bench engine`. The result
records the build's own system info line, the CPU, its AMX/AVX-512 flags and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from switchyard.engines.llamacpp import WARMUP_MESSAGES

# One measured option: `extra_buffer_types` as the engine config would set it.
OPTIONS = (("extra_buffer_types=false (default)", False), ("extra_buffer_types=true", True))


def _measure(extra: bool, tokens: int, threads: int) -> dict[str, Any]:
    """In this process: load, one warm-up generation, then one timed prompt + decode."""
    from llama_cpp import Llama

    from switchyard.engines.assets import smollm2_gguf_path
    from switchyard.engines.llamacpp_worker import _model_defaults, system_info

    t0 = time.perf_counter()
    with _model_defaults(extra):
        llm = Llama(
            model_path=smollm2_gguf_path(), n_ctx=2048, n_threads=threads, verbose=False, seed=0
        )
    load_s = time.perf_counter() - t0
    eos = llm.token_eos()
    calls: list[float] = []  # when each token was sampled
    seen: list[int] = []  # tokens in context at the first sample: the prompt

    def count(ids: Any, scores: Any) -> Any:
        if not calls:
            seen.append(len(ids))
        calls.append(time.perf_counter())
        scores[eos] = -float("inf")
        return scores

    from llama_cpp import LogitsProcessorList

    procs = LogitsProcessorList([count])
    messages: Any = WARMUP_MESSAGES
    llm.create_chat_completion(messages=messages, max_tokens=4, logits_processor=procs)
    calls.clear()
    seen.clear()
    llm.reset()  # no prompt cache: the timed prompt is evaluated in full
    start = time.perf_counter()
    llm.create_chat_completion(
        messages=messages, max_tokens=tokens, temperature=0.0, logits_processor=procs
    )
    first, last = calls[0], calls[-1]
    return {
        "load_s": load_s,
        "prompt_tokens": seen[0],
        "ttft_s": first - start,
        "prompt_tok_s": seen[0] / (first - start),
        "decode_tok_s": (len(calls) - 1) / (last - first) if len(calls) > 1 else 0.0,
        "generated": len(calls),
        "system_info": system_info(),
    }


def _child(extra: bool, tokens: int, threads: int) -> dict[str, Any]:
    code = (
        "import json, sys; from switchyard.bench.engine import _measure; "
        f"print(json.dumps(_measure({extra!r}, {tokens}, {threads})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=os.environ
    )
    if done.returncode != 0:
        from switchyard.engines.llamacpp import describe_exit

        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        return {"error": f"the engine {describe_exit(done.returncode)}: {tail}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _cpu() -> dict[str, Any]:
    model, flags = None, ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model is None:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = line.split(":", 1)[1]
            break
    names = set(flags.split())
    return {
        "model": model or platform.processor(),
        "cores": os.cpu_count(),
        "avx512f": "avx512f" in names,
        "amx": sorted(n for n in names if n.startswith("amx")),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for label, extra in OPTIONS:
        rounds = [_child(extra, args.tokens, args.threads) for _ in range(args.rounds)]
        ok = [r for r in rounds if "error" not in r]
        row: dict[str, Any] = {"option": label, "extra_buffer_types": extra, "rounds": rounds}
        if ok:
            row["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in ok)
            row["prompt_tok_s"] = statistics.median(r["prompt_tok_s"] for r in ok)
            row["system_info"] = ok[0]["system_info"]
        else:
            row["error"] = rounds[0]["error"]
        rows.append(row)
    base = rows[0].get("decode_tok_s")
    for row in rows:
        if base and "decode_tok_s" in row:
            row["decode_vs_default"] = row["decode_tok_s"] / base
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        version = None
    return {
        "benchmark": "engine",
        "workload": {
            "prompt": "WARMUP_MESSAGES (system + user, ~60 tokens with the chat template)",
            "generated_tokens": args.tokens,
            "rounds": args.rounds,
            "threads": args.threads,
            "eos": "banned",
        },
        "machine": {**_cpu(), "python": platform.python_version(), "kernel": platform.release()},
        "versions": {"llama-cpp-python": version},
        "options": rows,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per option")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the result as JSON here too")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    m = result["machine"]
    print(f"engine: llama-cpp-python {result['versions']['llama-cpp-python']} on {m['model']}")
    print(f"  cpu: avx512f={m['avx512f']} amx={m['amx'] or 'none'}  cores={m['cores']}")
    for row in result["options"]:
        if "error" in row:
            print(f"  {row['option']:<38} FAILED: {row['error']}")
            continue
        print(
            f"  {row['option']:<38} decode {row['decode_tok_s']:7.1f} tok/s"
            f"  ({row.get('decode_vs_default', 1.0):.2f}x default)"
            f"  prompt {row['prompt_tok_s']:7.1f} tok/s"
        )
    print(f"  build: {result['options'][0].get('system_info', '?')}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if all("error" not in r for r in result["options"]) else 1
