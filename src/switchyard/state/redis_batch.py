"""`ScriptBatcher`: the Lua script calls a process issues while Redis is busy answering
earlier ones, sent in one pipelined round trip.

A gateway worker under load issues many limiter scripts at once (a reserve before each
upstream call, a settle after it). Sent one by one, each pays redis-py's command packing,
a pool checkout, a socket write and a read; pipelined, the calls queued together share them.

- A call that finds nothing on the wire goes out at once, from its caller's task, with
  no timer and no extra loop turn (a lone request pays no more than unbatched). Calls
  that arrive while a call or batch is on the wire queue, and go out together as soon as
  it is answered, from a sender task that keeps going while calls queue behind it.
- One batch in flight at a time, on one connection: Redis runs the scripts in the order
  they were queued. A request's next call is issued only once its previous one was
  answered, so it never overtakes it.
- The pipeline is not a transaction (`transaction=False`), and need not be: each EVALSHA
  is atomic by itself. Each caller gets its own reply or its own error: a script error
  fails that call only (`raise_on_error=False`); a connection error or a timeout fails
  every call of the batch, and reaches each caller as the exception redis-py raised, for
  the caller to map (`shared_call`). Timeouts are not retried: the scripts may have run.
- EVALSHA is sent with the script's known sha, so no SCRIPT EXISTS precedes each batch
  (redis-py's pipeline sends one whenever `Script` objects are called through it). Calls
  answered NOSCRIPT (Redis restarted or its script cache was flushed) did not run: their
  scripts are loaded and those calls alone sent again, in one more round trip. A call
  answered NOSCRIPT again gets that error.
- Each call is packed into its RESP bytes once, by hiredis (C), when it is made. A round
  trip writes the calls' bytes in one send and reads one reply each, on the batcher's own
  connection: redis-py's (its timeouts, its parser), made with the client's settings and
  kept, since one round trip is on the wire at a time (no pool checkout, lock and
  readiness probe per round trip). redis-py's own packing runs a Python encoder over
  every argument, and a limiter script has 30 to 50 of them: about 20 us a call against
  hiredis's 2. The client's retry rule holds here too: one immediate retry on a
  connection error (Redis dropped the connection), none on a timeout. A connection may
  drop after Redis ran a script and before its reply was read, so a retried call may
  run twice: a script sent through this batcher applies once when sent twice
  (RedisLimiter's reserve by its call key, settle by the hold it ends).
- A caller cancelled before its batch goes out is not sent (as an unsent command is
  not); one cancelled later has its script run, as a cancelled command whose bytes were
  written has. A call made with `orphaned` is always sent from the sender task, never
  its caller's, so its caller's cancellation cannot cut the exchange short: when its
  reply (or the batch's error) comes in for a caller that has gone, `orphaned` gets it,
  for what the script did for nobody to be undone (RedisLimiter settles the
  reservation). A NOSCRIPT reply means the script did not run: nothing to undo, and a
  call whose caller has gone is not sent again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from hiredis import pack_command
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


@dataclass(slots=True)
class _Call:
    """One queued EVALSHA (its RESP bytes) and the future its caller awaits."""

    script: AsyncScript
    packed: bytes
    reply: asyncio.Future[Any]
    orphaned: Callable[[Any], None] | None = None


class ScriptBatcher:
    """Runs Lua scripts on one Redis client; the calls that queue while one round trip is
    on the wire share the next."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._queue: list[_Call] = []
        self._in_flight = False  # a call or batch is on the wire; arrivals queue
        self._sender: asyncio.Task[None] | None = None
        self._conn: AbstractConnection | None = None  # made on first use

    def register(self, source: str) -> AsyncScript:
        """A script to `run`; its sha is computed once, here."""
        return self._redis.register_script(source)

    async def run(
        self,
        script: AsyncScript,
        keys: Sequence[str],
        args: Sequence[str],
        orphaned: Callable[[Any], None] | None = None,
    ) -> Any:
        """The script's reply to this call; raises what Redis or redis-py raised for it.
        `orphaned`: called with the reply or error of this call if it was sent and its
        caller was cancelled before it came (module docstring)."""
        packed = _pack(("EVALSHA", script.sha, len(keys), *keys, *args))
        call = _Call(script, packed, asyncio.get_running_loop().create_future(), orphaned)
        if self._in_flight:
            self._queue.append(call)
        elif orphaned is not None:  # from the sender task, which no caller cancels
            self._in_flight = True
            self._queue.append(call)
            self._send_next()
        else:  # nothing on the wire: this call goes out now, alone, from its own task
            self._in_flight = True
            try:
                await self._send([call])
            finally:
                self._send_next()
        return await call.reply

    async def wait_idle(self) -> None:
        """Until the queued and in-flight batches are answered (before closing the client)."""
        if self._sender is not None:
            await asyncio.shield(self._sender)

    async def close(self) -> None:
        """Once the batches in flight are answered, close the batcher's connection."""
        await self.wait_idle()
        if self._conn is not None:
            await self._conn.disconnect()

    def _send_next(self) -> None:
        """The wire is free: the calls queued meanwhile go out as one batch, from a task
        of their own (so no caller's cancellation cuts it short)."""
        if self._queue:
            self._sender = asyncio.get_running_loop().create_task(self._send_queued())
        else:
            self._in_flight = False

    async def _send_queued(self) -> None:
        try:
            while self._queue:
                batch = [call for call in self._queue if not call.reply.cancelled()]
                self._queue = []
                if batch:
                    await self._send(batch)
        except asyncio.CancelledError:  # the loop is shutting down: nobody is answered
            for call in self._queue:
                call.reply.cancel()
            raise
        finally:
            self._sender = None
            self._in_flight = False

    async def _send(self, batch: list[_Call]) -> None:
        try:
            replies = await self._round_trip(batch, load=())
            again = [
                c
                for c, r in zip(batch, replies, strict=True)
                if isinstance(r, NoScriptError) and not c.reply.cancelled()
            ]
            _answer(batch, replies, noscript_again=False)
            if again:
                scripts = list({c.script.sha: c.script for c in again}.values())
                _answer(again, await self._round_trip(again, load=scripts), noscript_again=True)
        except Exception as exc:  # every caller still waiting gets it
            for call in batch:
                if not call.reply.done():
                    call.reply.set_exception(exc)
                elif call.reply.cancelled() and call.orphaned is not None:
                    call.orphaned(exc)  # its script may have run
        except asyncio.CancelledError:
            for call in batch:
                call.reply.cancel()
            raise

    async def _round_trip(self, calls: list[_Call], load: Sequence[AsyncScript]) -> list[Any]:
        """One round trip: SCRIPT LOAD for `load`, then each call's EVALSHA; the calls'
        replies, an error in place of a reply that is one."""
        commands = [_pack(("SCRIPT", "LOAD", script.script)) for script in load]
        commands += [call.packed for call in calls]
        payload = commands[0] if len(commands) == 1 else b"".join(commands)
        try:
            replies = await self._exchange(payload, len(commands))
        except RedisConnectionError:  # Redis dropped the connection: once more
            replies = await self._exchange(payload, len(commands))
        return replies[len(load) :]

    async def _exchange(self, payload: bytes, count: int) -> list[Any]:
        """`payload` (`count` commands) in one send, and their `count` replies (an error
        reply as its exception). A connection that failed or was cancelled mid-exchange
        is closed, so no reply is left unread on it; the next send connects again."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self._redis.connection_pool.make_connection()
        try:
            await conn.send_packed_command(payload)  # connects first when it is not
            return [await _reply(conn) for _ in range(count)]
        except BaseException:
            await conn.disconnect()
            raise


def _pack(command: tuple[Any, ...]) -> bytes:
    """A command's RESP bytes, packed by hiredis (its arguments: str, bytes or numbers)."""
    return pack_command(command)


async def _reply(conn: AbstractConnection) -> Any:
    try:
        return await conn.read_response()
    except ResponseError as exc:  # that command's error: the others are still read
        return exc


def _answer(calls: list[_Call], replies: list[Any], noscript_again: bool) -> None:
    """Each caller its own reply or error; a NOSCRIPT reply is left for the resend unless
    it answers the resend (`noscript_again`)."""
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, NoScriptError) and not noscript_again:
            continue  # not run: sent again if its caller still waits
        if call.reply.done():
            if call.reply.cancelled() and call.orphaned is not None:
                call.orphaned(reply)  # run for a caller that has gone
            continue
        if isinstance(reply, BaseException):
            call.reply.set_exception(reply)
        else:
            call.reply.set_result(reply)
