"""``RequestHandle.events`` on an event loop: the worker's thread wakes the loop's waiting
streams with one call into the loop for every stream that became ready before it ran."""

from __future__ import annotations

import asyncio
import threading
import time

from foretell.stream import END, RequestHandle


def test_one_call_into_the_loop_wakes_every_stream_a_step_made_ready():
    handles = [RequestHandle(lambda: None, 1) for _ in range(8)]
    calls = []

    async def main() -> list[list[str]]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (calls.append(a), real(*a, **k))[1]

        async def read(handle: RequestHandle) -> list[str]:
            return [item async for item in handle.events()]

        readers = [asyncio.ensure_future(read(h)) for h in handles]
        await asyncio.sleep(0.05)  # every reader waits

        def step() -> None:  # a batch step: an item for each row, then each row ends
            for h in handles:
                h._put("token")
            for h in handles:
                h._put(END)

        worker = threading.Thread(target=step)
        worker.start()
        worker.join()  # the loop is not running meanwhile: nothing woke it yet
        return await asyncio.gather(*readers)

    got = asyncio.run(main())
    assert got == [["token"]] * len(handles)
    assert len(calls) == 1  # one wake-up for the 16 items


def test_items_queued_while_the_loop_runs_its_wake_up_are_not_lost():
    handle = RequestHandle(lambda: None, 1)
    count = 2000

    async def main() -> int:
        def produce() -> None:
            for i in range(count):
                handle._put(i)
                if i % 97 == 0:
                    time.sleep(0.0005)  # the loop catches up and waits again
            handle._put(END)

        threading.Thread(target=produce).start()
        seen = 0
        async for item in handle.events():
            assert item == seen
            seen += 1
        return seen

    assert asyncio.run(main()) == count


def test_batches_hold_every_item_that_arrived_before_the_reader_woke():
    handle = RequestHandle(lambda: None, 1)

    async def main() -> list[list[int]]:
        got = []
        async for batch in handle.batches():
            got.append(batch)
            if len(got) == 1:  # the reader is busy while a step queues three items
                for i in (1, 2, 3):
                    handle._put(i)
                handle._put(END)
        return got

    handle._put(0)
    assert asyncio.run(main()) == [[0], [1, 2, 3]]


def test_an_error_ends_the_batches_after_the_items_before_it():
    handle = RequestHandle(lambda: None, 1)
    for item in ("a", "b", ValueError("broken"), "never"):
        handle._put(item)

    async def main() -> list[list[str]]:
        got = []
        try:
            async for batch in handle.batches():
                got.append(batch)
        except ValueError:
            got.append(["raised"])
        return got

    assert asyncio.run(main()) == [["a", "b"], ["raised"]]


def test_a_finished_loops_waker_goes_with_it():
    import gc

    from foretell import stream

    async def main() -> None:
        handle = RequestHandle(lambda: None, 1)
        handle._put(END)
        assert [item async for item in handle.events()] == []

    for _ in range(3):
        asyncio.run(main())
    gc.collect()
    assert len(stream._WAKERS) == 0
