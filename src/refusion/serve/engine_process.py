"""The engine in a process of its own (``refusion serve``'s default, ``--engine process``), as vLLM's V1
engine core and SGLang's scheduler run: the HTTP side never holds the engine's interpreter.

The engine process (:func:`engine_main`, started with ``spawn``) loads the model and runs
:class:`~refusion.serve.engine.Engine` unchanged; the HTTP process keeps the tokenizer, request validation
(:class:`~refusion.serve.options.DecoderPool` over a :class:`~refusion.serve.options.ModelInfo`),
detokenisation and SSE. :class:`EngineProcess` stands in the HTTP process for the engine (``submit``,
``counts``, ``close_intake``, ``stop``, ``metrics``), so the app serves either the same way.

One pipe carries, HTTP process -> engine process: ``("submit", job id, prompt ids, options, temperature,
max_tokens, seed, deadline, stream interval, arrival)`` (the options already validated), ``("cancel", job
id, reason)``, ``("close_intake",)``, ``("query", query id)`` (counts and metrics) and ``("stop", grace
seconds)``; engine process -> HTTP process: ``("ready", info)`` or ``("failed", message)`` once, then
``("events", [(job id, event), ...])`` (one message per hand-over of the engine: the events of every job of
a model call; each event as :class:`~refusion.serve.engine.Job`'s sink receives it), ``("reply", query id,
payload)`` and ``("stopped",)``. A reader thread in the HTTP process hands each message's events to the
jobs' event loops, one ``call_soon_threadsafe`` per loop (as :meth:`Engine._deliver` does for
:class:`~refusion.serve.engine.LoopSink`).

The HTTP process counts its jobs until each ends (its ``end`` or ``error`` event, or its cancellation by
the handler) and refuses a request beyond ``max_batch + max_queue`` of them with a 429 itself; the
engine's own queue check stays (a 429 there reaches the handler as an error event). Perf-counter times
(deadlines, arrivals) are the machine's monotonic clock, the same in both processes. When the engine
process dies, every open request gets a 500, new ones a 503, ``/health`` a 503, and a line on stderr says
so. Metrics: ``/metrics`` adds the engine process's (a query per scrape) to the HTTP process's, and
``process_*`` sums both processes' memory and CPU time.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from refusion.serve.app import ServeState
from refusion.serve.engine import Engine, Job, LoopSink, _put_all, hand_over
from refusion.serve.metrics import resident_bytes, server_metrics
from refusion.serve.options import DecoderPool, ModelInfo
from refusion.serve.protocol import RequestError

#: seconds a query (counts, metrics) waits for the engine process's answer
QUERY_TIMEOUT_S = 10.0
#: seconds the engine process may take to load its model
START_TIMEOUT_S = 900.0


@dataclasses.dataclass
class EngineSpec:
    """What the engine process builds: the model (``load(path)`` -> a Backbone; picklable), the decoder config,
    the engine's settings (:class:`~refusion.serve.engine.Engine`'s keyword arguments) and its torch threads."""

    path: str
    config: dict[str, Any]
    engine: dict[str, Any]
    threads: int | str = 1
    load: Callable[[str], Any] | None = None  # None: Backbone.from_pretrained(path, **runtime)
    runtime: dict[str, Any] = dataclasses.field(default_factory=dict)


def _load(spec: EngineSpec):
    if spec.load is not None:
        return spec.load(spec.path)
    from refusion.models.backend import Backbone

    return Backbone.from_pretrained(spec.path, **spec.runtime)


# ---------------------------------------------------------------------------------------- the engine process
class _Put:
    """A job's ``put`` in the engine process: names the job whose events the pipe carries."""

    def __init__(self, jid: int) -> None:
        self.jid = jid


class _PipeLoop:
    """Stands for an event loop to the engine: what it hands over goes down the pipe as one message."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()
        self.ended: collections.deque[int] = collections.deque()  # jobs whose last event went out

    def send(self, message: tuple) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the HTTP process is gone: nobody listens (the main thread stops us)
            pass

    def call_soon_threadsafe(self, callback, *args) -> None:
        # Engine._deliver: (_put_all, [(put, event), ...]); LoopSink.__call__ (a queued job's event): (put, event)
        items = args[0] if callback is _put_all else [(callback, args[0])]
        self.send(("events", [(put.jid, event) for put, event in items]))
        self.ended.extend(put.jid for put, event in items if event[0] != "commit")


def engine_main(conn, spec: EngineSpec) -> None:
    """The engine process: load, report ``ready``, then serve the pipe's commands until ``stop`` or until the
    HTTP process is gone (the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process shuts the engine down (a terminal's
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Ctrl-C reaches both processes)
    out = _PipeLoop(conn)
    try:
        from refusion.core.threads import set_threads

        set_threads(spec.threads)
        backbone = _load(spec)
        pool = DecoderPool(backbone, spec.config)
        engine = Engine(pool.base, **spec.engine)
    except BaseException as e:  # noqa: BLE001  (reported to the HTTP process, which exits with it)
        out.send(("failed", f"{type(e).__name__}: {e}"))
        return
    try:
        with out.lock:
            conn.send(("ready", {"tokenizer": backbone.tokenizer, "eos_ids": set(backbone.eos_ids),
                                 "max_positions": backbone.max_positions}))
    except Exception as e:  # noqa: BLE001  (e.g. a tokenizer that does not pickle)
        out.send(("failed", f"its tokenizer, eos ids and positions do not reach the HTTP process: "
                            f"{type(e).__name__}: {e}"))
        return
    engine.start()
    jobs: dict[int, Job] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone
            engine.stop(0.0)
            return
        kind = message[0]
        if kind == "submit":
            _, jid, prompt_ids, options, temperature, max_tokens, seed, deadline, interval, arrived = message
            try:
                decoder = pool.decoder(options, temperature, max_tokens, len(prompt_ids))
                job = Job(prompt_ids, decoder, seed, deadline, LoopSink(out, _Put(jid)), interval)
                job.arrived = arrived
                jobs[jid] = job
                engine.submit(job)
            except RequestError as e:
                jobs.pop(jid, None)
                out.send(("events", [(jid, ("error", e.status, e.message))]))
            while out.ended:  # jobs whose end went out leave the table (in the one thread that adds to it)
                jobs.pop(out.ended.popleft(), None)
        elif kind == "cancel":
            job = jobs.pop(message[1], None)
            if job is not None:
                job.cancel(message[2])
        elif kind == "close_intake":
            engine.close_intake()
        elif kind == "query":
            running, queued = engine.counts()
            out.send(("reply", message[1], {"running": running, "queued": queued, "accepting": engine.accepting,
                                            "metrics": engine.metrics.snapshot(), "resident": resident_bytes(),
                                            "cpu_s": time.process_time()}))
        elif kind == "stop":
            engine.stop(message[1])
            out.send(("stopped",))
            return


# ---------------------------------------------------------------------------------------- the HTTP process
class RemoteJob:
    """A request's job in the HTTP process: its id, deadline and sink; ``cancel`` tells the engine process."""

    def __init__(self, client: "EngineProcess", jid: int, deadline: float, sink: LoopSink, payload: tuple) -> None:
        self.client, self.id, self.deadline, self.sink = client, jid, deadline, sink
        self.payload = payload  # the submit message's fields after the id
        self.cancel_reason: str | None = None

    def cancel(self, reason: str) -> None:
        """Stop the job at its next step (the first reason stays)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self.client.cancel(self, reason)


class EngineProcess:
    """The engine process, seen from the HTTP process (see the module docstring): starts it and waits for
    its model (raises ``RuntimeError`` with its message when it fails to load)."""

    def __init__(self, spec: EngineSpec, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.max_batch = spec.engine.get("max_batch", 16)
        self.max_queue = spec.engine.get("max_queue", 64)
        self.metrics = server_metrics()  # the HTTP side's; the engine process keeps its own
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(child, spec), name="refusion-engine", daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine process did not load its model within {start_timeout_s:g} s")
        try:
            first = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self.process.exitcode})") \
                from None
        if first[0] != "ready":
            self.process.join(5)
            raise RuntimeError(f"the engine process failed to load: {first[1]}")
        info = first[1]
        self.model = ModelInfo(info["tokenizer"], info["eos_ids"], info["max_positions"])
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the tables below (event loop, reader thread, queries)
        self._jobs: dict[int, RemoteJob] = {}
        self._ids = itertools.count()
        self._queries: dict[int, list] = {}  # query id -> [threading.Event, payload]
        self._accepting = True
        self._stopped = threading.Event()
        self.dead: str | None = None  # why the engine process is gone, once it is
        self._reader = threading.Thread(target=self._read, name="refusion-engine-reader", daemon=True)
        atexit.register(self._stop_at_exit)

    # ------------------------------------------------------------------ Engine's interface
    def start(self) -> None:
        """Start the reader thread (once)."""
        if self._reader.ident is None:
            self._reader.start()

    def submit(self, job: RemoteJob) -> None:
        """Hand ``job`` to the engine process; a 503 :class:`RequestError` while shutting down or with the
        engine process gone, 429 when ``max_batch + max_queue`` jobs are open."""
        if self.dead is not None or not self._accepting:
            raise RequestError(503, None, "the server is shutting down; retry on another replica" if self.dead is None
                               else f"the engine is not running ({self.dead})", "unavailable_error")
        with self._lock:
            if len(self._jobs) >= self.max_batch + self.max_queue:
                raise RequestError(429, None, f"the server is full: {len(self._jobs)} requests decoding or waiting "
                                   f"(--max-batch {self.max_batch}, --max-queue {self.max_queue}); retry later",
                                   "rate_limit_error")
            self._jobs[job.id] = job
        try:
            self._send(("submit", job.id, *job.payload))
        except RequestError:
            with self._lock:
                self._jobs.pop(job.id, None)
            raise

    def new_job(self, pool: DecoderPool, prompt_ids: list[int], req, sink: LoopSink, deadline: float,
                stream_interval: int) -> RemoteJob:
        """A request's job, its options checked here (a 400 naming the field) and again where it decodes."""
        pool.validate(req.refusion, req.temperature, req.max_tokens, len(prompt_ids))
        return RemoteJob(self, next(self._ids), deadline, sink, (list(prompt_ids), req.refusion, req.temperature,
                                                                req.max_tokens, req.seed, deadline, stream_interval,
                                                                time.perf_counter()))

    def cancel(self, job: RemoteJob, reason: str) -> None:
        with self._lock:
            known = self._jobs.pop(job.id, None) is not None
        if known:
            self._send(("cancel", job.id, reason), quiet=True)

    @property
    def accepting(self) -> bool:
        return self._accepting and self.dead is None

    def counts(self) -> tuple[int, int]:
        """(sequences running, requests queued) in the engine process; (0, 0) once it is gone."""
        reply = self.query()
        return (reply["running"], reply["queued"]) if reply else (0, 0)

    def close_intake(self) -> None:
        self._accepting = False
        self._send(("close_intake",), quiet=True)

    def stop(self, grace_s: float = 0.0) -> None:
        """Shut the engine process down as :meth:`Engine.stop` does (what still runs after ``grace_s`` gets a
        503) and wait for it to exit (killed after ``grace_s`` + 60 s); again: nothing."""
        self._accepting = False
        if self.process.is_alive():
            self._send(("stop", grace_s), quiet=True)
            self.process.join(timeout=grace_s + 60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)

    def _stop_at_exit(self) -> None:
        """At the interpreter's exit (before multiprocessing's own handler, which would wait forever for a
        process that ignores SIGTERM): stop the engine process if nobody did."""
        if self.process.is_alive():
            self.stop(0.0)

    # ------------------------------------------------------------------ queries and metrics
    def query(self) -> dict | None:
        """The engine process's counts, metrics, memory and CPU time; None once it is gone."""
        if self.dead is not None:
            return None
        qid, slot = next(self._ids), [threading.Event(), None]
        with self._lock:
            self._queries[qid] = slot
        try:
            self._send(("query", qid), quiet=True)
            slot[0].wait(QUERY_TIMEOUT_S)
        finally:
            with self._lock:
                self._queries.pop(qid, None)
        return slot[1]

    def render_metrics(self) -> str:
        """``/metrics``: the HTTP process's metrics plus the engine process's, memory and CPU time summed."""
        reply = self.query()
        if reply is None:
            return self.metrics.render()
        return self.metrics.merged(reply["metrics"]).render(resident=resident_bytes() + reply["resident"],
                                                             cpu_s=time.process_time() + reply["cpu_s"])

    # ------------------------------------------------------------------ the pipe
    def _send(self, message: tuple, quiet: bool = False) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the engine process is gone: the reader fails what is open
            if not quiet:
                raise RequestError(503, None, "the engine is not running", "unavailable_error") from None

    def _read(self) -> None:
        """The reader thread: hand each message's events to their jobs' event loops until the pipe closes."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "events":
                self._dispatch(message[1])
            elif kind == "reply":
                with self._lock:
                    slot = self._queries.get(message[1])
                if slot is not None:
                    slot[1] = message[2]
                    slot[0].set()
            elif kind == "stopped":
                self._stopped.set()
        if not self._stopped.is_set():
            self._died()
        with self._lock:
            for slot in self._queries.values():
                slot[0].set()

    def _dispatch(self, events: list[tuple[int, tuple]]) -> None:
        to_loops: list[tuple[LoopSink, tuple]] = []
        with self._lock:
            for jid, event in events:
                job = self._jobs.get(jid)
                if job is None:  # cancelled by its handler: nobody listens
                    continue
                if event[0] != "commit":
                    del self._jobs[jid]
                to_loops.append((job.sink, event))
        hand_over(to_loops)

    def _died(self) -> None:
        self.process.join(timeout=5)
        self.dead = f"the engine process (pid {self.process.pid}) died, exit code {self.process.exitcode}"
        with self._lock:
            open_jobs, self._jobs = list(self._jobs.items()), {}
        print(f"refusion serve: {self.dead}; failing its {len(open_jobs)} open requests with 500, new requests "
              "get 503", file=sys.stderr, flush=True)
        hand_over([(job.sink, ("error", 500, self.dead)) for _, job in open_jobs])


class ProcessServeState(ServeState):
    """The app's state over an :class:`EngineProcess`: jobs checked here, decoded there."""

    def __init__(self, engine: EngineProcess, config: dict[str, Any], model_name: str, **settings: Any) -> None:
        super().__init__(engine, DecoderPool(engine.model, config), model_name, **settings)

    def new_job(self, prompt_ids: list[int], req, sink: LoopSink, deadline: float) -> RemoteJob:
        return self.engine.new_job(self.pool, prompt_ids, req, sink, deadline, self.stream_interval)

    def render_metrics(self) -> str:
        return self.engine.render_metrics()


def create_process_state(spec: EngineSpec, model_name: str, model_path: str | None = None,
                         **settings: Any) -> ProcessServeState:
    """A server's state whose engine runs in a process of its own built from ``spec``; ``settings``:
    :class:`~refusion.serve.app.ServeState`'s (api_key, max_body_bytes, ...)."""
    return ProcessServeState(EngineProcess(spec), spec.config, model_name, model_path=model_path, **settings)
