"""The one job scheduler (JobQueue): longest expected first, a burst ordered once it is queued, and the waiting rule
(the head waits for room; shorter jobs wait behind it). No processes: the room is a counter."""

import asyncio

import pytest

from aitrainsai import JobQueue


class Slots:
    """A backend's room: ``free`` slots; a need is (job, slots it takes); taking it grants the job's name."""

    def __init__(self, free: int):
        self.free = free
        self.started: list[str] = []
        self.refusal: BaseException | None = None

    def fits(self, need: tuple[str, int]) -> bool:
        return self.free >= need[1]

    def take(self, need: tuple[str, int]) -> str:
        self.free -= need[1]
        self.started.append(need[0])
        return need[0]

    def queue(self) -> JobQueue[tuple[str, int], str]:
        return JobQueue(self.fits, self.take, refusal=lambda: self.refusal)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_burst_starts_longest_expected_first_once_all_of_it_is_queued():
    async def main() -> list[str]:
        slots = Slots(1)
        queue = slots.queue()

        async def job(name: str, expected_s: float | None) -> None:
            assert await queue.wait(name, expected_s, (name, 1)) == name
            await asyncio.sleep(0)
            slots.free += 1
            queue.dispatch()

        # one slot, the shortest submitted first: it still waits, since the burst is ordered before anything starts
        await asyncio.gather(job("a", 2.0), job("b", None), job("c", 9.0), job("d", 5.0), job("e", 5.0))
        return slots.started

    assert asyncio.run(main()) == ["c", "d", "e", "a", "b"]  # ties in arrival order; None counts as 0


def test_the_longest_waits_for_room_and_the_shorter_ones_wait_behind_it():
    async def main() -> None:
        slots = Slots(2)
        queue = slots.queue()
        slots.take(("running", 1))
        long = asyncio.ensure_future(queue.wait("long", 60.0, ("long", 2)))
        short = asyncio.ensure_future(queue.wait("short", 1.0, ("short", 1)))
        await settle()
        assert slots.started == ["running"] and len(queue) == 2  # "short" would fit, but "long" is ahead of it
        slots.free += 1  # "running" ends
        queue.dispatch()
        assert await long == "long" and not short.done() and len(queue) == 1
        slots.free += 2  # "long" ends
        queue.dispatch()
        assert await short == "short" and slots.started == ["running", "long", "short"] and len(queue) == 0

    asyncio.run(main())


def test_a_later_longer_job_goes_ahead_of_those_waiting_but_not_of_those_started():
    async def main() -> None:
        slots = Slots(1)
        queue = slots.queue()
        first = asyncio.ensure_future(queue.wait("first", 1.0, ("first", 1)))
        short = asyncio.ensure_future(queue.wait("short", 1.0, ("short", 1)))
        await settle()
        late = asyncio.ensure_future(queue.wait("late", 30.0, ("late", 1)))
        await settle()
        assert await first == "first" and not late.done() and not short.done()
        slots.free += 1
        queue.dispatch()
        assert await late == "late" and not short.done()

    asyncio.run(main())


def test_cancel_ends_one_wait_and_close_ends_every_wait():
    async def main() -> None:
        slots = Slots(0)
        queue = slots.queue()
        waits = {name: asyncio.ensure_future(queue.wait(name, 1.0, (name, 1))) for name in ("a", "b", "c")}
        await settle()
        queue.cancel("b")
        await settle()
        assert waits["b"].cancelled() and len(queue) == 2
        slots.free = 1
        queue.dispatch()  # the cancelled one is skipped
        assert await waits["a"] == "a"
        queue.close()
        await settle()
        assert waits["c"].cancelled() and len(queue) == 0
        slots.free = 5
        queue.dispatch()
        assert slots.started == ["a"]
        with pytest.raises(asyncio.CancelledError):  # a closed queue hands out nothing
            await queue.wait("d", 1.0, ("d", 1))

    asyncio.run(main())


def test_a_refusal_ends_every_wait_with_its_error():
    async def main() -> None:
        slots = Slots(0)
        queue = slots.queue()
        waits = [asyncio.ensure_future(queue.wait(name, 1.0, (name, 1))) for name in ("a", "b")]
        await settle()
        assert not any(w.done() for w in waits)
        slots.refusal = RuntimeError("budget spent")
        slots.free = 1  # refused before anything is handed out
        queue.dispatch()
        for wait in waits:
            with pytest.raises(RuntimeError, match="budget spent"):
                await wait
        assert slots.started == [] and len(queue) == 0

    asyncio.run(main())
