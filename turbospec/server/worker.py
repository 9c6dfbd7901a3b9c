"""The generation worker: the engine decodes one sequence at a time, so one thread runs `engine.stream` for
the queued jobs in FIFO order. A `Job` carries a request's tokens and sampling settings in, and its events
out to the request's event loop: ("chunk", tokens, text)..., then ("done", stats, reason) or ("error", exc).
At most ``max_queue`` jobs wait (more get 503); a job stops between tokens when cancelled (client gone) or
past its deadline."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turbospec.server.protocol import APIError

if TYPE_CHECKING:
    from turbospec.sampling import SamplingParams
    from turbospec.server.metrics import Metrics


@dataclass
class Job:
    tokens: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def emit(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            self.cancelled.set()


class Worker:
    """One thread that runs engine.stream for queued jobs, one at a time."""

    def __init__(self, engine, max_queue: int, metrics: Metrics | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.q: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0
        self.running = 0
        self.lock = threading.Lock()
        self.current: Job | None = None
        self.thread = threading.Thread(target=self._loop, name="turbospec-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.waiting >= self.max_queue:
                raise APIError(503, f"server busy: {self.waiting} requests already waiting (--max-queue)",
                               "server_overloaded", None, "queue_full")
            self.waiting += 1
        self._gauges()
        self.q.put(job)

    def stop(self) -> None:
        cur = self.current
        if cur is not None:
            cur.cancelled.set()
        self.q.put(None)
        self.thread.join(timeout=5)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(self.waiting)
            self.metrics.running.set(self.running)

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            with self.lock:
                self.waiting -= 1
                self.running = 1
                self.current = job
            self._gauges()
            try:
                self._run(job)
            finally:
                with self.lock:
                    self.running = 0
                    self.current = None
                self._gauges()

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_time.observe(start - job.enqueued)
        if job.cancelled.is_set():
            job.emit(("done", None, "abort"))
            return
        if start > job.deadline:
            job.emit(("error", APIError(503, "request timed out waiting in the queue (--timeout)",
                                        "server_overloaded", None, "queue_timeout")))
            return
        try:
            reason = self._generate(job)
        except Exception as e:  # noqa: BLE001 - engine failure: report it, keep serving
            job.emit(("error", e))
            return
        job.emit(("done", self.engine.last_stats, reason))

    def _generate(self, job: Job) -> str | None:
        """Stream the job's tokens out; the finish reason when the server cut it short ("abort", "length")."""
        gen = self.engine.stream(job.tokens, job.params)
        try:
            for chunk in gen:
                job.emit(("chunk", chunk.tokens, chunk.text))
                if job.cancelled.is_set():
                    return "abort"
                if time.perf_counter() > job.deadline:
                    return "length"
        finally:
            gen.close()
        return None
