"""The server's Prometheus metrics: counters, gauges and histograms, written in the Prometheus text format
(version 0.0.4) for ``GET /metrics``. Thread-safe: the engine thread and the event loop both record."""

from __future__ import annotations

import bisect
import os
import time
import threading

#: seconds: the buckets of every latency histogram
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: sequences per model call
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f"{name}_bucket{_labels({**labels, 'le': le})} {running}")
        out.append(f"{name}_sum{_labels(labels)} {self.sum!r}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class Metrics:
    """Named metrics, each with help text, a type and one value (or histogram) per label set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self._values: dict[str, dict[tuple, float | Histogram]] = {}
        self._buckets: dict[str, tuple[float, ...]] = {}

    def declare(self, name: str, kind: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self._meta[name] = (kind, help_text)
        self._values.setdefault(name, {})
        if kind == "histogram":
            self._buckets[name] = buckets

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._values[name]
            if key not in series:
                series[key] = Histogram(self._buckets[name])
            series[key].observe(value)

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value (0 when never recorded); a histogram's count."""
        with self._lock:
            v = self._values[name].get(tuple(sorted(labels.items())), 0)
            return v.count if isinstance(v, Histogram) else v

    def snapshot(self) -> dict[str, dict[tuple, float | Histogram]]:
        """Every series' value, histograms copied (picklable): what :meth:`merged` adds in another process."""
        with self._lock:
            out: dict[str, dict[tuple, float | Histogram]] = {}
            for name, series in self._values.items():
                out[name] = {}
                for key, v in series.items():
                    if isinstance(v, Histogram):
                        h = Histogram(v.buckets)
                        h.counts, h.sum, h.count = list(v.counts), v.sum, v.count
                        v = h
                    out[name][key] = v
            return out

    def merged(self, other: dict[str, dict[tuple, float | Histogram]]) -> "Metrics":
        """A copy of these metrics with ``other`` (another process's :meth:`snapshot`, of the same names) added:
        counters and gauges summed (a gauge is set by one of them), histograms bucket by bucket."""
        out = Metrics()
        out._meta, out._buckets = dict(self._meta), dict(self._buckets)
        out._values = self.snapshot()
        for name, series in other.items():
            mine = out._values.setdefault(name, {})
            for key, v in series.items():
                if isinstance(v, Histogram):
                    h = mine.setdefault(key, Histogram(v.buckets))
                    h.counts = [a + b for a, b in zip(h.counts, v.counts)]
                    h.sum += v.sum
                    h.count += v.count
                else:
                    mine[key] = mine.get(key, 0) + v
        return out

    def render(self, resident: int | None = None, cpu_s: float | None = None) -> str:
        """Every metric in the Prometheus text format, plus the server's resident memory and CPU time (default:
        this process's; a server of two processes gives both summed)."""
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_text) in self._meta.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                for key, v in sorted(self._values[name].items()):
                    labels = dict(key)
                    if isinstance(v, Histogram):
                        lines += v.lines(name, labels)
                    else:
                        lines.append(f"{name}{_labels(labels)} {v!r}")
        lines += ["# HELP process_resident_memory_bytes Resident memory size in bytes.",
                  "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {resident_bytes() if resident is None else resident}",
                  "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
                  "# TYPE process_cpu_seconds_total counter", f"process_cpu_seconds_total {time.process_time() if cpu_s is None else cpu_s}"]
        return "\n".join(lines) + "\n"


def resident_bytes() -> int:
    """This process's resident set size in bytes (Linux /proc; 0 where it is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` for every sample line (what ``loadtest`` reads)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def server_metrics() -> Metrics:
    """The metrics the server records (names and help in one place)."""
    m = Metrics()
    m.declare("refusion_requests_total", "counter", "Requests answered, by endpoint and HTTP status.")
    m.declare("refusion_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.")
    m.declare("refusion_generation_tokens_total", "counter", "Tokens committed (final output) by the engine.")
    m.declare("refusion_forward_calls_total", "counter", "Model forward calls of the engine.")
    m.declare("refusion_tokens_fed_total", "counter", "Tokens fed to the model by the engine's calls, padding "
              "included (rows x width, summed over calls).")
    m.declare("refusion_engine_cpu_seconds_total", "counter", "CPU time of the engine thread (the rest of "
              "process_cpu_seconds_total is the HTTP side's).")
    m.declare("refusion_cancelled_total", "counter", "Requests whose decode stopped early, by reason "
              "(disconnect, stop, timeout, shutdown).")
    m.declare("refusion_batch_size", "gauge", "Sequences in the running batch.")
    m.declare("refusion_queue_length", "gauge", "Requests waiting for admission.")
    m.declare("refusion_batch_size_per_call", "histogram", "Sequences in the running batch at each model call.",
              BATCH_BUCKETS)
    m.declare("refusion_queue_seconds", "histogram", "Time from arrival to admission into the batch.")
    m.declare("refusion_time_to_first_token_seconds", "histogram", "Time from arrival to the first final text.")
    m.declare("refusion_inter_token_seconds", "histogram", "Time between successive commits of a request.")
    m.declare("refusion_request_seconds", "histogram", "Time from arrival to the last token.")
    return m
