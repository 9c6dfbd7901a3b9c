"""The worker -> event-loop channel: the loop is woken only when it waits, tokens put meanwhile go out in one
batch, and the job's last event cuts a paced wait short. Counts wake-ups (the work), not time."""

import asyncio
import threading

from turbospec.server.worker import Channel


class CountingLoop:
    """Wraps a loop, counting the cross-thread wake-ups the worker asks for."""

    def __init__(self, loop):
        self.loop = loop
        self.wakes = 0

    def call_soon_threadsafe(self, *a):
        self.wakes += 1
        return self.loop.call_soon_threadsafe(*a)


def test_tokens_put_while_the_loop_is_busy_cost_no_wake_up():
    async def main():
        counting = CountingLoop(asyncio.get_running_loop())
        ch = Channel(counting)  # type: ignore[arg-type]
        for i in range(100):  # the loop is not waiting: no wake-ups at all
            ch.put(("chunk", i))
        assert counting.wakes == 0
        assert len(await ch.take()) == 100  # one batch
        waiter = asyncio.create_task(ch.take())  # now the loop waits: one put, one wake-up
        await asyncio.sleep(0)
        threading.Thread(target=ch.put, args=(("chunk", 100),)).start()
        assert await asyncio.wait_for(waiter, 30) == [("chunk", 100)]
        assert counting.wakes == 1
        paced = asyncio.create_task(ch.take(pace=3600.0))  # the loop paces: waits only for the job's end
        await asyncio.sleep(0)
        t = threading.Thread(target=lambda: [ch.put(("chunk", i)) for i in range(50)])
        t.start()
        t.join()
        assert counting.wakes == 1  # ordinary tokens do not wake it ...
        ch.put(("done", None, None), last=True)
        assert len(await asyncio.wait_for(paced, 60)) == 51
        assert counting.wakes == 2  # ... the last event does, once

    asyncio.run(main())


def test_last_event_ends_a_paced_wait_at_once():
    async def main():
        ch = Channel(asyncio.get_running_loop())
        ch.put(("chunk", 0))
        await ch.take()
        waiter = asyncio.create_task(ch.take(pace=3600.0))  # an hour of pacing ...
        await asyncio.sleep(0)
        threading.Thread(target=lambda: (ch.put(("chunk", 1)), ch.put(("done", None, None), last=True))).start()
        items = await asyncio.wait_for(waiter, 60)  # ... cut short by the job's end
        assert items == [("chunk", 1), ("done", None, None)]

    asyncio.run(main())
