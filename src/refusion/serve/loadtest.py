"""``refusion loadtest``: concurrent streamed requests against a running server on this machine.

``concurrency`` client threads send ``requests`` chat completions in all (prompt i is the i-th of the
prompts, cycled; a tinybench task's by default, rendered by the server's chat template as ``refusion
bench`` renders them), streamed, and stop issuing when ``duration_limit`` seconds have passed. Each request
records its time to the first text (TTFT), the gaps between text chunks (ITL), its tokens and its ending.
A ``disconnect_fraction`` of the requests (every k-th) hangs up after its first chunk of text.

The report: throughput (completed tokens / wall time), TTFT and ITL p50 / p95 / p99, errors by kind, and
the delivery check: every request that was not hung up on ended exactly once (one finish_reason, one
``[DONE]``), response ids are unique, and the tokens of each stream's chunks are its whole output. From the
server's ``/metrics``: its resident memory over the run and whether its batch returned to empty. With
``check_offline``, each distinct prompt is decoded offline (``Decoder.generate``, the server's model and
decoder config from ``/v1/models``) and every response compared with it token by token.

Only loopback addresses are accepted: this is a tool for measuring a server on one's own machine.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from refusion.core.config import ConfigError
from refusion.experiments.stats import percentile
from refusion.serve.metrics import parse_metrics
from refusion.serve.net import is_loopback

#: the most requests one loadtest sends
MAX_REQUESTS = 100_000
#: the most the server's RSS may grow from the first half of a run to the second and still be "steady"
RSS_STEADY_GROWTH = 0.10


@dataclass
class Outcome:
    """One request's record."""

    index: int
    prompt: int  # index into the prompts
    status: str = "pending"  # ok, disconnected, http_<code>, error, incomplete (no single ending)
    response_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finishes: int = 0  # chunks with a finish_reason
    dones: int = 0  # [DONE] lines
    sent_at: float = 0.0
    first_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    ended_at: float = 0.0
    message: str = ""


class Client:
    """Plain HTTP/1.1 to the server (one connection per request, so a hang-up is a closed socket)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"--url: expected http://HOST:PORT, got {url!r}")
        if not is_loopback(parts.hostname):
            raise ConfigError(f"--url: {parts.hostname!r} is not a loopback address; loadtest measures a server "
                              "on this machine only (127.0.0.1, ::1, localhost)")
        self.host, self.port = parts.hostname, parts.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = self.connect(timeout)
        try:
            conn.request("GET", path, headers=self.headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"GET /metrics answered {status}: {body[:200]!r}")
        return parse_metrics(body.decode())

    def stream(self, body: dict[str, Any], outcome: Outcome, timeout: float, hang_up: bool) -> None:
        """Send one streamed chat completion and read its events into ``outcome``."""
        conn = self.connect(timeout)
        try:
            outcome.sent_at = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=self.headers)
            response = conn.getresponse()
            if response.status != 200:
                outcome.status = f"http_{response.status}"
                outcome.message = response.read()[:300].decode(errors="replace")
                return
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    outcome.dones += 1
                    continue
                event = json.loads(data)
                if "error" in event:
                    outcome.status, outcome.message = "error", event["error"].get("message", "")
                    return
                if event.get("id") not in outcome.response_ids:
                    outcome.response_ids.append(event.get("id"))
                outcome.token_ids += (event.get("refusion") or {}).get("token_ids", [])
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        now = time.perf_counter()
                        outcome.first_at = outcome.first_at or now
                        outcome.chunk_times.append(now)
                        outcome.text += piece
                    if choice.get("finish_reason") is not None:
                        outcome.finishes += 1
                if hang_up and outcome.first_at is not None:
                    outcome.status = "disconnected"
                    return
            outcome.status = "ok" if outcome.finishes == 1 and outcome.dones == 1 else "incomplete"
            if outcome.status == "incomplete":
                outcome.message = f"{outcome.finishes} finish_reason chunks and {outcome.dones} [DONE] lines"
        except (OSError, http.client.HTTPException, ValueError) as e:
            outcome.status, outcome.message = "error", f"{type(e).__name__}: {e}"
        finally:
            outcome.ended_at = time.perf_counter()
            conn.close()


def run_loadtest(url: str, prompts: list[str], concurrency: int, requests: int, duration_limit_s: float,
                 max_tokens: int | None = None, disconnect_fraction: float = 0.0, api_key: str | None = None,
                 model: str | None = None, check_offline: bool = False, settle_s: float = 30.0) -> dict[str, Any]:
    """Run the load (see the module docstring) -> the report."""
    if concurrency < 1:
        raise ConfigError(f"--concurrency: must be at least 1, got {concurrency}")
    if not 1 <= requests <= MAX_REQUESTS:
        raise ConfigError(f"--requests: must be 1 .. {MAX_REQUESTS}, got {requests}")
    if not 0 < duration_limit_s <= 24 * 3600:
        raise ConfigError(f"--duration-limit: must be more than 0 and at most a day, got {duration_limit_s}")
    if not 0 <= disconnect_fraction < 1:
        raise ConfigError(f"--disconnect-fraction: must be in [0, 1), got {disconnect_fraction}")
    if not prompts:
        raise ConfigError("--task/--prompt: no prompts")
    client = Client(url, api_key)
    status, body = client.get("/v1/models")
    if status != 200:
        raise ConfigError(f"--url: GET /v1/models answered {status}: {body[:200]!r}")
    card = json.loads(body)["data"][0]
    model = model or card["id"]
    every = round(1 / disconnect_fraction) if disconnect_fraction else 0
    outcomes = [Outcome(i, i % len(prompts)) for i in range(requests)]
    before = client.metrics()
    memory: list[tuple[float, float]] = []  # (seconds since start, resident bytes)
    start = time.perf_counter()
    deadline = start + duration_limit_s
    cursor = iter(outcomes)
    lock = threading.Lock()
    finished = threading.Event()

    def worker() -> None:
        while True:
            with lock:
                outcome = next(cursor, None)
            if outcome is None or time.perf_counter() > deadline:
                return
            body = {"model": model, "messages": [{"role": "user", "content": prompts[outcome.prompt]}],
                    "stream": True}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            hang_up = bool(every) and outcome.index % every == every - 1
            client.stream(body, outcome, max(1.0, deadline - time.perf_counter()), hang_up)

    def sample_memory() -> None:
        while not finished.wait(1.0):
            try:
                memory.append((time.perf_counter() - start, client.metrics().get("process_resident_memory_bytes", 0)))
            except (OSError, RuntimeError, http.client.HTTPException):
                pass

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    finished.set()
    sampler.join()
    settled_at = time.perf_counter()  # the batch returns to empty: hung-up requests leave it
    after = client.metrics()
    while (after.get("refusion_batch_size", 0) or after.get("refusion_queue_length", 0)) \
            and time.perf_counter() - settled_at < settle_s:
        time.sleep(0.1)
        after = client.metrics()
    return report(outcomes, wall, before, after, memory, time.perf_counter() - settled_at, prompts, card,
                  max_tokens, check_offline, concurrency)


def report(outcomes: list[Outcome], wall: float, before: dict, after: dict, memory: list, settle_s: float,
           prompts: list[str], card: dict, max_tokens: int | None, check_offline: bool, concurrency: int) -> dict:
    sent = [o for o in outcomes if o.status != "pending"]
    ok = [o for o in sent if o.status == "ok"]
    errors: dict[str, int] = {}
    for o in sent:
        if o.status not in ("ok", "disconnected"):
            errors[o.status] = errors.get(o.status, 0) + 1
    ids = [i for o in sent for i in o.response_ids]
    ttft = [o.first_at - o.sent_at for o in sent if o.first_at is not None]
    itl = [b - a for o in sent for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    tokens = sum(len(o.token_ids) for o in ok)

    def ms(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": 1000 * percentile(values, q) if values else None for q in (50, 95, 99)}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rss = [m for _, m in memory]
    half = len(rss) // 2
    out = {
        "requests": len(outcomes), "sent": len(sent), "completed": len(ok),
        "disconnected": sum(o.status == "disconnected" for o in sent), "not_sent": len(outcomes) - len(sent),
        "errors": errors, "concurrency": concurrency, "wall_s": wall, "completion_tokens": tokens,
        "chunks": sum(len(o.chunk_times) for o in sent),
        "tokens_per_s": tokens / wall if wall else 0.0, "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_ms": ms(ttft), "itl_ms": ms(itl),
        "delivery": {
            "each_completed_once": all(o.finishes == 1 and o.dones == 1 and len(o.response_ids) == 1 for o in ok),
            "unique_response_ids": len(ids) == len(set(ids)),
            "lost": errors.get("incomplete", 0),
        },
        "server": {
            "batch_size_after": after.get("refusion_batch_size"), "queue_after": after.get("refusion_queue_length"),
            "settle_s": settle_s,
            "rss_mb_first_half_max": max(rss[:half]) / 2**20 if half else None,
            "rss_mb_second_half_max": max(rss[half:]) / 2**20 if rss[half:] else None,
            "rss_mb_end": after.get("process_resident_memory_bytes", 0) / 2**20,
            "cancelled_disconnect": delta('refusion_cancelled_total{reason="disconnect"}'),
            "forward_calls": delta("refusion_forward_calls_total"),
            "tokens_fed": delta("refusion_tokens_fed_total"),
            "engine_cpu_s": delta("refusion_engine_cpu_seconds_total"),
            "cpu_s": delta("process_cpu_seconds_total"),  # the server's CPU time over the run
        },
    }
    if check_offline:
        out["offline"] = offline_check(ok + [o for o in sent if o.status == "disconnected"], prompts, card, max_tokens)
    return out


def offline_check(outcomes: list[Outcome], prompts: list[str], card: dict, max_tokens: int | None) -> dict:
    """Decode each distinct prompt with ``Decoder.generate`` (the server's model and decoder config, on the
    CPU) and compare: a completed response must equal it, a hung-up one must be a prefix of it."""
    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.models.tokenizer import encode_prompt

    ext = card.get("refusion") or {}
    if not ext.get("model_path"):
        raise ConfigError("--check-offline: the server does not say which model it serves (/v1/models)")
    backbone = Backbone.from_pretrained(ext["model_path"])
    config = dict(ext["decoder"])
    if max_tokens is not None:
        config["gen_length"] = max_tokens
    decoder = build_decoder(backbone, config)
    offline: dict[int, list[int]] = {}
    differ = []
    for o in outcomes:
        if o.prompt not in offline:
            offline[o.prompt] = decoder.generate(encode_prompt(backbone.tokenizer, prompts[o.prompt])).token_ids
        want = offline[o.prompt]
        same = o.token_ids == want if o.status == "ok" else o.token_ids == want[: len(o.token_ids)]
        if not same:
            differ.append(o.index)
    return {"compared": len(outcomes), "distinct_prompts": len(offline), "differ": len(differ),
            "differ_requests": differ[:20]}


def verdicts(r: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The serving goals checked on a report: (goal, met, the figures it rests on), each goal once."""
    d, srv = r["delivery"], r["server"]
    out = [
        ("0 errors", not r["errors"], f"errors {r['errors'] or 0}"),
        ("every request sent", r["not_sent"] == 0, f"{r['not_sent']} not sent within the duration limit"),
        ("nothing lost or duplicated",
         d["lost"] == 0 and d["each_completed_once"] and d["unique_response_ids"]
         and r["completed"] + r["disconnected"] == r["sent"],
         f"{r['completed']} completed once each + {r['disconnected']} hung up = {r['sent']} sent; lost {d['lost']}; "
         f"response ids unique {d['unique_response_ids']}"),
        ("batch returns to empty", srv["batch_size_after"] == 0 and srv["queue_after"] == 0,
         f"batch {srv['batch_size_after']}, queue {srv['queue_after']} {srv['settle_s']:.1f} s after the last "
         f"client; {srv['cancelled_disconnect']:.0f} decodes cancelled by a hang-up"),
    ]
    first, second = srv["rss_mb_first_half_max"], srv["rss_mb_second_half_max"]
    if first is not None and second is not None:
        out.append(("memory steady", second <= first * (1 + RSS_STEADY_GROWTH),
                    f"RSS max {first:.0f} MB in the first half of the run, {second:.0f} MB in the second "
                    f"(steady: at most {RSS_STEADY_GROWTH:.0%} more)"))
    if "offline" in r:
        o = r["offline"]
        out.append(("outputs identical to offline decodes",
                    o["differ"] == 0 and o["compared"] == r["completed"] + r["disconnected"],
                    f"{o['differ']} of {o['compared']} differ ({o['distinct_prompts']} distinct prompts; a hung-up "
                    "one compared as a prefix)"))
    return out


def task_prompts(task: str, split: str, limit: int) -> list[str]:
    from refusion.tasks import get_task

    try:
        return [ex.query for ex in get_task(task).examples(split, limit)]
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None


def format_report(r: dict[str, Any]) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"requests {r['requests']}: {r['completed']} completed, {r['disconnected']} hung up by the client, "
        f"{sum(r['errors'].values())} errors {r['errors'] or ''}, {r['not_sent']} not sent (time limit)",
        f"concurrency {r['concurrency']}, wall {r['wall_s']:.1f} s: {r['tokens_per_s']:.1f} tokens/s, "
        f"{r['requests_per_s']:.2f} requests/s",
        "TTFT ms p50/p95/p99: " + " / ".join(f(r["ttft_ms"][k]) for k in ("p50", "p95", "p99")),
        "ITL  ms p50/p95/p99: " + " / ".join(f(r["itl_ms"][k]) for k in ("p50", "p95", "p99")),
        f"delivery: each completed once {r['delivery']['each_completed_once']}, unique response ids "
        f"{r['delivery']['unique_response_ids']}, lost {r['delivery']['lost']}",
        f"server: batch size after {r['server']['batch_size_after']}, queue after {r['server']['queue_after']}, "
        f"RSS MB max first/second half {f(r['server']['rss_mb_first_half_max'])} / "
        f"{f(r['server']['rss_mb_second_half_max'])}, end {f(r['server']['rss_mb_end'])}",
    ]
    if "offline" in r:
        o = r["offline"]
        lines.append(f"offline check: {o['compared']} responses against {o['distinct_prompts']} offline decodes, "
                     f"{o['differ']} differ")
    lines += [f"{'MET' if met else 'NOT MET'}: {goal} ({why})" for goal, met, why in verdicts(r)]
    return "\n".join(lines)
