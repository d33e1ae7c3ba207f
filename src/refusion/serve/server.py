"""Running the app: uvicorn on a socket this module binds (loopback unless told otherwise), in the
foreground (``refusion serve``) or in a background thread (tests, the replica wrapper).

Shutdown (SIGINT / SIGTERM, or :meth:`BackgroundServer.stop`) is graceful: new requests are refused with a
503 at once, the listening socket closes, requests already queued or decoding finish for up to the grace
period, and what remains is then rejected (queued) or stopped (running), each with a 503.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from refusion.serve.app import ServeState, build_app
from refusion.serve.net import bind


class _Server(uvicorn.Server):
    """uvicorn's server, closing the engine's intake the moment a shutdown is asked for."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.engine.close_intake()
        super().handle_exit(sig, frame)
        # the signal asked for the graceful shutdown above; uvicorn would raise it again once that is done
        # (a KeyboardInterrupt out of its event loop, logged as a traceback): the command exits cleanly
        getattr(self, "_captured_signals", []).clear()


def make_server(state: ServeState, log_level: str = "warning", access_log: bool = False) -> _Server:
    config = uvicorn.Config(build_app(state), log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=max(1, int(round(state.shutdown_grace_s))),
                            timeout_keep_alive=30)
    return _Server(config, state)


def serve_forever(state: ServeState, host: str, port: int, log_level: str = "info") -> None:
    """Serve in the foreground until SIGINT / SIGTERM."""
    sock = bind(host, port)
    server = make_server(state, log_level=log_level, access_log=log_level == "debug")
    print(f"serving {state.model_name!r} ({state.pool.name}) on http://{host}:{sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown: the exit is clean
        pass
    finally:  # stopped already by the app's lifespan, unless a signal came before uvicorn started
        state.engine.stop(0.0)


class BackgroundServer:
    """The app served from a thread on ``host`` (loopback by default) and a free port; ``url`` once started."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.sock = bind(host, port)
        self.server = make_server(state)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="refusion-serve")
        address = self.sock.getsockname()
        self.url = f"http://{host}:{address[1]}"

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful shutdown (see the module docstring); returns when the server thread has ended."""
        self.state.engine.close_intake()
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)


def create_state(backbone, config: dict, model_name: str, model_path: str | None = None, max_batch: int = 16,
                 max_queue: int = 64, api_key: str | None = None, admit_min: int | None = None,
                 admit_wait_s: float | None = None, call_cost_tokens: float | None | str = "auto",
                 align_groups: bool = True, **settings: Any) -> ServeState:
    """The engine, decoder pool and settings of a server of ``config`` (a decoder config mapping) on
    ``backbone``; ``settings``: :class:`~refusion.serve.app.ServeState`'s (max_body_bytes, ...)."""
    from refusion.serve.engine import Engine
    from refusion.serve.options import DecoderPool

    pool = DecoderPool(backbone, config)
    admission = {k: v for k, v in (("admit_min", admit_min), ("admit_wait_s", admit_wait_s)) if v is not None}
    engine = Engine(pool.base, max_batch=max_batch, max_queue=max_queue, call_cost_tokens=call_cost_tokens,
                    align_groups=align_groups, **admission)
    return ServeState(engine, pool, model_name, model_path, api_key=api_key, **settings)
