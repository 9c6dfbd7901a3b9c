"""The batching worker (`--parallel N`, N > 1): every admitted job is a sequence of the continuous-batching
`Scheduler`, and one loop runs scheduler steps, each one forward over the decode rows and prompt chunks of all of
them, and hands every sequence's tokens to its job's channel.

Same surface as `Worker` (submit, cancel, stop, run; `waiting` counts the jobs not yet handed to the scheduler,
`running` the sequences in it). A job cancelled (client gone) or past its deadline is aborted at the next step: its
blocks are freed and nothing more is computed for it. A failed step ends every sequence in it with the error, and
the worker goes on with the next jobs."""

from __future__ import annotations

import time
from collections.abc import Callable

from turbospec.engine.scheduler import Scheduler, Sequence
from turbospec.errors import TurboSpecError
from turbospec.server.worker import Job, Worker


class BatchWorker(Worker):
    def __init__(self, engine, max_queue: int, parallel: int, metrics=None, thread: bool = True):
        self.scheduler: Scheduler = engine.new_scheduler(parallel)
        self.active: dict[Sequence, Job] = {}
        self._ended: dict[Sequence, str] = {}  # sequences aborted by the worker: the finish reason it reports
        self._seen = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}  # scheduler counters in /metrics
        super().__init__(engine, max_queue, metrics, thread)

    @property
    def running(self) -> int:
        return len(self.active)

    def stop_soon(self) -> None:
        super().stop_soon()
        for job in list(self.active.values()):
            job.cancelled.set()

    def run(self, alive: Callable[[], bool] | None = None) -> None:
        """Admit jobs and run scheduler steps until `stop_soon()` (or until `alive()`, asked every second while
        idle, says no)."""
        while True:
            with self._cond:
                while not self._queue and not self.active and not self._stopping:
                    self._cond.wait(timeout=None if alive is None else 1.0)
                    if alive is not None and not alive():
                        break
                if self._stopping or (not self._queue and not self.active):
                    break
                jobs = list(self._queue)
                self._queue.clear()
            for job in jobs:
                self._admit(job)
            self._check_jobs()
            self._step()
            self._gauges()
            self._kv_metrics()
        left = list(self.active.items())
        for seq, job in left:
            self.scheduler.abort(seq)
            job.emit(("done", seq.stats, "abort"), last=True)
        self.active.clear()
        if left:  # (an idle server steps no more: under tensor parallelism Ctrl-C has stopped the other ranks too)
            self.scheduler.step()  # frees the aborted sequences' blocks
        self.stop_soon()

    def _kv_metrics(self) -> None:
        if self.metrics is None:
            return
        pool = self.scheduler.pool
        self.metrics.kv_usage.set(1.0 - pool.num_free / pool.num_blocks)
        sch, seen = self.scheduler, self._seen
        for name, counter in (("preemptions", self.metrics.preemptions), ("prefix_queries", self.metrics.prefix_queries),
                              ("prefix_hits", self.metrics.prefix_hits)):
            now = getattr(sch, name)
            if now > seen[name]:
                counter.inc(now - seen[name])
                seen[name] = now

    def _admit(self, job: Job) -> None:
        if not self._dequeued(job):
            return
        if job.action is not None:  # (between two steps)
            self._act(job)
            return
        try:
            seq = self.scheduler.add(job.tokens, job.params)
        except TurboSpecError as e:
            job.emit(("error", e), last=True)
            return
        self.active[seq] = job

    def _check_jobs(self) -> None:
        """Abort the sequences whose client left or whose deadline passed (finish reason "abort" / "length")."""
        now = time.perf_counter()
        for seq, job in self.active.items():
            if seq in self._ended:
                continue
            if job.cancelled.is_set() or now > job.deadline:
                self._ended[seq] = "abort" if job.cancelled.is_set() else "length"
                self.scheduler.abort(seq)

    def _step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - a failed forward: its sequences end with the error, serving goes on
            for seq, job in list(self.active.items()):
                self.scheduler.abort(seq)
                job.emit(("error", e), last=True)
            self.active.clear()
            self._ended.clear()
            self.scheduler.step()
            return
        for out in outputs:
            job = self.active.get(out.seq)
            if job is None:
                continue
            ch = out.chunk
            if ch is not None and (ch.tokens or ch.text or ch.prompt_logprobs):
                job.emit(("chunk", ch.tokens, ch.text, ch))
            if out.finished:
                reason = self._ended.pop(out.seq, None)
                del self.active[out.seq]
                job.emit(("done", out.seq.stats, reason), last=True)
