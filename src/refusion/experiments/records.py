"""Run records: the typed sample record and summary statistics, and append-only JSONL files of records.

:class:`SampleRecord` is one decoded sample as ``samples.jsonl`` stores it (one JSON object per line,
keys in :data:`SAMPLE_KEYS` order, then a decoder's own counts); :meth:`SampleRecord.from_dict` reads
every record written since the bench began (keys it does not know are kept in ``extra``, in order) and
:meth:`SampleRecord.to_dict` writes the same mapping back. The calculations every reader shares are
methods: the decode time a record accounts for (:meth:`~DecodeTiming.decode_share_s`, a chunk's wall
time shared by its samples), its forward time, the key that pairs two runs' records, and
:class:`Speed` / :meth:`SummaryStats.of`, the pooled statistics of a summary row (:class:`SummaryRow`,
:data:`SUMMARY_KEYS`).

A killed run leaves at most one torn last line; :func:`load_records` drops it with a warning, and a
resumed run skips every key already recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypedDict

#: the keys of a sample record, in the order a record is written (absent optional ones are left out)
SAMPLE_KEYS = ("run", "task", "idx", "seed", "decoder", "model", "config_key", "correct", "generated_tokens", "nfe",
               "wall_s", "batch_size", "batch", "batch_samples", "batch_wall_s", "forward_s", "batch_forward_s",
               "completion", "token_ids", "tokens_in")


@dataclass
class DecodeTiming:
    """What one decode cost: tokens generated, model forwards (NFE) and seconds; a decode in a chunk of
    several samples adds the chunk's size and wall time. The part of a record every speed figure reads (a
    bench sample, an lm-eval request)."""

    generated_tokens: int  # tokens generated (EOS and what follows it not counted)
    nfe: int  # model forward calls
    wall_s: float  # seconds: the decode's latency (in a chunk: from the chunk's start)
    batch_samples: int | None = None  # samples in the chunk it was decoded in (None: decoded alone)
    batch_wall_s: float | None = None  # seconds: the chunk's decode wall time
    forward_s: float | None = None  # seconds inside model forwards (recorded with time_forwards)
    batch_forward_s: float | None = None  # seconds inside model forwards, the chunk's

    def decode_share_s(self) -> float:
        """The decode wall time this record accounts for: its ``wall_s``, or for a record decoded in a chunk
        its equal share of the chunk's wall time (``batch_wall_s / batch_samples``), so that the shares of a
        chunk's records add up to the chunk's wall time."""
        return self.wall_s if self.batch_wall_s is None else self.batch_wall_s / self.batch_samples

    def forward_share_s(self) -> float | None:
        """The time in model forwards this record accounts for (None when forwards were not timed): its
        ``forward_s``, or its equal share of its chunk's ``batch_forward_s``."""
        return self.batch_forward_s / self.batch_samples if self.batch_forward_s is not None else self.forward_s


@dataclass
class SampleRecord(DecodeTiming):
    """One sample of one run on one task, as ``samples.jsonl`` holds it (:mod:`refusion.experiments.runner`)."""

    run: str = ""  # the run's label
    task: str = ""
    idx: int | None = None  # the sample's index in the task's split (None: a record from before records had one)
    seed: int | None = None  # the decode's seed, for runs repeated over seeds (None: the config's own)
    decoder: str = ""
    model: str = ""
    config_key: str | None = None  # the manifest entry that produced it (refusion.experiments.manifest)
    correct: bool = False
    batch_size: int | None = None  # the run's batch size, on a batched run's records
    batch: int | None = None  # index of its chunk's first sample
    completion: str = ""
    token_ids: list[int] = field(default_factory=list)  # [generated tokens]
    tokens_in: int | None = None  # tokens fed to the model, on records with a decoder's own counts
    extra: dict[str, Any] = field(default_factory=dict)  # a decoder's own counts; keys this class does not know

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SampleRecord":
        """The record a ``samples.jsonl`` line holds (written by any version of the runner)."""
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("generated_tokens", "nfe", "wall_s") if k not in data]
        if missing:
            raise ValueError(f"a sample record needs {', '.join(missing)}; this one has {', '.join(data)}")
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The mapping a ``samples.jsonl`` line holds: :data:`SAMPLE_KEYS` in order, an optional key only when
        set, then ``extra``."""
        optional = {"idx", "seed", "config_key", "batch_size", "batch", "batch_samples", "batch_wall_s", "forward_s",
                    "batch_forward_s", "tokens_in"}
        out = {k: getattr(self, k) for k in SAMPLE_KEYS if k not in optional or getattr(self, k) is not None}
        return {**out, **self.extra}

    @property
    def key(self) -> tuple[Any, Any]:
        """What pairs two runs' records: the sample and, for runs repeated over seeds, the seed."""
        return self.idx, self.seed


def sample_records(records: Iterable[Mapping[str, Any] | SampleRecord]) -> list[SampleRecord]:
    """``records`` as :class:`SampleRecord` (mappings read from a file are converted)."""
    return [r if isinstance(r, SampleRecord) else SampleRecord.from_dict(r) for r in records]


@dataclass(frozen=True)
class Speed:
    """Pooled speed of some decodes: ``tokens`` over ``decode_s`` (each record's
    :meth:`~DecodeTiming.decode_share_s`: for a batched run the aggregate throughput), forwards, latency."""

    n: int
    tokens: int
    nfe: int
    decode_s: float  # seconds: the decodes' wall time, a chunk counted once
    latency_s: float  # seconds: the per-sample latencies, summed

    @classmethod
    def of(cls, records: Sequence[DecodeTiming]) -> "Speed":
        return cls(len(records), sum(r.generated_tokens for r in records), sum(r.nfe for r in records),
                   sum(r.decode_share_s() for r in records), sum(r.wall_s for r in records))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0

    @property
    def tpf(self) -> float:
        """Tokens per forward."""
        return self.tokens / self.nfe if self.nfe else 0.0

    def means(self) -> dict[str, float]:
        """``tokens_per_second``, ``tpf``, ``nfe_mean``, ``latency_s_mean``, ``generated_tokens_mean``."""
        return {"tokens_per_second": self.tokens_per_second, "tpf": self.tpf, "nfe_mean": self.nfe / self.n,
                "latency_s_mean": self.latency_s / self.n, "generated_tokens_mean": self.tokens / self.n}


#: the statistics of a summary row (``results.json``), in order: samples; accuracy (a fraction); tokens/s
#: (total tokens / total decode seconds) and its per-sample median; tokens per forward; mean forwards; mean
#: latency (seconds); mean generated tokens
SUMMARY_KEYS = ("n", "accuracy", "tokens_per_second", "tokens_per_second_median", "tpf", "nfe_mean",
                "latency_s_mean", "generated_tokens_mean")


class SummaryRow(TypedDict, total=False):
    """One (run, task) row of ``results.json`` (:func:`refusion.experiments.runner.summarize`); a run's swept
    parameters are further keys, and a command adds its own (``speedup_vs_ar``, batch-bench's ``vs_batch_1``)."""

    run: str
    task: str
    decoder: str
    model: str
    n: int  # records pooled (samples x seeds)
    accuracy: float  # fraction correct, 0..1
    tokens_per_second: float  # total generated tokens / total decode seconds (batched: aggregate)
    tokens_per_second_median: float  # median over samples of tokens / latency
    tpf: float  # generated tokens per model forward
    nfe_mean: float  # forwards per sample
    latency_s_mean: float  # seconds per sample
    generated_tokens_mean: float
    seeds: int  # present for a run repeated over seeds
    batch_size: int  # present for a batched run
    speedup: float | None  # tokens/s over the baseline run's, on the samples both decoded
    accuracy_diff: dict[str, float]  # against the baseline, paired: value, low, high, p_value, n, discordant counts
    speedup_interval: list[float]  # [low, high], 95% paired bootstrap


@dataclass(frozen=True)
class SummaryStats:
    """The pooled statistics of one (run, task)'s records: the numbers of a summary row (:data:`SUMMARY_KEYS`)."""

    n: int
    accuracy: float
    speed: Speed
    tokens_per_second_median: float

    @classmethod
    def of(cls, records: Sequence[SampleRecord]) -> "SummaryStats":
        return cls(len(records), sum(r.correct for r in records) / len(records), Speed.of(records),
                   statistics.median(r.generated_tokens / r.wall_s for r in records))

    def row(self) -> dict[str, Any]:
        """The statistics as a summary row's keys, in :data:`SUMMARY_KEYS` order."""
        means = self.speed.means()
        return {"n": self.n, "accuracy": self.accuracy, "tokens_per_second": means["tokens_per_second"],
                "tokens_per_second_median": self.tokens_per_second_median,
                **{k: means[k] for k in ("tpf", "nfe_mean", "latency_s_mean", "generated_tokens_mean")}}


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (missing file -> []); a torn last line is dropped."""
    p = Path(path)
    if not p.is_file():
        return []
    lines = p.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                warnings.warn(f"{p}: dropped a torn last line (an interrupted write); it will be redone", stacklevel=2)
                _truncate_last_line(p)
            else:
                raise ValueError(f"{p}: line {i + 1} is not valid JSON; the file is corrupt") from None
    return out


def _truncate_last_line(p: Path) -> None:
    data = p.read_bytes().rstrip(b"\n")
    cut = data.rfind(b"\n")
    p.write_bytes(data[: cut + 1] if cut >= 0 else b"")


class RecordWriter:
    """Appends one JSON object per line, flushed and fsynced, so a crash loses at most the current one."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Replace the JSONL file at ``path`` with ``records`` (written to a temporary file, then renamed over it)."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(p)


def done_keys(records: Iterable[dict[str, Any]], fields: tuple[str, ...]) -> set[tuple]:
    return {tuple(r[f] for f in fields) for r in records}
