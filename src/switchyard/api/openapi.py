"""The OpenAPI description served at /openapi.json.

The model routes are served straight from the ASGI call (app.py, `GatewayApp`), so
FastAPI does not see them; they are described here by hand, with the shapes and bounds
`policy/validate.py` enforces (what a client may send; the gateway still checks every
field itself). The rest (health, readiness, metrics, admin) comes from FastAPI.
"""

from __future__ import annotations

import re
from typing import Any

_ERROR = {
    "description": "an OpenAI-shaped error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        }
    },
}

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {
                "url": {"type": "string", "description": "https:// or data:image/...;base64,"},
                "detail": {"enum": ["auto", "low", "high"]},
            },
        },
    },
}
_CONTENT = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
    ]
}
_NAME = {"type": "string", "minLength": 1, "maxLength": 256}


def _message(roles: list[str], required: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["role", *required],
        "properties": {"role": {"enum": roles}, "name": _NAME, **extra},
    }


_MESSAGE = {
    "anyOf": [
        _message(["system", "developer", "user"], ["content"], content=_CONTENT),
        _message(["assistant"], [], content={"anyOf": [_CONTENT, {"type": "null"}]}),
        _message(["tool"], ["tool_call_id"], content=_CONTENT, tool_call_id={"type": "string"}),
    ]
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 1},
    "stream": {"type": "boolean"},
    "stop": {
        "anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 1000},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 1000},
                "maxItems": 4,
            },
        ]
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer"},
    "user": {"type": "string"},
    # vLLM's option: the generated and prompt token ids (engines/token_ids.py)
    "return_token_ids": {"type": "boolean"},
}
_CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "tools": {"type": "array", "items": _TOOL},
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
        },
        **_SAMPLING,
    },
}
_COMPLETION = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        **_SAMPLING,
    },
}
_EMBEDDINGS = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ]
        },
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
    },
}


# The Anthropic Messages API (api/anthropic.py): its request shape as api/messages_codec.py
# checks it, and its own error body.
_ANTHROPIC_ERROR = {
    "description": "an Anthropic-shaped error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["type", "error"],
                "properties": {
                    "type": {"const": "error"},
                    "error": {
                        "type": "object",
                        "required": ["type", "message"],
                        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                    },
                },
            }
        }
    },
}
_BLOCK = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["type", "source"],
            "properties": {
                "type": {"const": "image"},
                "source": {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["base64", "url"]},
                        "media_type": {
                            "enum": ["image/jpeg", "image/png", "image/gif", "image/webp"]
                        },
                        "data": {"type": "string"},
                        "url": {"type": "string"},
                    },
                },
            },
        },
        {
            "type": "object",
            "required": ["type", "id", "name", "input"],
            "properties": {
                "type": {"const": "tool_use"},
                "id": {"type": "string"},
                "name": {"type": "string"},
                "input": {"type": "object"},
            },
        },
        {
            "type": "object",
            "required": ["type", "tool_use_id"],
            "properties": {
                "type": {"const": "tool_result"},
                "tool_use_id": {"type": "string"},
                "content": {"type": "string"},
                "is_error": {"type": "boolean"},
            },
        },
    ]
}
_MESSAGES_COUNT: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "system": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["user", "assistant"]},
                    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
                },
            },
        },
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
            },
        },
        "tool_choice": {
            "type": "object",
            "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": {"type": "string"},
            },
        },
        "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
    },
}
_MESSAGES = {
    **_MESSAGES_COUNT,
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        **_MESSAGES_COUNT["properties"],
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
    },
}


# The OpenAI Responses API (api/responses.py), as api/responses_codec.py checks it.
_INPUT_ITEM = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "type": {"enum": ["input_text", "input_image", "output_text"]},
                                    "text": {"type": "string"},
                                    "image_url": {"type": "string"},
                                },
                            },
                        },
                    ]
                },
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"const": "function_call"},
                "call_id": {"type": "string"},
                "name": {"type": "string"},
                "arguments": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": {"type": "string"},
                "output": {"type": "string"},
            },
        },
    ]
}
_RESPONSES = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _INPUT_ITEM}]},
        "instructions": {"type": "string"},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string"},
                    "parameters": {"type": "object"},
                },
            },
        },
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "text": {"type": "object"},
        "max_output_tokens": {"type": "integer", "minimum": 16},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "store": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "background": {"type": "boolean"},
        "previous_response_id": {"type": "string"},
    },
}
_RESPONSE_ID = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^resp_[0-9a-f]{16,64}$"},
}


def _post(summary: str, schema: dict[str, Any], error: dict[str, Any] = _ERROR) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            },
            "responses": {
                "200": {"description": "the model's answer (JSON, or SSE when streamed)"},
                **{str(status): error for status in _ERROR_STATUSES},
            },
        }
    }


_ERROR_STATUSES = (400, 401, 403, 404, 408, 413, 422, 429, 502, 503, 504)


def _with_models(schema: dict[str, Any], models: list[str]) -> dict[str, Any]:
    """`schema` with `model` restricted to the configured aliases (when any)."""
    if not models:
        return schema
    props = {**schema["properties"], "model": {"enum": sorted(models)}}
    return {**schema, "properties": props}


def model_routes(chat_models: list[str], embedding_models: list[str]) -> dict[str, Any]:
    """The OpenAPI `paths` of the model routes (OpenAI's and Anthropic's Messages),
    naming the models this gateway serves (a key may still be allowed only some of them)."""
    return {
        "/v1/chat/completions": _post("chat completion", _with_models(_CHAT, chat_models)),
        "/v1/completions": _post("text completion", _with_models(_COMPLETION, chat_models)),
        "/v1/embeddings": _post("embeddings", _with_models(_EMBEDDINGS, embedding_models)),
        "/v1/responses": _post(
            "OpenAI Responses: create a response (stored, continued, streamed, background)",
            _with_models(_RESPONSES, chat_models),
        ),
        "/v1/responses/{response_id}": {
            "parameters": [_RESPONSE_ID],
            "get": _operation("a stored response of the key's tenant", "bearer", "the response"),
            "delete": _operation("delete a stored response", "bearer", "the deletion"),
        },
        "/v1/responses/{response_id}/cancel": {
            "parameters": [_RESPONSE_ID],
            "post": _operation("cancel a background response", "bearer", "the response"),
        },
        "/v1/responses/{response_id}/input_items": {
            "parameters": [_RESPONSE_ID],
            "get": _operation("the input items of a stored response", "bearer", "a list of items"),
        },
        "/v1/messages": _post(
            "Anthropic Messages: create a message",
            _with_models(_MESSAGES, chat_models),
            _ANTHROPIC_ERROR,
        ),
        "/v1/messages/count_tokens": _post(
            "Anthropic Messages: count a request's input tokens (the gateway's estimate)",
            _with_models(_MESSAGES_COUNT, chat_models),
            _ANTHROPIC_ERROR,
        ),
        "/v1/models": {
            "get": {
                "summary": "the models this key may use",
                "security": [{"bearer": []}],
                "responses": {"200": {"description": "a list of models"}, "401": _ERROR},
            }
        },
        "/v1/tasks/{task_id}": {
            "parameters": [
                {
                    "name": "task_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:\-]{1,128}$"},
                }
            ],
            "get": _task_operation("an agent task of the key's tenant: its live state"),
            "delete": _task_operation(
                "cancel the task: stop its calls in flight, refuse its later calls"
            ),
        },
        "/v1/rollouts": {
            "post": {
                **_operation(
                    "RL rollouts: a batch of samples against one revision of a model under "
                    "`rl.models` (404 for any other model)",
                    "bearer",
                    "NDJSON: one record per sample as it finishes",
                ),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
            }
        },
        "/mcp": {
            method: _operation(
                f"the MCP tool gateway (Streamable HTTP, JSON-RPC): {what}; served when "
                "`mcp.servers` lists servers (errors are JSON-RPC's)",
                "bearer",
                answer,
            )
            for method, what, answer in (
                ("post", "a JSON-RPC message", "a JSON-RPC answer, JSON or SSE"),
                ("get", "the session's server-sent events", "an SSE stream"),
                ("delete", "end the session (`Mcp-Session-Id`)", "the session ended"),
            )
        },
    }


def _operation(summary: str, security: str, ok: str) -> dict[str, Any]:
    """An operation answered with JSON (`ok` describes the 200) or an OpenAI-shaped
    error, behind the named security scheme."""
    return {
        "summary": summary,
        "security": [{security: []}],
        "responses": {
            "200": {"description": ok},
            "400": _ERROR,
            "401": _ERROR,
            "404": _ERROR,
        },
    }


def _task_operation(summary: str) -> dict[str, Any]:
    return _operation(summary, "bearer", "the task's state, or what the cancel stopped")


# `{alias:path}` in a Starlette route is `{alias}` in OpenAPI.
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def admin_routes(routes: list[Any]) -> dict[str, Any]:
    """The OpenAPI `paths` of the admin API (api/admin/'s Starlette routes): each
    method with the first paragraph of its handler's docstring, the admin key as its
    security, and its path parameters."""
    paths: dict[str, Any] = {}
    for route in routes:
        path = getattr(route, "path", "")
        if not path.startswith("/admin/"):
            continue
        doc = (route.endpoint.__doc__ or "").strip().split("\n\n")[0]
        summary = " ".join(doc.split())
        item: dict[str, Any] = {}
        names = _PARAM.findall(path)
        if names:
            item["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                for n in names
            ]
        for method in sorted(route.methods - {"HEAD"}):
            item[method.lower()] = _operation(summary, "admin", "the result, as JSON")
        paths[_PARAM.sub(r"{\1}", path)] = item
    return paths


def describe(
    generated: dict[str, Any],
    chat_models: list[str],
    embedding_models: list[str],
    admin: list[Any] | None = None,
) -> dict[str, Any]:
    """FastAPI's generated description with the model routes and the admin API added."""
    doc = dict(generated)
    doc["paths"] = {
        **model_routes(chat_models, embedding_models),
        **admin_routes(admin or []),
        **doc.get("paths", {}),
    }
    components = dict(doc.get("components") or {})
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "admin": {
            "type": "http",
            "scheme": "bearer",
            "description": "the admin key (the variable auth.admin_key_env names)",
        },
    }
    doc["components"] = components
    return doc
