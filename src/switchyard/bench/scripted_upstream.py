"""A scripted OpenAI-compatible upstream: instant fixed answers, and faults on request.

Benchmarks need an upstream whose own cost is tiny and constant, so that what they measure
is the gateway in front of it; tests need one that fails exactly the way they ask. This
server answers every generation request at once with the same tokens (response bytes are
built once and reused), and injects a fault when a request names one.

Faults (request header `x-scripted-fault`, else the `--fault` default, else the one set at
run time with `PUT /control/fault`), comma-separated, e.g. `delay:100,status:503`:

- `status:<code>`   answer with that HTTP status and an OpenAI error body
                    (`status:429` also sends `Retry-After: 1`)
- `busy:<s>`        answer 503 with `Retry-After: <s>` (an upstream at capacity)
- `delay:<ms>`      sleep before answering
- `hang`            never answer (waits until the client leaves, at most an hour)
- `drop-mid-stream` send half the tokens, then close the connection (no `[DONE]`;
                    a non-streaming reply is cut in half under its full Content-Length)
- `close`           close the connection without any response
- `slow:<ms>`       stream: wait this long before each event (a long generation)
- `stream-error:<code>` Messages streams only: half the events, then an `error`
                    event of that status's type (elsewhere it changes nothing)

Tool calls: `PUT /control/tool_calls` with `{"calls": [{"name", "arguments"}, ...]}`
makes every later chat reply call those tools (with `"until_result": true`, only until
the conversation ends with a tool result: an agent's step) (`finish_reason: "tool_calls"`; streamed
as OpenAI does: the id and name first, then the arguments in pieces); `{"calls": []}`
goes back to text. `GET /stats` also says how many streams are open now
(`open_streams`) and how many were closed by the client before their end (`aborted`).

Capacity (`--concurrency N --service-ms B --token-ms T`): at most N generation requests are
served at once, each holding its slot for B + T x (its output tokens) ms before it answers;
more wait in arrival order. A deployment of known capacity (N / mean service time), for
the scheduling benchmark (bench/scheduling.py). A prompt that contains `[[tokens:K]]` is
answered with K tokens (at most its max_tokens), so a workload sets each call's output
length below the cap it sends, as real generations end before their cap.

Anthropic's Messages API: `POST /v1/messages` answers in its wire format (a `message`, or
its SSE events with `stream: true`; text, or `tool_use` blocks for the tool calls above;
the faults above with error bodies in its shape, `status:529` its overloaded error) after
checking the request as the provider would (bench/scripted_messages.py).
`--anthropic-key KEY` makes it require `x-api-key: KEY`. `GET /control/last` shows the
last generation request's body (a Messages request's with its `x-api-key`,
`authorization` and `anthropic-version` headers).

Faults apply to the generation routes only, so `/health`, `/stats` and `/v1/models`
stay usable for readiness polling and counting. `GET /stats` says how many generation
requests arrived (faulted ones included: that is what a retry test counts);
`DELETE /stats` resets the count.

    python -m switchyard.bench.scripted_upstream --port 9001 --tokens 16
"""

from __future__ import annotations

import argparse

import uvicorn

# What benches and tests import from here is re-exported (`name as name`) from the
# modules that define it.
from switchyard.bench.scripted_upstream_app import WORDS as WORDS
from switchyard.bench.scripted_upstream_app import ScriptedUpstream as ScriptedUpstream
from switchyard.bench.scripted_upstream_faults import Fault as Fault
from switchyard.bench.scripted_upstream_faults import error_body as error_body
from switchyard.bench.scripted_upstream_faults import parse_fault as parse_fault


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m switchyard.bench.scripted_upstream",
        description="A scripted OpenAI-compatible upstream for benchmarks and fault tests.",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9001)
    ap.add_argument("--tokens", type=int, default=16, help="tokens in every answer")
    ap.add_argument("--model-name", default="scripted", help="model id the upstream reports")
    ap.add_argument("--fault", default=None, help="fault for every generation request")
    ap.add_argument("--record", default=None, help="append each generation body to this file")
    ap.add_argument("--echo", action="store_true", help="answer with the last message")
    ap.add_argument(
        "--anthropic-key", default=None, help="the x-api-key that /v1/messages requires"
    )
    ap.add_argument(
        "--tool-calls",
        default=None,
        help='comma-separated tool names every chat reply calls (arguments {"q": "x"})',
    )
    ap.add_argument(
        "--concurrency", type=int, default=None, help="requests served at once (capacity)"
    )
    ap.add_argument("--service-ms", type=float, default=0.0, help="per request, with a capacity")
    ap.add_argument("--token-ms", type=float, default=0.0, help="per output token, likewise")
    args = ap.parse_args(argv)
    try:
        app = ScriptedUpstream(
            tokens=args.tokens,
            model_name=args.model_name,
            fault=args.fault,
            record=args.record,
            echo=args.echo,
            anthropic_key=args.anthropic_key,
            concurrency=args.concurrency,
            service_ms=args.service_ms,
            token_ms=args.token_ms,
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.tool_calls:
        app.tool_calls = [
            {"name": n.strip(), "arguments": '{"q": "x"}'}
            for n in args.tool_calls.split(",")
            if n.strip()
        ]
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
