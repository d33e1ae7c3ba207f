"""The serving engine: one thread runs every admitted request's decoding loop as one running batch.

The thread calls :func:`~refusion.core.loop.run_loops` over one shared cache; before each model call its
``admit`` takes queued requests into the batch, up to ``max_batch`` sequences (continuous batching: a
request joins between forwards and leaves when its loop ends, its cache rows freed). With nothing running
and nothing queued, ``admit`` blocks until a request arrives. When more requests wait than places are
free, it admits them in groups (``admit_min`` places free, or the oldest has waited ``admit_wait_s``):
sequences admitted together share their prompt's model call and stay at similar stages, so fewer rows
are padded to another's width. A newly admitted sequence's first model call of each request group (its
prompt) runs apart from the running batch's call, which would otherwise pad every row to the prompt's
width; with a call price set (by default on the CPU), every group's rows go in calls of similar widths and
similar cached lengths where that saves more padding than a call costs
(:func:`~refusion.core.loop.shape_split`).

A request is a :class:`Job`. Its loop is wrapped (:meth:`Engine._steps`) so that it reports its commits to
the job's ``sink`` as they happen and stops early when the job is cancelled (the client disconnected, a
stop string was found, its deadline passed, or the server shuts down): the wrapped loop then returns at
its next step and its views are released, so its rows leave the batch before the next model call. A loop
that raises fails its own job only; a model call that raises fails the jobs of that batch, and the engine
goes on with a fresh cache.

Events a sink receives, from the engine thread: ``("commit", token_ids)`` (final output, left to right),
``("end", token_ids)`` (the loop's whole output) or ``("error", status, message)``; exactly one of the last
two ends each admitted or rejected job, except a job cancelled by its own handler (disconnect, stop). A
job's commits are coalesced by its ``stream_interval``: its first commit is sent at once, later ones once
``stream_interval`` tokens are pending, and what is pending is sent before its ``end`` (for a streamed
request each event is one HTTP chunk: AR commits one token per step). An admitted job's events are held
until the engine's next model call (or its next wait for requests) and handed over then, in order: the
events of every :class:`LoopSink` on one event loop in one wake-up of that loop (one
``call_soon_threadsafe``), however many jobs and commits the step had; a plain callable gets each event.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

import torch

from refusion.core.loop import CallPrice, Commit, ForwardRequest, LoopSteps, run_loops, shape_split
from refusion.core.types import LoopOutput
from refusion.serve.metrics import Metrics, server_metrics
from refusion.serve.protocol import RequestError

_ids = itertools.count()
#: defaults of the admission policy (see :class:`Engine`)
ADMIT_MIN = 8
ADMIT_WAIT_S = 0.5
#: tokens a job's commits hold before they are sent to its handler (the first commit goes at once; see the
#: module docstring): 4 makes AR's chunks 4 tokens and leaves the diffusion decoders' multi-token commits as
#: they are (docs/serving.md#streaming-what-final-means measures it)
STREAM_INTERVAL = 4
#: the cost model's CPU seconds per token fed (docs/profile.md#predicted-against-measured-on-this-cpu: the
#: pooled cold fit of the tiny models, whose key and pair terms are 1.24 us and 65 ns)
TOKEN_S_CPU = 87.1e-6
#: a model call's price in tokens fed on the CPU (:class:`~refusion.core.loop.CallPrice`), rows of different
#: widths or cached lengths going in separate calls when that saves more than a call: per call 100 tokens
#: (docs/profile.md's cost model of the tiny models: 12 ms per call, 118 us per token); per (row, key) pair
#: and per query-key pair the pooled fit's terms over its cost per token (0.0142 and 0.00075)
CALL_PRICE_CPU = CallPrice(call=100.0, key=1.24e-6 / TOKEN_S_CPU, pair=65e-9 / TOKEN_S_CPU)


def call_price(setting: "float | tuple | CallPrice | None | str", device) -> CallPrice | None:
    """The engine's call price from ``--call-cost-tokens``' value: ``"auto"`` is :data:`CALL_PRICE_CPU` on
    the CPU and None (one call per request group) elsewhere, where a call's fixed cost outweighs thousands of
    tokens (docs/gpu.md); None is off; a number N prices a call at N tokens, its key and pair terms the
    device's (the CPU's; 0 elsewhere: widths alone); ``(call, key, pair)`` or a :class:`CallPrice` sets all."""
    cpu = torch.device(device).type == "cpu"
    if setting == "auto":
        return CALL_PRICE_CPU if cpu else None
    if setting is None or isinstance(setting, CallPrice):
        return setting
    if isinstance(setting, (tuple, list)):
        if len(setting) != 3:
            raise ValueError(f"expected a price per call, per key and per query-key pair, got {setting!r}")
        return CallPrice(*(float(v) for v in setting))
    return CallPrice(float(setting), CALL_PRICE_CPU.key if cpu else 0.0, CALL_PRICE_CPU.pair if cpu else 0.0)


class LoopSink:
    """A job's sink on an asyncio event loop: ``put(event)`` runs on ``loop``. Called, it hands one event over
    (one wake-up of the loop); the engine hands an admitted job's events over in batches, one wake-up per
    loop and step (:meth:`Engine._deliver`)."""

    def __init__(self, loop, put: Callable[[tuple], None]) -> None:
        self.loop, self.put = loop, put

    def __call__(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.put, event)


def _put_all(items: list[tuple[Callable[[tuple], None], tuple]]) -> None:
    """On an event loop: each ``(put, event)`` of one hand-over, in order."""
    for put, event in items:
        put(event)


def hand_over(items: list[tuple[LoopSink, tuple]]) -> None:
    """Hand ``(sink, event)`` pairs to their sinks' event loops, one ``call_soon_threadsafe`` per loop, each
    loop's events in the order given; a closed loop (nobody listens any more) is skipped."""
    by_loop: dict[object, list[tuple[Callable[[tuple], None], tuple]]] = {}
    for sink, event in items:
        by_loop.setdefault(sink.loop, []).append((sink.put, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop has closed
            pass


class Job:
    """One request in the engine: its prompt, its decoder, its seed, its deadline and its sink."""

    def __init__(self, prompt_ids: list[int], decoder, seed: int | None, deadline: float,
                 sink: Callable[[tuple], None], stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval: must be at least 1, got {stream_interval}")
        self.id = next(_ids)
        self.prompt_ids, self.decoder, self.deadline, self.sink = prompt_ids, decoder, deadline, sink
        self.seed = decoder.options.seed if seed is None else seed
        self.arrived = time.perf_counter()
        self.cancel_reason: str | None = None
        self.stream_interval = stream_interval
        self.pending: list[int] = []  # committed tokens not yet sent
        self.commits_sent = 0
        #: the engine's events not yet handed over (set at admission; None: each event is sent at once)
        self.outbox: list[tuple[Job, tuple]] | None = None

    def commit(self, token_ids: list[int]) -> None:
        """Hold newly committed tokens; send what is pending as one commit event when it is the first or
        reaches ``stream_interval`` tokens."""
        self.pending += token_ids
        if not self.commits_sent or len(self.pending) >= self.stream_interval:
            self.flush()

    def flush(self) -> None:
        """Send the pending tokens (if any) as one commit event."""
        if self.pending:
            tokens, self.pending = self.pending, []
            self.commits_sent += 1
            self.send(("commit", tokens))

    def cancel(self, reason: str) -> None:
        """Stop the job at its next step (or skip it while queued); the first reason stays."""
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def send(self, event: tuple) -> None:
        """Hand ``event`` to the sink, or hold it in the engine's outbox once admitted."""
        if self.outbox is not None:
            self.outbox.append((self, event))
        else:
            self.deliver(event)

    def deliver(self, event: tuple) -> None:
        try:
            self.sink(event)
        except RuntimeError:  # the handler's event loop has closed: nobody listens any more
            pass


class Engine:
    """The running batch of a served decoder (see the module docstring). ``decoder``: the served decoder,
    whose :meth:`~refusion.decoders.common.LoopDecoder.new_batch_cache` makes the shared cache."""

    def __init__(self, decoder, max_batch: int = 16, max_queue: int = 64, metrics: Metrics | None = None,
                 admit_min: int = ADMIT_MIN, admit_wait_s: float = ADMIT_WAIT_S, separate_prefill: bool = True,
                 call_cost_tokens: "float | tuple | CallPrice | None | str" = "auto", align_groups: bool = True) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch: must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"--max-queue: must be 0 or more, got {max_queue}")
        if admit_min < 1 or admit_wait_s < 0:
            raise ValueError(f"--admit-min must be at least 1 and --admit-wait 0 or more, got {admit_min}, "
                             f"{admit_wait_s}")
        self.decoder, self.max_batch, self.max_queue = decoder, max_batch, max_queue
        #: run a newly admitted sequence's first model call (its prompt) in a call of its own rather than
        #: padding every row of the running batch to the prompt's width
        self.separate_prefill = separate_prefill
        #: while the batch runs and more requests wait than places are free, admit only when ``admit_min``
        #: places are free (at most the batch) or the oldest waiting request has waited ``admit_wait_s``
        self.admit_min, self.admit_wait_s = min(admit_min, max_batch), admit_wait_s
        #: rows of one request group in several model calls by width and cached length
        #: (:func:`~refusion.core.loop.shape_split`) when the padding saved costs more than a call, priced in
        #: tokens fed (:func:`call_price`); None: one call per group
        try:
            self.call_price = call_price(call_cost_tokens, decoder.backbone.device)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--call-cost-tokens: {e}") from None
        self._split = None if self.call_price is None else shape_split(self.call_price)
        #: run one request group per model-call round where loops wait in several, so that sequences admitted
        #: at different times fall into step (:func:`~refusion.core.loop.run_loops`' ``align_groups``)
        self.align_groups = align_groups
        self.metrics = metrics or server_metrics()
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[Job, tuple]] = []  # admitted jobs' events not yet handed over (engine thread)
        self._nfe = self._fed = 0  # the backbone's counts of calls and tokens fed at the last count
        self._generated = 0  # tokens committed since the last count
        self._cpu = 0.0  # the engine thread's CPU time at the last count
        self.cache = None

    # ------------------------------------------------------------------ the handlers' side
    def start(self) -> None:
        """Start the engine thread (once; later calls do nothing)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="refusion-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises a 429 :class:`RequestError` when the queue is full, 503 when shutting down."""
        with self._cond:
            if not self._accepting:
                raise RequestError(503, None, "the server is shutting down; retry on another replica",
                                   "unavailable_error")
            if len(self._queue) + len(self._running) >= self.max_batch + self.max_queue:
                raise RequestError(429, None, f"the server is full: {len(self._running)} requests decoding "
                                   f"(--max-batch {self.max_batch}) and {len(self._queue)} waiting (--max-queue "
                                   f"{self.max_queue}); retry later", "rate_limit_error")
            self._queue.append(job)
            self.metrics.set("refusion_queue_length", len(self._queue))
            self._cond.notify_all()

    @property
    def accepting(self) -> bool:
        """False once shutting down (new requests get a 503)."""
        return self._accepting

    def counts(self) -> tuple[int, int]:
        """(sequences running, requests queued)."""
        with self._cond:
            return len(self._running), len(self._queue)

    def close_intake(self) -> None:
        """Refuse new requests (503); what is queued or running goes on."""
        with self._cond:
            self._accepting = False

    def stop(self, grace_s: float = 0.0) -> None:
        """Shut down: refuse new requests, let queued and running requests finish for up to ``grace_s``
        seconds, then reject what is still queued and stop what still runs (each with a 503), and end the
        engine thread."""
        self.close_intake()
        end = time.monotonic() + grace_s
        with self._cond:
            while (self._queue or self._running) and time.monotonic() < end:
                self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))
            for job in self._queue:
                job.send(("error", 503, "the server shut down before this request was admitted"))
                self.metrics.inc("refusion_cancelled_total", reason="shutdown")
            self._queue.clear()
            for job in self._running:
                job.cancel("shutdown")
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        bb = self.decoder.backbone
        self._nfe, self._fed, self._cpu = bb.nfe, bb.tokens_in, time.thread_time()
        while True:
            with self._cond:
                if self._stopping and not self._running:
                    return
            self.cache = self.decoder.new_batch_cache()
            try:
                run_loops([], self.cache, admit=self._admit, split=self._split, align_groups=self.align_groups)
            except Exception as e:  # a model call failed: fail the batch it served, go on with a fresh cache
                with self._cond:
                    failed, self._running = list(self._running), set()
                    self._cond.notify_all()
                for job in failed:
                    job.send(("error", 500, f"the batch failed: {type(e).__name__}: {e}"))
                self.metrics.set("refusion_batch_size", 0)
            self._deliver()

    def _deliver(self) -> None:
        """Hand the held events over (engine thread): one ``call_soon_threadsafe`` per event loop of
        :class:`LoopSink` sinks, each other sink called per event; the order of each job's events kept."""
        if not self._outbox:
            return
        events = self._outbox[:]
        self._outbox.clear()  # the same list: admitted jobs hold it
        to_loops: list[tuple[LoopSink, tuple]] = []
        for job, event in events:
            if isinstance(job.sink, LoopSink):
                to_loops.append((job.sink, event))
            else:
                job.deliver(event)
        hand_over(to_loops)

    def _count_calls(self) -> None:
        """Add the model calls, tokens fed, tokens generated and engine-thread CPU time since the last count
        to the metrics."""
        bb = self.decoder.backbone
        cpu = time.thread_time()
        self.metrics.inc("refusion_forward_calls_total", bb.nfe - self._nfe)
        self.metrics.inc("refusion_tokens_fed_total", bb.tokens_in - self._fed)
        self.metrics.inc("refusion_engine_cpu_seconds_total", cpu - self._cpu)
        if self._generated:
            self.metrics.inc("refusion_generation_tokens_total", self._generated)
        self._nfe, self._fed, self._cpu, self._generated = bb.nfe, bb.tokens_in, cpu, 0

    def _admit(self) -> list[LoopSteps]:
        """Before each model call: the queued jobs that fit in the batch (blocks while idle); first hands
        the events of the steps since the last call over."""
        self._deliver()
        self._count_calls()
        with self._cond:
            while not self._queue and not self._running and not self._stopping:
                self._cond.wait()
            new: list[Job] = []
            now = time.perf_counter()
            free = self.max_batch - len(self._running)
            if self._running and self._queue and free < min(self.admit_min, len(self._queue)) \
                    and now - self._queue[0].arrived < self.admit_wait_s:
                free = 0  # wait for room for several: sequences admitted together share their prefill
            while self._queue and len(new) < free:
                job = self._queue.popleft()
                if job.cancel_reason is not None:  # the client left while it waited
                    self.metrics.inc("refusion_cancelled_total", reason=job.cancel_reason)
                elif now > job.deadline:
                    job.send(("error", 504, "the request timed out while queued (--request-timeout)"))
                    self.metrics.inc("refusion_cancelled_total", reason="timeout")
                else:
                    job.outbox = self._outbox
                    new.append(job)
            self._running.update(new)
            running = len(self._running)
            self.metrics.set("refusion_queue_length", len(self._queue))
            self.metrics.set("refusion_batch_size", running)
            self._cond.notify_all()
        for job in new:
            self.metrics.observe("refusion_queue_seconds", now - job.arrived)
            self.metrics.inc("refusion_prompt_tokens_total", len(job.prompt_ids))
        if not new and running:
            self.metrics.observe("refusion_batch_size_per_call", running)
        return [self._steps(job) for job in new]

    def _steps(self, job: Job) -> LoopSteps:
        """``job``'s loop, reporting its commits and stopping when the job is cancelled or times out."""
        generator = torch.Generator(device=job.decoder.backbone.device).manual_seed(job.seed)
        views: set = set()
        groups_seen: set = set()  # the request groups the loop has made a model call in
        loop = None
        try:
            loop = job.decoder.batch_loop(job.prompt_ids, generator, self.cache)
            reply: object = None
            while True:
                if job.cancel_reason is None and time.perf_counter() > job.deadline:
                    job.cancel("timeout")
                if job.cancel_reason is not None:
                    loop.close()
                    for view in views:  # the rows leave the batch now (run_loops releases them again: a no-op)
                        self.cache.release(view)
                    self.metrics.inc("refusion_cancelled_total", reason=job.cancel_reason)
                    if job.cancel_reason == "timeout":
                        job.send(("error", 504, "the request timed out (--request-timeout)"))
                    elif job.cancel_reason == "shutdown":
                        job.send(("error", 503, "the server shut down before this request finished"))
                    return LoopOutput([], [], [], [])
                try:
                    step = loop.send(reply)
                except StopIteration as stop:
                    job.flush()
                    job.send(("end", list(stop.value.token_ids)))
                    return stop.value
                if isinstance(step, Commit):
                    self._generated += len(step.token_ids)  # counted with the calls (one lock a step)
                    job.commit(list(step.token_ids))
                    reply = None
                    continue
                if isinstance(step, ForwardRequest):
                    views.add(step.cache)
                    if step.group not in groups_seen and self.separate_prefill:  # its first call of the group
                        groups_seen.add(step.group)  # (its prompt): apart from the running batch's
                        step = dataclasses.replace(step, group=f"admitted:{step.group}")
                reply = yield step
        except GeneratorExit:
            raise
        except Exception as e:  # this request's loop failed: it alone ends
            for view in views:
                self.cache.release(view)
            job.send(("error", 500, f"decoding failed: {type(e).__name__}: {e}"))
            return LoopOutput([], [], [], [])
        finally:
            with self._cond:
                self._running.discard(job)
                self.metrics.set("refusion_batch_size", len(self._running))
                self._cond.notify_all()
