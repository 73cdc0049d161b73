"""The Responses events of a chat stream whose tool-call pieces (and text) interleave in
any order, as an upstream may send them with the tool gate off: api/responses_reply.py
`ResponseEvents` read chunk by chunk, as api/sse.py `translated` reads them.

Whatever the interleaving: no arguments delta comes after its item's
`response.output_item.done`; every item is done exactly once, in output order; each
call item's arguments (in its deltas, its done events and the final response) are all
its pieces in the order they came. Before this stop, a call item was done when the next
item opened, and a later piece of it came as a delta of a done item.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.api.responses_codec import check
from switchyard.api.responses_reply import ResponseEvents, Shell
from switchyard.reply import read_chunk

# (call index, argument piece), or (None, text): one chunk each
Step = tuple[int | None, str]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return json.dumps(
        {"id": "c1", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    ).encode()  # fmt: skip


@st.composite
def _streams(draw: st.DrawFn) -> list[Step]:
    """Up to four calls of up to four pieces each, and up to three pieces of text, in
    an order drawn (each call's own pieces in order)."""
    calls = draw(st.integers(1, 4))
    queues: list[list[Step]] = [
        [(k, p) for p in draw(st.lists(st.sampled_from(['{"a": ', "1", "}", " "]), max_size=4))]
        for k in range(calls)
    ]
    queues.append(
        [(None, t) for t in draw(st.lists(st.sampled_from(["Hi", " there"]), max_size=3))]
    )
    out: list[Step] = []
    while any(queues):
        live = [q for q in queues if q]
        out.append(draw(st.sampled_from(live)).pop(0))
    return out


@settings(max_examples=300, deadline=None)
@given(_streams())
def test_interleaved_calls_make_valid_events_whatever_the_order(steps: list[Step]) -> None:
    shell = Shell("resp_" + "3" * 32, check({"model": "m", "input": "x"}), "m")
    events = ResponseEvents(shell)
    out: list[bytes] = []
    heads: set[int] = set()
    for k, piece in steps:
        if k is None:
            events.chunk(read_chunk(_chunk({"content": piece})), out)
            continue
        call: dict[str, Any] = {"index": k, "function": {"arguments": piece}}
        if k not in heads:  # its first piece carries its id and name
            heads.add(k)
            call.update(id=f"call_{k}", type="function")
            call["function"]["name"] = "lookup"
        events.chunk(read_chunk(_chunk({"tool_calls": [call]})), out)
    events.chunk(read_chunk(_chunk({}, "tool_calls")), out)
    events.end(out)
    parsed = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in b"".join(out).split(b"\n\n") if e]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    final = events.final
    assert final is not None and final["status"] == "completed"
    output = final["output"]
    done: list[int] = []
    deltas: dict[int, str] = {}
    for p in parsed:
        if p["type"] == "response.function_call_arguments.delta":
            assert p["output_index"] not in done, f"a delta after its item was done: {p}"
            deltas[p["output_index"]] = deltas.get(p["output_index"], "") + p["delta"]
        elif p["type"] == "response.function_call_arguments.done":
            assert p["output_index"] not in done
            assert p["arguments"] == output[p["output_index"]]["arguments"]
        elif p["type"] == "response.output_item.done":
            done.append(p["output_index"])
            assert p["item"] == output[p["output_index"]]
    assert done == list(range(len(output))), done  # each once, in output order
    # Each call's arguments: all its pieces, in order, in the deltas and the item.
    calls = {
        i["call_id"]: (n, i["arguments"]) for n, i in enumerate(output) if i["type"] != "message"
    }
    assert sorted(calls) == sorted(f"call_{k}" for k in heads)
    for k in heads:
        n, arguments = calls[f"call_{k}"]
        assert arguments == "".join(p for c, p in steps if c == k)
        assert deltas.get(n, "") == arguments
    text = "".join(p for c, p in steps if c is None)
    said = "".join(i["content"][0]["text"] for i in output if i["type"] == "message")
    assert said == text
