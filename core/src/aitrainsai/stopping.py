"""Running a run's event loop so that every way it is asked to stop ends the same way, in bounded time.

SIGINT (Ctrl-C) and SIGTERM (``timeout``, ``docker stop``, systemd, CI cancels, schedulers) both cancel the main
task: the session's ``__aexit__`` closes the outer trainer and the GPU backend (pods terminated, a head it started
stopped, payloads killed) and the caller records the run ``interrupted``. The stop is bounded: if it has not ended
:data:`STOP_TIMEOUT_S` seconds after the signal (a close that hangs, a thread blocked in a call), the process exits
at once with the signal's status (128 + N); the run's lock is released with it, so the ledger reads it
``interrupted`` and ``--resume`` continues it. A second signal during the stop changes nothing: the stop is already
under way and bounded. SIGKILL cannot be caught: what a backend starts has a watch of its own (the pods' dead-man
timer, the Ray head's keeper, the local Tinker server's parent watch).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["STOP_SIGNALS", "STOP_TIMEOUT_S", "Interrupted", "run_until_stopped"]

STOP_TIMEOUT_S = 30.0
"""The longest a stop takes, from the signal to the process's exit."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

T = TypeVar("T")


class Interrupted(KeyboardInterrupt):
    """The run was stopped by ``signum`` (SIGINT or SIGTERM) and closed what it had started."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def run_until_stopped(main: Callable[[], Awaitable[T]], *, timeout_s: float | None = None,
                      on_signal: Callable[[int], None] | None = None) -> T:
    """``asyncio.run(main())`` where SIGINT and SIGTERM cancel ``main`` and raise :class:`Interrupted` once it has
    unwound (its ``finally`` blocks and ``async with`` exits run); a stop that outlives ``timeout_s`` (default
    :data:`STOP_TIMEOUT_S`) ends the process. ``on_signal(signum)`` runs on the loop's thread when the signal comes
    (to record it while the ledger is still in reach).

    Outside the main thread signals cannot be caught: there it is plain ``asyncio.run``."""
    limit = STOP_TIMEOUT_S if timeout_s is None else timeout_s
    received: list[int] = []

    def watchdog(signum: int) -> None:
        try:
            print(f"aitrainsai: the stop after {signal.Signals(signum).name} took over {limit:.0f} s; exiting now",
                  file=sys.stderr, flush=True)
        finally:
            os._exit(128 + signum)

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def stop(signum: int) -> None:
            if received:
                return
            received.append(signum)
            timer = threading.Timer(limit, watchdog, (signum,))
            timer.daemon = True
            timer.start()
            task.cancel()
            if on_signal is not None:
                on_signal(signum)

        installed = []
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                loop.add_signal_handler(signum, stop, signum)
                installed.append(signum)
        try:
            return await main()
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)

    runner = asyncio.Runner()
    try:
        result = runner.run(guarded())
    except BaseException:
        if received:  # cancelled, or unwound through an error of its own: a stop either way
            raise Interrupted(received[0]) from None
        raise
    finally:
        _close(runner, received)
    if received:  # the signal came as ``main`` was returning
        raise Interrupted(received[0])
    return result


def _close(runner: asyncio.Runner, received: list[int]) -> None:
    """Close the loop; after a stop, without joining executor threads: one blocked in a call must not hold the
    process past its stop (if it holds the interpreter's exit, the watchdog still ends it in time)."""
    if received:
        loop = runner.get_loop()
        executor = getattr(loop, "_default_executor", None)  # asyncio would join it in shutdown_default_executor
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
            loop._default_executor = None
    runner.close()
