"""The generation worker: the engine decodes one sequence at a time, so one thread runs `engine.stream` for the
queued jobs in FIFO order. A `Job` carries a request's tokens and sampling settings in, and its events out through
a `Channel` to the request's event loop: ("chunk", tokens, text, Chunk)..., then ("done", stats, reason) or ("error", exc).

At most ``max_queue`` jobs wait (more get 503). A job is cancelled (client gone) at once while it waits, between
prefill chunks and between tokens while it runs; past its deadline it stops with finish reason "length".

Speed: the event loop and the engine share the CPU (and the GIL), so the worker never wakes the loop per token.
`Channel.put` appends under a lock and wakes the loop only when it is idle and waiting; a loop that has just sent
something takes the next batch after `stream_interval` seconds (or at once when the job ends). The first token
goes out immediately; at 1,000 t/s and a 50 ms interval the loop wakes 20 times a second instead of 1,000."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turbospec.server.protocol import APIError

if TYPE_CHECKING:
    from turbospec.engine.scheduler import Scheduler
    from turbospec.sampling import SamplingParams
    from turbospec.server.metrics import Metrics


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_overloaded", None, "shutting_down")


class Channel:
    """Events from the worker thread to one request's event loop, woken only when the loop is waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple] = []
        self._event = asyncio.Event()
        self._armed = False  # the loop waits for any item
        self._armed_last = False  # the loop waits for the last item only (pacing)
        self._ended = False

    def put(self, item: tuple, last: bool = False) -> None:
        """Worker thread: queue an event; `last` for the job's final one."""
        with self._lock:
            self._items.append(item)
            self._ended = self._ended or last
            wake = self._armed or (last and self._armed_last)
            if wake:
                self._armed = self._armed_last = False
        if wake:
            with contextlib.suppress(RuntimeError):  # a closed loop (shutdown): nobody is listening
                self.loop.call_soon_threadsafe(self._event.set)

    async def take(self, pace: float = 0.0) -> list[tuple]:
        """Loop: every event put since the last take (at least one). With `pace` > 0, first wait that long
        unless the job ends sooner, so that tokens are sent in batches."""
        if pace > 0:
            with self._lock:
                if not self._ended:
                    self._armed_last = True
                    self._event.clear()
                    waiting = True
                else:
                    waiting = False
            if waiting:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._event.wait(), pace)
        while True:
            with self._lock:
                items, self._items = self._items, []
                self._armed_last = False
                if not items:
                    self._armed = True
                    self._event.clear()
            if items:
                return items
            await self._event.wait()


@dataclass(eq=False)  # identity: the queue removes a cancelled job by identity, not by comparing prompts
class Job:
    tokens: list[int]
    params: SamplingParams
    channel: Channel
    deadline: float
    key: str | None = None  # the API key label, for per-key limits
    action: Callable[[], dict] | None = None  # not a generation: run this on the worker's thread, answer its result
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def emit(self, item: tuple, last: bool = False) -> None:
        self.channel.put(item, last)


class Worker:
    """Runs engine.stream for queued jobs, one at a time: in a thread of its own (`thread=True`), or in the
    caller's thread through `run()`.

    `turbospec serve` calls `run()` on the main thread and serves HTTP from another: PyTorch's OpenMP (libgomp)
    keeps its worker threads spinning between parallel regions only while the process has no more OpenMP threads
    than cores; a second thread that runs torch ops (a worker thread, after model loading used the main thread)
    brings a second thread pool, libgomp throttles the spinning, and every parallel region then pays a futex
    wake-up: 2.5x slower decoding of the bundled model on 2 cores (`engine.stream` in a thread: ~220 t/s against
    ~600 t/s on the main thread)."""

    scheduler: Scheduler | None = None  # the continuous-batching worker's

    def __init__(self, engine, max_queue: int, metrics: Metrics | None = None, thread: bool = True):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self._cond = threading.Condition()  # re-entrant: stop_soon may run in a signal handler on the same thread
        self._queue: deque[Job] = deque()
        self._stopping = False
        self.current: Job | None = None
        self.thread: threading.Thread | None = None
        if thread:
            self.start()

    def start(self) -> None:
        """Run jobs in a thread of its own."""
        with self._cond:
            self._stopping = False
        self.thread = threading.Thread(target=self.run, name="turbospec-worker", daemon=True)
        self.thread.start()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return int(self.current is not None)

    def has_room(self) -> bool:
        return len(self._queue) < self.max_queue

    def queue_full(self) -> APIError:
        return APIError(503, f"server busy: {self.waiting} requests already waiting (--max-queue)",
                        "server_overloaded", None, "queue_full")

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise shutting_down()
            if len(self._queue) >= self.max_queue:
                raise self.queue_full()
            self._queue.append(job)
            self._cond.notify()
        self._gauges()

    def cancel(self, job: Job) -> None:
        """Stop a job: a waiting one leaves the queue now (and reports "abort"), a running one stops at the
        engine's next check (prefill chunk or token)."""
        job.cancelled.set()
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return  # running or finished: the worker sees the flag
        self._gauges()
        job.emit(("done", None, "abort"), last=True)

    def stop_soon(self) -> None:
        """Stop taking jobs: new and queued ones get a 503 (`shutting_down`), the running one stops at its next
        check (finish reason "abort"), and `run()` returns. Safe in a signal handler."""
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            cur = self.current
            self._cond.notify_all()
        for job in pending:
            job.cancelled.set()
            job.emit(("error", shutting_down()), last=True)
        if cur is not None:
            cur.cancelled.set()

    def stop(self) -> None:
        self.stop_soon()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(self.waiting)
            self.metrics.running.set(self.running)

    def run(self, alive: Callable[[], bool] | None = None) -> None:
        """Take and run jobs until `stop_soon()` (or until `alive()`, asked every second while idle, says no)."""
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait(timeout=None if alive is None else 1.0)
                    if alive is not None and not alive():
                        break
                if self._stopping or not self._queue:
                    break
                job = self._queue.popleft()
                self.current = job
            if self._stopping:  # a signal between the two lines above: stop_soon saw neither
                job.cancelled.set()
            self._gauges()
            try:
                self._run(job)
            finally:
                self.current = None
                self._gauges()
        self.stop_soon()  # (also when `alive` said no) whatever is still queued gets its answer

    def _dequeued(self, job: Job) -> bool:
        """A job leaves the queue: record its wait; answer it here (False) when it was cancelled meanwhile or its
        deadline passed, else True (generate it)."""
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_time.observe(now - job.enqueued)
        if job.cancelled.is_set():
            job.emit(("done", None, "abort"), last=True)
            return False
        if now > job.deadline:
            job.emit(("error", APIError(503, "request timed out waiting in the queue (--timeout)",
                                        "server_overloaded", None, "queue_timeout")), last=True)
            return False
        return True

    def _act(self, job: Job) -> None:
        """A job with an action (a slot save / restore / erase): its result, or its one-line error."""
        from turbospec.errors import TurboSpecError

        try:
            job.emit(("result", job.action()), last=True)  # type: ignore[misc]
        except (TurboSpecError, OSError) as e:
            status = 404 if "not found" in str(e) or "does not exist" in str(e) else 400
            job.emit(("error", APIError(status, str(e), "invalid_request_error")), last=True)
        except Exception as e:  # noqa: BLE001 - reported, serving goes on
            job.emit(("error", e), last=True)

    def _run(self, job: Job) -> None:
        if not self._dequeued(job):
            return
        if job.action is not None:
            self._act(job)
            return
        try:
            reason = self._generate(job)
        except Exception as e:  # noqa: BLE001 - engine failure: report it, keep serving
            job.emit(("error", e), last=True)
            return
        job.emit(("done", self.engine.last_stats, reason), last=True)

    def _generate(self, job: Job) -> str | None:
        """Stream the job's tokens out; the finish reason when the server cut it short ("abort", "length")."""
        deadline = job.deadline
        cancelled = job.cancelled

        def stop() -> bool:  # asked by the engine between prefill chunks
            return cancelled.is_set() or time.perf_counter() > deadline

        gen = self.engine.stream(job.tokens, job.params, abort=stop)
        try:
            for chunk in gen:
                job.emit(("chunk", chunk.tokens, chunk.text, chunk))
                if cancelled.is_set():
                    return "abort"
                if time.perf_counter() > deadline:
                    return "length"
        finally:
            gen.close()
        if self.engine.last_stats.finish_reason == "abort":  # the prefill stopped: which check said so
            return "abort" if cancelled.is_set() else "length"
        return None  # the engine finished on its own: its reason stands
