"""The one job scheduler of every backend: payloads wait for room, the longest expected first.

A backend says whether the room a payload needs is free (``fits``) and takes it (``take``: what it hands the job,
such as the GPU ids or the pod it runs on); :class:`JobQueue` hands room out in its order. A burst of payloads queued
in one turn of the event loop is dispatched once all of it is queued, so it starts longest first, and again whenever
the backend frees room (:meth:`JobQueue.dispatch`). When the head of the queue does not fit, nothing behind it starts:
the longest waits for room; the shorter ones wait behind it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Need = TypeVar("Need")
Grant = TypeVar("Grant")


@dataclass(order=True)
class _Waiting:
    priority: tuple[float, int]  # (-expected seconds, arrival): the longest first, then the earliest
    job_id: str = field(compare=False)
    need: Any = field(compare=False)
    ticket: asyncio.Future = field(compare=False)


def _never() -> BaseException | None:
    return None


class JobQueue(Generic[Need, Grant]):
    """Payloads waiting for room in a backend, longest expected first (``JobPayload.expected_s``; None counts as 0,
    ties in arrival order).

    ``fits(need)``: whether the backend has room for ``need`` now. ``take(need)``: take that room, returning what the
    waiting job gets. ``refusal()``: an exception that ends every waiting job at once (a spent budget, a pool that
    gave up), or None; asked at each dispatch while jobs wait. All of it runs on the event loop's thread."""

    def __init__(self, fits: Callable[[Need], bool], take: Callable[[Need], Grant], *,
                 refusal: Callable[[], BaseException | None] = _never):
        self._fits = fits
        self._take = take
        self._refusal = refusal
        self._waiting: list[_Waiting] = []
        self._order = itertools.count()
        self._dispatch_pending = False
        self.closed = False

    def __len__(self) -> int:
        """How many jobs wait."""
        return sum(1 for waiting in self._waiting if not waiting.ticket.done())

    async def wait(self, job_id: str, expected_s: float | None, need: Need) -> Grant:
        """Wait for room for ``need``; what ``take`` gave. ``CancelledError`` when :meth:`cancel` or :meth:`close`
        ends the wait (or the queue is closed already); the refusal's exception when :meth:`refuse` does."""
        if self.closed:
            raise asyncio.CancelledError
        loop = asyncio.get_running_loop()
        ticket: asyncio.Future[Grant] = loop.create_future()
        heapq.heappush(self._waiting, _Waiting((-(expected_s or 0.0), next(self._order)), job_id, need, ticket))
        if not self._dispatch_pending:  # dispatch once the whole burst is queued, so it starts longest first
            self._dispatch_pending = True
            loop.call_soon(self._dispatch_soon)
        return await ticket

    def _dispatch_soon(self) -> None:
        self._dispatch_pending = False
        self.dispatch()

    def dispatch(self) -> None:
        """Start waiting jobs in order while the head fits. Call it whenever room is freed."""
        refusal = self._refusal() if self._waiting else None
        if refusal is not None:
            self.refuse(refusal)
        while self._waiting and not self.closed:
            head = self._waiting[0]
            if head.ticket.done():  # cancelled while it waited
                heapq.heappop(self._waiting)
                continue
            if not self._fits(head.need):
                return  # the longest waits for room; the shorter ones wait behind it
            heapq.heappop(self._waiting)
            head.ticket.set_result(self._take(head.need))

    def cancel(self, job_id: str) -> None:
        """End ``job_id``'s wait, if it waits: it never gets room."""
        for waiting in self._waiting:
            if waiting.job_id == job_id and not waiting.ticket.done():
                waiting.ticket.cancel()

    def refuse(self, error: BaseException) -> None:
        """End every wait with ``error``."""
        while self._waiting:
            waiting = heapq.heappop(self._waiting)
            if not waiting.ticket.done():
                waiting.ticket.set_exception(error)

    def close(self) -> None:
        """End every wait (``CancelledError``) and hand out no room from now on."""
        self.closed = True
        for waiting in self._waiting:
            waiting.ticket.cancel()
        self._waiting.clear()
