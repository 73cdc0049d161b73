"""`RedisTaskStore`, agent tasks' state shared through Redis:
moved to state/tasks_redis.py; this module keeps the old import path."""

from switchyard.state.tasks_redis import (
    _ADMIT,
    _CANCEL,
    _NOTE,
    _RESULTS,
    _SETTLE,
    RedisTaskStore,
    _note,
    _num,
    _opt,
    _str,
    log,
)

__all__ = [
    "_ADMIT",
    "_CANCEL",
    "_NOTE",
    "_RESULTS",
    "_SETTLE",
    "RedisTaskStore",
    "_note",
    "_num",
    "_opt",
    "_str",
    "log",
]
