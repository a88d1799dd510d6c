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
import concurrent.futures
import os
import queue
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

    executor = _DaemonThreads(min(32, (os.cpu_count() or 1) + 4))  # asyncio's own default size

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(executor)
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
        if received:  # a call still running in a thread must not hold the process past its stop
            executor.abandon()
        runner.close()
    if received:  # the signal came as ``main`` was returning
        raise Interrupted(received[0])
    return result


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``): up to ``max_workers`` daemon threads. asyncio's own
    executor has threads the interpreter joins at exit, so a call still running when a stop ends the run (a probe in
    its sandbox, a wheel build) would hold the process until it returned. After :meth:`abandon`, ``shutdown`` no
    longer waits and queued calls are cancelled; a call still running dies with the process.

    A ``ThreadPoolExecutor`` only by type (asyncio accepts no other as the default): ``submit`` and ``shutdown`` are
    this class's own, and the base's threads are never started."""

    def __init__(self, max_workers: int):
        super().__init__(max_workers=max_workers)
        self._max = max_workers
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call
        self._pending = 0  # calls submitted that no thread has taken yet (counted with _idle, under the lock)
        self._lock = threading.Lock()
        self._closed = self._abandoned = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._work.put((future, fn, args, kwargs))
            self._pending += 1
            # not the queue's size: a thread that has just taken a call is idle until it says otherwise
            if self._idle < self._pending and len(self._workers) < self._max:
                thread = threading.Thread(target=self._serve, name=f"aitrainsai-call-{len(self._workers)}",
                                          daemon=True)
                thread.start()
                self._workers.append(thread)
        return future

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._work.get()
            with self._lock:
                self._idle -= 1
                self._pending -= item is not None
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the caller's future gets it
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._workers)
        if cancel_futures or self._abandoned:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait and not self._abandoned:
            for thread in threads:
                thread.join()

    def abandon(self) -> None:
        """From now on, shut down without waiting for calls still running."""
        self._abandoned = True
        self.shutdown(wait=False)
