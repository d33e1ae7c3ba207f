"""`refusion serve` against the official openai client on 127.0.0.1: completions, chat, streams, stop
strings, per-request decoder options, errors; every served output token-identical to the offline decode
(Decoder.generate) of the same prompt and config, while requests share a running batch. The ``server``
fixture's tests run with the engine in a thread (``--engine thread``) and in a process of its own (the
default, ``--engine process``), whose hang-ups, 429s, 504s, shutdown, death and metrics the last tests check."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from helpers import endless_backbone  # noqa: E402

from refusion.core.config import build_decoder  # noqa: E402
from refusion.models.backend import Backbone  # noqa: E402
from refusion.models.loading import resolve_model_path  # noqa: E402
from refusion.models.tokenizer import encode_prompt  # noqa: E402
from refusion.serve.engine import Job  # noqa: E402
from refusion.serve.metrics import Histogram, parse_metrics, server_metrics  # noqa: E402
from refusion.serve.server import BackgroundServer, create_state  # noqa: E402
from refusion.tasks import get_task  # noqa: E402

#: decoder -> (shipped model, served config): short generations keep the suite fast
SERVED = {
    "refusion": ("tiny-refusion", {"decoder": "refusion", "gen_length": 24, "slot_size": 8}),
    "ar": ("tiny-ar", {"decoder": "ar", "gen_length": 24}),
    "llada": ("tiny-mdm", {"decoder": "llada", "gen_length": 24, "block_length": 8, "kv_cache": "dual",
                           "selector": {"name": "confidence_threshold", "threshold": 0.9}}),
    "block": ("tiny-block", {"decoder": "block", "gen_length": 24,
                             "selector": {"name": "confidence_threshold", "threshold": 0.9}}),
    "speculative": ("tiny-ar", {"decoder": "speculative", "gen_length": 24, "k": 4,
                                "proposer": {"name": "diffusion", "model": "tiny-block"}}),
}
QUERIES = [ex.query for ex in get_task("arith").examples("test", 6)]

_backbones: dict[str, Backbone] = {}


def offline_backbone(model: str) -> Backbone:
    """A backbone of its own for offline decodes (the server's engine thread drives the served one)."""
    if model not in _backbones:
        _backbones[model] = Backbone.from_pretrained(model)
    return _backbones[model]


def offline(model: str, config: dict, prompt_ids: list[int], **options) -> list[int]:
    return build_decoder(offline_backbone(model), {**config, **options}).generate(prompt_ids).token_ids


#: create_state's settings that are the engine's (an engine process takes them in its EngineSpec)
ENGINE_SETTINGS = ("max_batch", "max_queue", "admit_min", "admit_wait_s", "call_cost_tokens", "align_groups")


def start(model: str, config: dict, process: bool = False, load=None, **settings) -> BackgroundServer:
    """A server of ``model`` and ``config`` on a free port; ``process``: its engine in a process of its own
    (``refusion serve``'s default, ``--engine process``), its backbone from ``load(path)`` (default: the model's)."""
    if process:
        from refusion.serve.engine_process import EngineSpec, create_process_state

        engine = {k: settings.pop(k) for k in ENGINE_SETTINGS if k in settings}
        spec = EngineSpec(str(resolve_model_path(model)), config, engine, load=load)
        return BackgroundServer(create_process_state(spec, model, spec.path, **settings)).start()
    bb = Backbone.from_pretrained(model) if load is None else load(str(resolve_model_path(model)))
    state = create_state(bb, config, model, str(resolve_model_path(model)), **settings)
    return BackgroundServer(state).start()


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    """A refusion server, its engine in a thread of the server's process, then in a process of its own."""
    srv = start(*SERVED["refusion"], process=request.param == "process", max_batch=8, max_queue=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(model: str, query: str) -> list[int]:
    return encode_prompt(offline_backbone(model).tokenizer, query)


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_completions_and_chat_are_the_offline_decode(server, client):
    model, config = SERVED["refusion"]
    tok = offline_backbone(model).tokenizer
    prompt = QUERIES[0] + "\n"
    out = client.completions.create(model=model, prompt=prompt)
    want = offline(model, config, tok.encode(prompt, add_special_tokens=False))
    assert out.model_extra["refusion"]["token_ids"] == want
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(want)
    assert out.choices[0].finish_reason == ("stop" if want[-1] in offline_backbone(model).eos_ids else "length")
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUERIES[1]}],
                                          max_tokens=16)
    want = offline(model, config, chat_ids(model, QUERIES[1]), gen_length=16)
    assert chat.model_extra["refusion"]["token_ids"] == want
    assert chat.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    ids = client.completions.create(model=model, prompt=tok.encode(prompt, add_special_tokens=False), max_tokens=8)
    assert ids.model_extra["refusion"]["token_ids"] == offline(model, config, tok.encode(prompt), gen_length=8)


def test_a_stream_sends_the_final_text_in_pieces(server, client):
    model, config = SERVED["refusion"]
    tok = offline_backbone(model).tokenizer
    want = offline(model, config, chat_ids(model, QUERIES[2]), gen_length=160, slot_size=4)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUERIES[2]}],
                                            stream=True, stream_options={"include_usage": True}, max_tokens=160,
                                            extra_body={"refusion": {"slot_size": 4}})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    ids = [t for c in chunks for t in (c.model_extra.get("refusion") or {}).get("token_ids", [])]
    assert ids == want
    assert "".join(pieces) == tok.decode(want, skip_special_tokens=True)
    assert len(pieces) > 1  # text goes out as it becomes final, not at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want)
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_concurrent_requests_with_their_own_options_each_decode_as_offline(process):
    """Requests that differ in decoder options, max_tokens and seed share the running batch; each is
    its own offline decode. Every shipped decoder kind, its engine in a thread and in a process."""
    for name, (model, config) in SERVED.items():
        srv = start(model, config, process=process, max_batch=4, max_queue=16)
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            extra = {"refusion": [{"slot_size": 4}, {}], "llada": [{"block_length": 4}, {}],
                     "block": [{"selector": {"name": "confidence_threshold", "threshold": 0.5}}, {}],
                     "ar": [{}, {}], "speculative": [{"k": 2, "schedule": "heuristic"}, {}]}[name]
            jobs = [(q, extra[i % 2], 8 + 8 * (i % 3)) for i, q in enumerate(QUERIES)]

            def ask(job):
                q, options, n = job
                out = c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=n,
                                                extra_body={"refusion": options} if options else None)
                return out.model_extra["refusion"]["token_ids"]

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                served = list(pool.map(ask, jobs))
            for (q, options, n), ids in zip(jobs, served):
                assert ids == offline(model, config, chat_ids(model, q), gen_length=n, **options), (name, options, n)
            engine, end = srv.state.engine, time.monotonic() + 10
            if process:  # the cache is the engine process's: its counts
                assert wait_until(lambda: engine.counts() == (0, 0))
                continue
            caches = [getattr(engine.cache, side) for side in ("target", "drafter")] if name == "speculative" \
                else [engine.cache]
            while (engine.counts() != (0, 0) or any(c.lengths for c in caches)) and time.monotonic() < end:
                time.sleep(0.01)  # the last answer goes out as its loop ends; its rows leave just after
            assert engine.counts() == (0, 0) and all(c.lengths == [] for c in caches)
        finally:
            srv.stop()


def test_stop_strings_cut_the_text(server, client):
    model, config = SERVED["refusion"]
    tok = offline_backbone(model).tokenizer
    full = tok.decode(offline(model, config, chat_ids(model, QUERIES[3])), skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop and stop in full
    cut = full[: full.index(stop)]
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUERIES[3]}], stop=[stop])
    assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUERIES[3]}],
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_temperature_and_seed_reach_the_drafter(server, client):
    model, config = SERVED["refusion"]
    prompt = chat_ids(model, QUERIES[4])
    sampled = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUERIES[4]}],
                                              temperature=30.0, seed=s).model_extra["refusion"]["token_ids"]
               for s in (1, 2)]
    for s, ids in zip((1, 2), sampled):
        assert ids == offline(model, config, prompt, seed=s, drafter={"name": "gumbel", "temperature": 30.0})
    assert sampled[0] != sampled[1]


C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BAD = {  # kind -> (method, path, body (a dict, "M" the served model) or raw bytes, headers, status, field named)
    "bad JSON": ("POST", C, b"{not json", {}, 400, "body"),
    "body not an object": ("POST", C, b"[1, 2]", {}, 400, "body"),
    "body not UTF-8": ("POST", C, b'{"model": "\xff"}', {}, 400, "body"),
    "oversized body": ("POST", C, {"model": "M", "prompt": "hi" * 40_000}, {}, 413, "body"),
    "no model": ("POST", C, {"prompt": "hi"}, {}, 400, "model"),
    "model not a string": ("POST", C, {"model": 5, "prompt": "hi"}, {}, 400, "model"),
    "unknown model": ("POST", C, {"model": "nope", "prompt": "hi"}, {}, 404, "model"),
    "no prompt": ("POST", C, {"model": "M"}, {}, 400, "prompt"),
    "empty prompt": ("POST", C, {"model": "M", "prompt": ""}, {}, 400, "prompt"),
    "empty token list": ("POST", C, {"model": "M", "prompt": []}, {}, 400, "prompt"),
    "prompt a number": ("POST", C, {"model": "M", "prompt": 7}, {}, 400, "prompt"),
    "several prompts": ("POST", C, {"model": "M", "prompt": ["a", "b"]}, {}, 400, "prompt"),
    "nested token lists": ("POST", C, {"model": "M", "prompt": [[1, 2]]}, {}, 400, "prompt"),
    "token id outside the vocabulary": ("POST", C, {"model": "M", "prompt": [5, 99999]}, {}, 400, "prompt"),
    "prompt over the model's length": ("POST", C, {"model": "M", "prompt": "1 + " * 400}, {}, 400, "prompt"),
    "negative max_tokens": ("POST", C, {"model": "M", "prompt": "hi", "max_tokens": -3}, {}, 400, "max_tokens"),
    "zero max_tokens": ("POST", C, {"model": "M", "prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    "huge max_tokens": ("POST", C, {"model": "M", "prompt": "hi", "max_tokens": 10**9}, {}, 400, "max_tokens"),
    "max_tokens a string": ("POST", C, {"model": "M", "prompt": "hi", "max_tokens": "10"}, {}, 400, "max_tokens"),
    "max_tokens a float": ("POST", C, {"model": "M", "prompt": "hi", "max_tokens": 8.0}, {}, 400, "max_tokens"),
    "negative temperature": ("POST", C, {"model": "M", "prompt": "hi", "temperature": -1}, {}, 400, "temperature"),
    "huge temperature": ("POST", C, {"model": "M", "prompt": "hi", "temperature": 1e6}, {}, 400, "temperature"),
    "temperature a string": ("POST", C, {"model": "M", "prompt": "hi", "temperature": "hot"}, {}, 400, "temperature"),
    "seed a float": ("POST", C, {"model": "M", "prompt": "hi", "seed": 1.5}, {}, 400, "seed"),
    "negative seed": ("POST", C, {"model": "M", "prompt": "hi", "seed": -1}, {}, 400, "seed"),
    "stop a number": ("POST", C, {"model": "M", "prompt": "hi", "stop": 3}, {}, 400, "stop"),
    "five stop strings": ("POST", C, {"model": "M", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, {}, 400,
                          "stop"),
    "empty stop string": ("POST", C, {"model": "M", "prompt": "hi", "stop": [""]}, {}, 400, "stop"),
    "stream a string": ("POST", C, {"model": "M", "prompt": "hi", "stream": "yes"}, {}, 400, "stream"),
    "stream_options without stream": ("POST", C, {"model": "M", "prompt": "hi", "stream_options":
                                                  {"include_usage": True}}, {}, 400, "stream_options"),
    "user a number": ("POST", C, {"model": "M", "prompt": "hi", "user": 5}, {}, 400, "user"),
    "unknown field": ("POST", C, {"model": "M", "prompt": "hi", "colour": "red"}, {}, 400, "colour"),
    "n above 1": ("POST", C, {"model": "M", "prompt": "hi", "n": 2}, {}, 400, "n"),
    "logprobs": ("POST", C, {"model": "M", "prompt": "hi", "logprobs": 3}, {}, 400, "logprobs"),
    "top_p below 1": ("POST", C, {"model": "M", "prompt": "hi", "top_p": 0.5}, {}, 400, "top_p"),
    "penalty": ("POST", C, {"model": "M", "prompt": "hi", "presence_penalty": 0.5}, {}, 400, "presence_penalty"),
    "decoder option out of range": ("POST", C, {"model": "M", "prompt": "hi", "refusion": {"slot_size": 0}}, {}, 400,
                                    "slot_size"),
    "unknown decoder option": ("POST", C, {"model": "M", "prompt": "hi", "refusion": {"slot_sise": 4}}, {}, 400,
                               "slot_sise"),
    "nested decoder option out of range": ("POST", C, {"model": "M", "prompt": "hi", "refusion":
                                                       {"selector": {"slot_threshold": 2}}}, {}, 400,
                                           "selector.slot_threshold"),
    "decoder option not a name": ("POST", C, {"model": "M", "prompt": "hi", "refusion": {"no-such!": 1}}, {}, 400,
                                  "refusion.no-such!"),
    "another decoder": ("POST", C, {"model": "M", "prompt": "hi", "refusion": {"decoder": "ar"}}, {}, 400,
                        "refusion.decoder"),
    "gen_length per request": ("POST", C, {"model": "M", "prompt": "hi", "refusion": {"gen_length": 4}}, {}, 400,
                               "refusion.gen_length"),
    "options not a mapping": ("POST", C, {"model": "M", "prompt": "hi", "refusion": "fast"}, {}, 400, "refusion"),
    "no messages": ("POST", CHAT, {"model": "M", "messages": []}, {}, 400, "messages"),
    "unknown role": ("POST", CHAT, {"model": "M", "messages": [{"role": "robot", "content": "hi"}]}, {}, 400, "role"),
    "content a number": ("POST", CHAT, {"model": "M", "messages": [{"role": "user", "content": 5}]}, {}, 400,
                         "content"),
    "image content part": ("POST", CHAT, {"model": "M", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, {}, 400, "type"),
    "two token limits that differ": ("POST", CHAT, {"model": "M", "messages": HI, "max_tokens": 4,
                                                    "max_completion_tokens": 5}, {}, 400, "max_completion_tokens"),
    "chat with a prompt": ("POST", CHAT, {"model": "M", "messages": HI, "prompt": "hi"}, {}, 400, "prompt"),
    "wrong API key": ("POST", C, {"model": "M", "prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401,
                      "Authorization"),
    "no API key": ("POST", C, {"model": "M", "prompt": "hi"}, {"Authorization": ""}, 401, "Authorization"),
    "no API key for /metrics": ("GET", "/metrics", None, {"Authorization": ""}, 401, "Authorization"),
    "unknown path": ("POST", "/v1/nothing", {"model": "M"}, {}, 404, "path"),
    "wrong method": ("GET", C, None, {}, 405, "method"),
}
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def guarded():
    """A refusion server with an API key and a 64 KiB body limit."""
    srv = start(*SERVED["refusion"], api_key="sesame", max_body_bytes=64 * 1024)
    yield srv
    srv.stop()


def send_bad(url: str, kind: str) -> tuple[int, dict]:
    method, path, body, headers, _, _ = BAD[kind]
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": SERVED["refusion"][0]}
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = raw(url, method, path, data, {**KEY, **headers})
    return status, json.loads(answer)


def test_there_are_at_least_20_kinds_of_bad_request():
    assert len(BAD) >= 20


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_request_gets_a_4xx_naming_the_field(guarded, kind):
    status, answer = send_bad(guarded.url, kind)
    want_status, field = BAD[kind][4:]
    error = answer["error"]
    assert status == want_status and 400 <= status < 500, (kind, status, error)
    assert field in error["message"] and error["code"] == status, (kind, error)
    assert error["type"] and error["param"], (kind, error)  # OpenAI's error object, the field as its param


def test_the_server_keeps_serving_others_through_bad_requests(guarded):
    """Every kind of bad request, sent while well-formed requests (streamed and not) are decoding: each bad
    one gets its 4xx, each good one its offline decode, and the server still answers after."""
    model, config = SERVED["refusion"]
    c = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sesame", max_retries=0, timeout=120)
    tok = offline_backbone(model).tokenizer

    def good(i: int) -> list[int]:
        kwargs = {"model": model, "messages": [{"role": "user", "content": QUERIES[i]}], "max_tokens": 48}
        if i % 2:
            return [t for chunk in c.chat.completions.create(stream=True, **kwargs)
                    for t in (chunk.model_extra.get("refusion") or {}).get("token_ids", [])]
        return c.chat.completions.create(**kwargs).model_extra["refusion"]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(4)]
        bads = {kind: pool.submit(send_bad, guarded.url, kind) for kind in BAD}
        for kind, future in bads.items():
            assert future.result()[0] == BAD[kind][4], kind
        for i, future in enumerate(goods):
            assert future.result() == offline(model, config, chat_ids(model, QUERIES[i]), gen_length=48)
    out = c.completions.create(model=model, prompt="1 + 1 =", max_tokens=4)
    assert out.model_extra["refusion"]["token_ids"] == offline(model, config, tok.encode("1 + 1 ="), gen_length=4)
    assert raw(guarded.url, "GET", "/health", None, {})[0] == 200  # no key needed
    metrics = raw(guarded.url, "GET", "/metrics", None, KEY)[1].decode()
    assert 'refusion_requests_total{endpoint="completions",status="400"}' in metrics
    engine, end = guarded.state.engine, time.monotonic() + 10
    while engine.counts() != (0, 0) and time.monotonic() < end:
        time.sleep(0.01)
    assert engine.counts() == (0, 0)


def test_the_api_key_file_is_read(tmp_path):
    from refusion.serve.cli import _api_key

    p = tmp_path / "key"
    p.write_text("sesame\n")
    assert _api_key(str(p)) == "sesame"


def test_a_model_without_chat_template_refuses_chat_but_serves_completions():
    model, config = SERVED["ar"]
    bb = Backbone.from_pretrained(model)
    bb.tokenizer.chat_template = None
    srv = BackgroundServer(create_state(bb, config, model)).start()
    try:
        got, answer = raw(srv.url, "POST", "/v1/chat/completions",
                          json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert got == 400 and "chat template" in json.loads(answer)["error"]["message"]
        got, _ = raw(srv.url, "POST", "/v1/completions", json.dumps({"model": model, "prompt": "hi"}).encode())
        assert got == 200
        got, answer = raw(srv.url, "POST", "/v1/completions",
                          json.dumps({"model": model, "prompt": "hi", "temperature": 0.7}).encode())
        assert got == 400 and "temperature" in json.loads(answer)["error"]["message"]  # ar decodes greedily
    finally:
        srv.stop()


def endless(**settings) -> BackgroundServer:
    """An ar server whose model never ends a text (no EOS ids): a decode runs its whole max_tokens."""
    return start(*SERVED["ar"], load=endless_backbone, **settings)


def test_a_client_that_hangs_up_leaves_the_batch():
    model, _ = SERVED["ar"]
    srv = endless()
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": model, "prompt": "1 + 2 =", "stream": True, "max_tokens": 480}),
            headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event: the decode is under way
        engine = srv.state.engine
        assert engine.counts() == (1, 0)
        conn.sock.close()
        conn.close()
        end = time.monotonic() + 20
        while time.monotonic() < end and (engine.counts() != (0, 0) or engine.cache.lengths):
            time.sleep(0.01)
        assert engine.counts() == (0, 0) and engine.cache.lengths == [] and engine.cache.views == []
        assert engine.metrics.value("refusion_cancelled_total", reason="disconnect") == 1
        assert engine.metrics.value("refusion_generation_tokens_total") < 480  # it stopped early
    finally:
        srv.stop()


def test_a_request_over_its_timeout_gets_a_504_and_the_server_goes_on():
    model, config = SERVED["ar"]
    srv = endless(request_timeout_s=0.3)
    try:
        got, answer = raw(srv.url, "POST", "/v1/completions",
                          json.dumps({"model": model, "prompt": "1 + 2 =", "max_tokens": 480}).encode())
        assert got == 504 and "timed out" in json.loads(answer)["error"]["message"]
        for _ in range(5):  # a one-token request fits in the timeout (a loaded machine may need a retry)
            got, answer = raw(srv.url, "POST", "/v1/completions",
                              json.dumps({"model": model, "prompt": "1 + 2 =", "max_tokens": 1}).encode())
            if got != 504:
                break
        assert got == 200 and len(json.loads(answer)["refusion"]["token_ids"]) == 1
        end = time.monotonic() + 10  # the answer goes out as the loop ends; its rows leave just after
        while srv.state.engine.cache.lengths and time.monotonic() < end:
            time.sleep(0.01)
        assert srv.state.engine.cache.lengths == []
    finally:
        srv.stop()


def test_a_full_queue_answers_429():
    from refusion.serve.engine import Engine, Job
    from refusion.serve.protocol import RequestError

    model, config = SERVED["ar"]
    engine = Engine(build_decoder(offline_backbone(model), config), max_batch=1, max_queue=1)  # not started
    for _ in range(2):
        engine.submit(Job([5], engine.decoder, None, time.perf_counter() + 9, lambda e: None))
    with pytest.raises(RequestError) as full:
        engine.submit(Job([5], engine.decoder, None, time.perf_counter() + 9, lambda e: None))
    assert full.value.status == 429 and "--max-queue" in full.value.message


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_shutdown_finishes_what_is_queued_and_running_then_refuses(process):
    """... then, with --engine process, the engine process exits."""
    model, config = SERVED["ar"]
    srv = (endless_process if process else endless)(max_batch=2, shutdown_grace_s=30)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    engine = srv.state.engine

    def ask(q):
        return c.completions.create(model=model, prompt=q, max_tokens=120).model_extra["refusion"]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, q) for q in QUERIES[:4]]
        end = time.monotonic() + 20
        while sum(engine.counts()) < 4 and time.monotonic() < end:  # every request is in, some still queued
            time.sleep(0.001)
        running, queued = engine.counts()
        assert running + queued == 4 and queued >= 2
        srv.stop()
        served = [f.result() for f in futures]
    bb = offline_backbone(model)
    eos, bb.eos_ids = bb.eos_ids, set()
    try:
        assert served == [offline(model, config, bb.tokenizer.encode(q), gen_length=120) for q in QUERIES[:4]]
    finally:
        bb.eos_ids = eos
    with pytest.raises(OSError):
        raw(srv.url, "GET", "/health")
    if process:
        assert not engine.process.is_alive() and engine.process.exitcode == 0


def test_loadtest_reports_delivery_and_matches_offline(server):
    from refusion.core.config import ConfigError
    from refusion.serve.loadtest import run_loadtest

    report = run_loadtest(server.url, QUERIES[:4], concurrency=4, requests=12, duration_limit_s=120,
                          disconnect_fraction=0.25, check_offline=True)
    assert report["errors"] == {} and report["completed"] == 9 and report["disconnected"] == 3
    assert report["delivery"] == {"each_completed_once": True, "unique_response_ids": True, "lost": 0}
    assert report["offline"]["differ"] == 0 and report["offline"]["compared"] == 12
    assert report["server"]["batch_size_after"] == 0
    assert report["ttft_ms"]["p50"] is not None and report["tokens_per_s"] > 0
    with pytest.raises(ConfigError, match="loopback"):
        run_loadtest("http://10.1.2.3:8000", QUERIES, 1, 1, 10)


def test_the_stream_interval_coalesces_commits_and_the_tokens_stay_the_offline_decode():
    """AR commits one token per step; with --stream-interval 4 a stream's chunks after the first hold at least
    4 tokens (the last may hold fewer: what was pending at the end), and the tokens are the offline decode."""
    model, config = SERVED["ar"]
    want = offline(model, config, chat_ids(model, QUERIES[0]))
    assert len(want) > 10
    for interval in (4, 1):
        srv = start(model, config, stream_interval=interval)
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": QUERIES[0]}],
                                                    stream=True))
            sizes = [len(ids) for ch in chunks if (ids := (ch.model_extra.get("refusion") or {}).get("token_ids"))]
            assert [t for ch in chunks for t in (ch.model_extra.get("refusion") or {}).get("token_ids", [])] == want
            if interval == 4:
                assert sizes[0] == 1  # the first commit goes out at once
                assert all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 2 + (len(want) - 1) // 4
            else:
                assert len(sizes) > 2 + (len(want) - 1) // 4  # every commit is a chunk (unless the handler lags)
            fed, end = len(chat_ids(model, QUERIES[0])) + len(want) - 1, time.monotonic() + 10
            while True:  # the engine counts a call's tokens before its next call (or as it goes idle)
                metrics = parse_metrics(raw(srv.url, "GET", "/metrics")[1].decode())
                if metrics["refusion_tokens_fed_total"] >= fed or time.monotonic() > end:
                    break
                time.sleep(0.05)
            assert metrics["refusion_tokens_fed_total"] == fed  # the prompt, then one token per step
            assert metrics["refusion_engine_cpu_seconds_total"] > 0
        finally:
            srv.stop()
    with pytest.raises(ValueError, match="stream-interval"):
        create_state(offline_backbone(model), config, model, stream_interval=0)


def test_a_job_sends_its_first_commit_at_once_then_every_interval_and_the_rest_before_it_ends():
    events = []
    job = Job([5], build_decoder(offline_backbone("tiny-ar"), SERVED["ar"][1]), None, time.perf_counter() + 9,
              events.append, stream_interval=3)
    for token in range(7):
        job.commit([token])
    job.flush()
    assert events == [("commit", [0]), ("commit", [1, 2, 3]), ("commit", [4, 5, 6])]
    job.commit([7, 8, 9, 10])
    job.flush()
    assert events[-1] == ("commit", [7, 8, 9, 10]) and len(events) == 4


def test_every_response_names_the_server_that_answered(server):
    status, body = raw(server.url, "GET", "/health")
    assert json.loads(body)["server"] == server.state.server_id
    conn = http.client.HTTPConnection(*server.url.removeprefix("http://").split(":"), timeout=30)
    try:
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        response.read()
        assert response.getheader("X-Refusion-Server") == server.state.server_id
        conn.request("GET", "/nowhere")
        response = conn.getresponse()
        response.read()
        assert response.status == 404 and response.getheader("X-Refusion-Server") == server.state.server_id
    finally:
        conn.close()


def test_the_events_of_a_step_reach_an_event_loop_in_one_wake_up():
    """Each event a wake-up of the handlers' event loop made the HTTP side take the interpreter from the
    engine thread once per commit; the engine hands a step's events over in one ``call_soon_threadsafe`` per
    loop, each job's events in order, the tokens the offline decode's."""
    import threading

    from refusion.serve.engine import Engine, LoopSink

    class Loop:  # an event loop that runs each hand-over at once and counts them
        wakeups = 0

        def call_soon_threadsafe(self, fn, *args):
            self.wakeups += 1
            fn(*args)

    model, config = SERVED["ar"]
    decoder = build_decoder(offline_backbone(model), config)
    prompts = [chat_ids(model, q) for q in QUERIES[:4]]
    loop, got, ended = Loop(), [[] for _ in prompts], threading.Semaphore(0)

    def put(i):
        def put_event(event):
            got[i].append(event)
            if event[0] != "commit":
                ended.release()
        return put_event

    engine = Engine(decoder, max_batch=4, max_queue=4)
    for i, p in enumerate(prompts):
        engine.submit(Job(p, decoder, None, time.perf_counter() + 60, LoopSink(loop, put(i))))
    calls = decoder.backbone.nfe
    engine.start()
    for _ in prompts:
        assert ended.acquire(timeout=60)
    engine.stop()
    calls = decoder.backbone.nfe - calls
    for p, events in zip(prompts, got):
        want = offline(model, config, p)
        assert events[-1] == ("end", want) and [t for e in events[:-1] for t in e[1]] == want
    assert sum(len(events) for events in got) > 2 * calls  # a commit per job and step
    assert loop.wakeups <= calls + 1


# ---------------------------------------------------------------- refusion serve --engine process


def endless_process(**settings):
    """An ar server in process mode whose model never ends a text: a decode runs its whole max_tokens."""
    return start(*SERVED["ar"], process=True, load=endless_backbone, **settings)


def metrics_of(url: str) -> dict[str, float]:
    return parse_metrics(raw(url, "GET", "/metrics")[1].decode())


def wait_until(check, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def open_stream(url: str, max_tokens: int = 480) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": SERVED["ar"][0], "prompt": "1 + 2 =", "stream": True, "max_tokens": max_tokens}),
        headers={"Content-Type": "application/json"})
    return conn


def test_a_hang_up_cancels_the_decode_in_the_engine_process_and_429_504_are_answered():
    srv = endless_process(max_batch=1, max_queue=0, request_timeout_s=5.0)
    try:
        engine = srv.state.engine
        assert engine.process.is_alive() and engine.process.pid != os.getpid()
        conn = open_stream(srv.url)
        response = conn.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event: the decode is under way
        assert engine.counts() == (1, 0)
        got, answer = raw(srv.url, "POST", "/v1/completions",  # the batch (1) and queue (0) are full
                          json.dumps({"model": SERVED["ar"][0], "prompt": "1 =", "max_tokens": 4}).encode())
        assert got == 429 and "--max-queue" in json.loads(answer)["error"]["message"]
        conn.sock.close()
        conn.close()
        assert wait_until(lambda: engine.counts() == (0, 0))
        m = metrics_of(srv.url)
        assert m['refusion_cancelled_total{reason="disconnect"}'] == 1
        assert 0 < m["refusion_generation_tokens_total"] < 480  # it stopped early, counted in the engine process
        assert m["refusion_engine_cpu_seconds_total"] > 0 and m["refusion_forward_calls_total"] > 0
        got, answer = raw(srv.url, "POST", "/v1/completions",  # over its timeout: 504, from the engine process
                          json.dumps({"model": SERVED["ar"][0], "prompt": "1 + 2 =", "max_tokens": 100000}).encode())
        assert got in (400, 504)
        if got == 400:  # beyond the model's positions: checked in the HTTP process, naming the field
            assert "max_tokens" in json.loads(answer)["error"]["message"]
    finally:
        srv.stop()
    assert not srv.state.engine.process.is_alive()


def test_a_request_over_its_timeout_gets_a_504_from_the_engine_process():
    srv = endless_process(request_timeout_s=0.3)
    try:
        got, answer = raw(srv.url, "POST", "/v1/completions",
                          json.dumps({"model": SERVED["ar"][0], "prompt": "1 + 2 =", "max_tokens": 480}).encode())
        assert got == 504 and "timed out" in json.loads(answer)["error"]["message"]
        assert wait_until(lambda: srv.state.engine.counts() == (0, 0))
    finally:
        srv.stop()


def test_the_engine_process_dying_fails_open_requests_with_500_and_new_ones_with_503(capfd):
    srv = endless_process()
    try:
        engine = srv.state.engine
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(c.completions.create, model=SERVED["ar"][0], prompt="1 + 2 =", max_tokens=480)
            conn = open_stream(srv.url)
            response = conn.getresponse()
            response.fp.readline()  # the stream's first event: both decodes are under way
            assert wait_until(lambda: engine.counts() == (2, 0))
            os.kill(engine.process.pid, signal.SIGKILL)
            with pytest.raises(openai.InternalServerError, match="engine process"):
                whole.result()
        rest = []  # the stream's raw chunked bytes, line by line, up to its error event
        while not rest or ('"error"' not in rest[-1] and rest[-1]):
            rest.append(response.fp.readline().decode())
        assert '"code": 500' in rest[-1] and "engine process" in rest[-1]
        assert not any("[DONE]" in line for line in rest)
        conn.close()
        got, answer = raw(srv.url, "POST", "/v1/completions",
                          json.dumps({"model": SERVED["ar"][0], "prompt": "1 =", "max_tokens": 4}).encode())
        assert got == 503 and "engine" in json.loads(answer)["error"]["message"]
        assert raw(srv.url, "GET", "/health")[0] == 503
        assert raw(srv.url, "GET", "/metrics")[0] == 200  # the HTTP process's own metrics still answer
    finally:
        srv.stop()
    assert f"the engine process (pid {engine.process.pid}) died" in capfd.readouterr().err


def test_metrics_of_two_processes_add_up():
    http_side, engine_side = server_metrics(), server_metrics()
    http_side.inc("refusion_requests_total", endpoint="chat", status="200")
    http_side.observe("refusion_time_to_first_token_seconds", 0.02)
    engine_side.inc("refusion_forward_calls_total", 7)
    engine_side.set("refusion_batch_size", 3)
    engine_side.observe("refusion_time_to_first_token_seconds", 0.3)
    engine_side.observe("refusion_queue_seconds", 0.001)
    both = http_side.merged(engine_side.snapshot())
    assert both.value("refusion_requests_total", endpoint="chat", status="200") == 1
    assert both.value("refusion_forward_calls_total") == 7 and both.value("refusion_batch_size") == 3
    assert both.value("refusion_time_to_first_token_seconds") == 2 and both.value("refusion_queue_seconds") == 1
    text = parse_metrics(both.render(resident=5, cpu_s=2.5))
    assert text["process_resident_memory_bytes"] == 5 and text["process_cpu_seconds_total"] == 2.5
    assert text['refusion_time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert text['refusion_time_to_first_token_seconds_bucket{le="0.5"}'] == 2
    assert http_side.value("refusion_forward_calls_total") == 0  # merged is a copy
    assert isinstance(engine_side.snapshot()["refusion_queue_seconds"][()], Histogram)
