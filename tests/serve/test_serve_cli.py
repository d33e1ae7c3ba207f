"""The serve and loadtest commands refuse bad flags before loading a model or sending a request."""

from __future__ import annotations

import pytest

from refusion.cli import main


@pytest.mark.parametrize("args,field", [
    (["serve", "--bench-row", "nope", "--task", "arith"], "--bench-row"),
    (["serve", "--task", "arith"], "--bench-row"),
    (["serve", "--bench-row", "ar", "--task", "nope"], "--task"),
    (["serve"], "--model"),
    (["serve", "--model", "tiny-ar"], "--decoder"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--max-batch", "0"], "--max-batch"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--set", "slot_size=4"], "slot_size"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--api-key-file", "/nonexistent/key"], "--api-key-file"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--engine", "process", "--replicas", "2"], "--engine"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--call-cost-tokens", "100,0.01"], "--call-cost-tokens"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--call-cost-tokens", "100,-1,0"], "--call-cost-tokens"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--call-cost-tokens", "cheap"], "--call-cost-tokens"),
    (["loadtest", "--url", "http://192.0.2.1:8000"], "loopback"),
    (["loadtest", "--url", "ftp://127.0.0.1:8000"], "--url"),
])
def test_bad_flags_are_refused_naming_them(args, field, capsys):
    assert main(args) == 2
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--engine", "thread"]])
def test_replicas_run_their_engines_in_threads_by_default(extra, monkeypatch):
    """``--replicas`` runs each replica's engine in a thread: without ``--engine``, or with ``--engine thread``,
    it goes on to Ray Serve (here a stand-in) where ``--engine process`` is refused."""
    pytest.importorskip("uvicorn")
    import refusion.serve.cli as serve_cli

    called = []
    monkeypatch.setattr(serve_cli, "_serve_replicas", lambda args, *rest: called.append(args.replicas) or 0)
    assert main(["serve", "--model", "tiny-ar", "--decoder", "ar", "--replicas", "2", *extra]) == 0
    assert called == [2]


def test_the_call_price_by_flag_and_device():
    """``--call-cost-tokens``: auto is the CPU's price there and off elsewhere; N alone keeps the device's key
    and pair terms (the CPU's, or none); three numbers set all; the engine names the flag on a bad price."""
    from refusion.core.loop import CallPrice
    from refusion.serve.cli import parse_call_cost_tokens
    from refusion.serve.engine import CALL_PRICE_CPU, call_price

    assert call_price(parse_call_cost_tokens("auto"), "cpu") == CALL_PRICE_CPU
    assert call_price(parse_call_cost_tokens("auto"), "cuda") is None
    assert call_price(parse_call_cost_tokens("off"), "cpu") is None
    assert call_price(parse_call_cost_tokens("60"), "cpu") == CallPrice(60.0, CALL_PRICE_CPU.key, CALL_PRICE_CPU.pair)
    assert call_price(parse_call_cost_tokens("60"), "cuda") == CallPrice(60.0)
    assert call_price(parse_call_cost_tokens("60,0.5,0.25"), "cuda") == CallPrice(60.0, 0.5, 0.25)
    assert CALL_PRICE_CPU.key > 0 and CALL_PRICE_CPU.pair > 0


def test_the_engine_names_the_flag_of_a_bad_price():
    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.serve.engine import Engine

    decoder = build_decoder(Backbone.from_pretrained("tiny-ar"), {"decoder": "ar", "gen_length": 8})
    for bad in (-1.0, (1.0, -2.0, 0.0), (1.0, 2.0)):
        with pytest.raises(ValueError, match="--call-cost-tokens"):
            Engine(decoder, call_cost_tokens=bad)


def test_a_decoder_whose_batch_is_its_own_is_refused():
    import types

    from refusion.core.config import ConfigError
    from refusion.core.hookspecs import hookimpl
    from refusion.core.registry import build_registry, make_plugin_manager, set_registry
    from refusion.decoders.ar import ArDecoder
    from refusion.models.backend import Backbone
    from refusion.serve.options import DecoderPool

    class OwnBatch(ArDecoder):
        name = "own-batch"

        def _decode_batch(self, prompts, generator, on_commit=None):
            return [self._decode(p, generator) for p in prompts]

    class Wrapped(OwnBatch):  # a batch around the default one says so
        name = "wrapped-batch"
        batch_by_batch_loop = True

    module = types.ModuleType("own_batch_plugin")
    module.register_decoders = hookimpl(lambda register: [register(c.name, c) for c in (OwnBatch, Wrapped)])
    bb = Backbone.from_pretrained("tiny-ar")
    set_registry(build_registry(make_plugin_manager([module], autoload=False)))
    try:
        with pytest.raises(ConfigError, match="'own-batch' cannot be served"):
            DecoderPool(bb, {"decoder": "own-batch"})
        assert DecoderPool(bb, {"decoder": "wrapped-batch"}).name == "wrapped-batch"
        assert DecoderPool(bb, {"decoder": "speculative", "k": 2}).name == "speculative"
    finally:
        set_registry(None)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--engine", "thread"]])
def test_serve_exits_cleanly_on_sigint(extra):
    """A terminal's Ctrl-C (SIGINT to the process group: by default, with the engine in a process of its own, to
    both processes) ends the server cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("uvicorn")
    proc = subprocess.Popen([sys.executable, "-m", "refusion.cli", "serve", "--model", "tiny-ar", "--decoder", "ar",
                             "--port", "0", "--threads", "1", "--log-level", "warning", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving ")
        url, end = line.rsplit(" ", 1)[-1].strip(), time.monotonic() + 30
        while True:  # up: the signal reaches uvicorn's handlers (by default, both processes)
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                assert time.monotonic() < end
                time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    end = time.monotonic() + 10  # no process of the server's group is left (multiprocessing's resource tracker
    with pytest.raises(ProcessLookupError):  # ends once the server has: its pipe closes)
        while time.monotonic() < end:
            os.killpg(proc.pid, 0)
            time.sleep(0.05)
