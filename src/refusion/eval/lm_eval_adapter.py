"""The lm-evaluation-harness model ``refusion``: any decoder of this project behind ``lm_eval.api.model.LM``.

::

    lm_eval.simple_evaluate(model=RefusionLM(pretrained="runs/m", config="gsm8k_cot.yaml"), tasks=[...])
    # or, after ``import refusion.eval.lm_eval_adapter``:  --model refusion
    #     --model_args pretrained=/path/model,config=/abs/gsm8k_cot.yaml,trust_remote_code=True

Model arguments (``model_args``; the harness also passes ``batch_size``, ``max_batch_size``, ``device``):

- ``pretrained``: model folder or shipped checkpoint name (or ``backbone=`` a ready
  :class:`~refusion.models.backend.Backbone`);
- ``config``: ONE decoder config file (YAML/TOML, as ``refusion generate --config``), so that nested
  values never meet the harness's comma-splitting parser; ``decoder=`` names a decoder instead; any other
  keyword is a decoder option (``slot_size=32``) validated by that decoder; default decoder: the first
  one the model's family serves;
- ``family``, ``trust_remote_code``; ``device`` (default: cuda when available), ``dtype`` (``float32`` |
  ``bfloat16`` | ``float16``; default bfloat16 on CUDA, float32 on the CPU), ``attn_implementation``
  (``sdpa`` | ``eager`` | ``flash_attention_2``), ``device_map`` (``auto``, ...: one process spread over
  several GPUs; not with several processes), ``compile`` (a ``torch.compile`` mode), checked as :class:`~refusion.models.loading.Runtime` says;
- ``gen_length_from``: ``task`` (default: a request's ``max_gen_toks`` is the decoder's ``gen_length``,
  the config's ``gen_length`` when the task gives none) or ``config`` (always the config's ``gen_length``:
  what the ReFusion reference evaluation did);
- ``warmup``: untimed decodes before the first timed one (default 1 on CUDA, 0 on CPU);
- ``stats_path``: append one JSON line of decode statistics per request (per rank: ``{rank}`` in the
  path is replaced).

``generate_until`` decodes the requests in chunks of ``batch_size`` (default 1: one request at a time,
in request order) through ``Decoder.generate_batch``; a chunk holds requests with the same decoder
config (the same ``gen_length``), in request order within each length, and the results return in
request order. ``batch_size='auto'`` (the harness's memory probe) is read as ``max_batch_size`` (1 when
not given). Each text is cut at the request's first ``until`` string, and each request records tokens /
NFE / time (in a chunk: its latency from the chunk's start, and the chunk's size and wall time, so that
:meth:`RefusionLM.summary`'s tokens/s is the aggregate throughput).
When a request's length makes the config invalid (``serial_blocks`` must divide the slot count, ...),
the smallest valid ``gen_length`` above it is used and the output cut back to the request's length.

``loglikelihood`` / ``loglikelihood_rolling`` are exact for causal models (ReFusion, Qwen3, the tiny
causal models): one forward of context + continuation, the sum of the continuation tokens' log-probs
from the full softmax, and whether each was the argmax. Requests (and rolling windows) go in chunks of
``batch_size``, longest first, left-padded so that every row's continuation ends the row: only the
chunk's last ``max k`` positions go through the output head. Masked diffusion models (bidirectional /
block-causal attention) would need Monte-Carlo estimates (LLaDA's ``mc_num``), not implemented here:
they raise ``NotImplementedError`` saying so.

Data parallelism: under ``accelerate launch`` / ``torchrun`` (``WORLD_SIZE`` > 1) the adapter joins the
process group through ``accelerate``'s ``PartialState`` (gloo on CPU, NCCL on CUDA, one GPU per rank),
and implements ``all_gather`` / ``gather_object`` / ``barrier`` with ``torch.distributed``; the harness
then strides the documents over the ranks and gathers the metrics on rank 0.

Why one module of about 480 lines: the harness loads the model class by this module's name, and its
three request types (generate_until, loglikelihood, loglikelihood_rolling) share the batching, padding and
stats helpers here.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

import lm_eval.models  # noqa: F401  (built-in models first: get_model() skips it once the registry is non-empty)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from refusion.core import host
from refusion.core.config import ConfigError, build_decoder, load_config_file, validate_config

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k")


#: how long a rank waits at a collective: as lm-eval's own HF model (``InitProcessGroupKwargs(timeout=
#: timedelta(weeks=52))``), since ranks wait on each other at the harness's barriers while the slowest
#: finishes its share of a long generative task (torch's default, 10 minutes for NCCL, kills such runs)
PROCESS_GROUP_TIMEOUT = timedelta(weeks=52)


def distributed_world(cpu: bool) -> tuple[int, int, Any]:
    """``(rank, world_size, state)``: joins the process group through accelerate, with the
    :data:`PROCESS_GROUP_TIMEOUT` timeout, when launched with several processes (``WORLD_SIZE`` > 1:
    ``accelerate launch`` / ``torchrun``); ``state`` is accelerate's ``PartialState`` (gloo when ``cpu``,
    else NCCL) or None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        state = PartialState(cpu=cpu, timeout=PROCESS_GROUP_TIMEOUT)
        if state.num_processes > 1:
            return state.process_index, state.num_processes, state
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return torch.distributed.get_rank(), torch.distributed.get_world_size(), None
    return 0, 1, None


def parse_batch_size(batch_size: int | str | None, max_batch_size: int | str | None = None) -> int:
    """The harness's ``batch_size`` (an integer, its text, ``auto`` or ``auto:N``; None: 1) as a number of
    requests per chunk; ``auto`` is ``max_batch_size`` (1 when not given): there is no memory probe."""
    def number(value: Any, field: str) -> int:
        text = str(value).strip()
        if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
            raise ConfigError(f"{field}: must be a positive integer or 'auto', got {value!r}")
        return int(text)

    if batch_size is None:
        return 1
    if isinstance(batch_size, str) and batch_size.strip().lower().startswith("auto"):
        n = number(max_batch_size, "max_batch_size") if max_batch_size is not None else 1
        log.warning("batch_size=%s: this adapter does not probe memory; decoding %d request(s) per chunk "
                    "(set max_batch_size or a number)", batch_size, n)
        return n
    return number(batch_size, "batch_size")


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to (not including) the first occurrence of any stop string."""
    cut = len(text)
    for stop in until:
        if stop:
            i = text.find(stop)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


@register_model("refusion")
class RefusionLM(LM):
    """lm-eval model backed by a :class:`~refusion.models.backend.Backbone` and one decoder config."""

    def __init__(
        self,
        pretrained: str | None = None,
        config: str | dict | None = None,
        decoder: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        attn_implementation: str | None = None,
        device_map: str | dict | None = None,
        compile: str | None = None,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        trust_remote_code: bool = False,
        family: str | None = None,
        gen_length_from: str = "task",
        warmup: int | None = None,
        stats_path: str | None = None,
        max_length: int | None = None,
        backbone: Any = None,
        **decoder_options: Any,
    ) -> None:
        super().__init__()
        from refusion.models.backend import Backbone
        from refusion.models.families import get_family
        from refusion.models.loading import Runtime

        if gen_length_from not in ("task", "config"):
            raise ConfigError(f"gen_length_from must be 'task' or 'config', got {gen_length_from!r}")
        chunk = parse_batch_size(batch_size, max_batch_size)  # a bad value fails before a model loads
        want = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if backbone is None:  # an unknown or unavailable option fails before joining a process group
            Runtime.resolve(device=want, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map,
                            compile=compile)
        self._rank, self._world_size, self._state = distributed_world(cpu=not want.startswith("cuda"))
        if self._world_size > 1 and device_map is not None:
            raise ConfigError(f"device_map={device_map!r} spreads one model over several devices; with "
                              f"{self._world_size} processes each rank runs on its own GPU: drop device_map")
        if self._world_size > 1 and want.startswith("cuda"):
            want = f"cuda:{int(os.environ.get('LOCAL_RANK', self._rank))}"  # one GPU per rank
            torch.cuda.set_device(torch.device(want))
        self._device = torch.device(want)

        cfg: dict[str, Any] = {}
        if isinstance(config, dict):
            cfg = dict(config)
        elif config:
            cfg = load_config_file(config)
        if decoder:
            if cfg.get("decoder", decoder) != decoder:
                raise ConfigError(f"decoder={decoder!r} contradicts decoder {cfg['decoder']!r} in {config}")
            cfg["decoder"] = decoder
        cfg.update(decoder_options)  # flat decoder options given as model args (validated by the decoder)

        if backbone is None:
            if not pretrained:
                raise ConfigError("model_args: give pretrained=<model folder>")
            if cfg.get("decoder"):
                validate_config(cfg)  # fail on a bad config before loading a model
            backbone = Backbone.from_pretrained(
                pretrained, device=str(self._device), dtype=dtype, attn_implementation=attn_implementation,
                device_map=device_map, trust_remote_code=bool(trust_remote_code), family=family, compile=compile,
            )
            if device_map is not None:
                self._device = backbone.device  # where the inputs go: the embeddings' device
        self.backbone = backbone
        self.tokenizer = backbone.tokenizer
        fam = get_family(backbone.family) if backbone.family else None
        if not cfg.get("decoder"):
            if fam is None:
                raise ConfigError("no decoder: give config=FILE with a `decoder:` key or decoder=NAME")
            cfg["decoder"] = fam.decoders[0]
        if fam is not None:
            fam.check_decoder(cfg["decoder"])
        self.config = cfg
        self.default_gen_length = int(validate_config(cfg)[1].gen_length)
        self._decoders: dict[int, Any] = {}
        self.decoder_for(self.default_gen_length)  # refuses a mismatched model now, before any forward
        self.gen_length_from = gen_length_from
        self.warmup = int(warmup) if warmup is not None else (1 if self._device.type == "cuda" else 0)
        self._warmed = False
        self.batch_size = chunk
        self.max_length = int(max_length) if max_length else backbone.max_positions
        self.stats_path = stats_path.replace("{rank}", str(self._rank)) if stats_path else None
        self.records: list[dict[str, Any]] = []  # one per generate_until request (this rank)
        self._warned_sampling = False

    # ------------------------------------------------------------------ harness plumbing
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "refusion").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            key = chat_template if isinstance(chat_template, str) else "default"
            template = template.get(key) or next(iter(template.values()), None)
        return template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"tokenizer {self.tokenizer_name!r} has no chat template; run without --apply_chat_template")
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks (dim 0; a scalar becomes one entry per rank)."""
        if self.world_size <= 1:
            return tensor
        t = tensor.reshape(1) if tensor.dim() == 0 else tensor
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, t.contiguous())
        return torch.cat(out)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, result, dst=dst)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Leave the process group together: every rank waits for the others, then tears it down. A rank
        that exited while rank 0 still wrote its results made rank 0 abort (SIGABRT) once in a CI run."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    # ------------------------------------------------------------------------- decoding
    def decoder_for(self, gen_length: int):
        """The decoder for ``gen_length`` tokens; when that length makes the config invalid, the one for the
        smallest valid length above it (the output is cut back by the caller)."""
        if gen_length in self._decoders:
            return self._decoders[gen_length]
        last: Exception | None = None
        for n in range(gen_length, 4 * gen_length + 4097):
            try:
                dec = build_decoder(self.backbone, {**self.config, "gen_length": n})
            except ConfigError as e:
                if n == gen_length:
                    last = e
                continue
            self._decoders[gen_length] = dec
            return dec
        raise ConfigError(f"no valid gen_length >= {gen_length} for this config: {last}")

    def _gen_length(self, gen_kwargs: dict[str, Any]) -> int:
        if self.gen_length_from == "task" and gen_kwargs.get("max_gen_toks"):
            return int(gen_kwargs["max_gen_toks"])
        return self.default_gen_length

    def _encode_context(self, context: str, gen_length: int) -> list[int]:
        ids = list(self.tokenizer.encode(context, add_special_tokens=False))
        room = self.max_length - gen_length
        if room < 1:
            raise ConfigError(f"gen_length {gen_length} leaves no room for a prompt in {self.max_length} positions")
        if len(ids) > room:
            log.warning("context of %d tokens left-truncated to %d (max_length %d - gen_length %d)",
                        len(ids), room, self.max_length, gen_length)
            ids = ids[-room:]
        return ids or [self.prefix_token_id]

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else min(self.backbone.eos_ids)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prepared = []  # per request: (context, gen_kwargs, until, gen_length, decoder, prompt ids)
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if not self._warned_sampling and any(gen_kwargs.get(k) for k in SAMPLING_KEYS):
                log.warning("sampling settings %s of the task are ignored: the decoder config decides",
                            {k: gen_kwargs[k] for k in SAMPLING_KEYS if k in gen_kwargs})
                self._warned_sampling = True
            gen_length = self._gen_length(gen_kwargs)
            decoder = self.decoder_for(gen_length)
            ids = self._encode_context(context, getattr(decoder.options, "padded_length", decoder.options.gen_length))
            prepared.append((context, gen_kwargs, until, gen_length, decoder, ids))
        size = self.batch_size
        if size == 1:  # one request at a time, in request order
            chunks = [[j] for j in range(len(prepared))]
        else:  # requests of one decoder config (one gen_length) share a chunk, in request order
            by_length: dict[int, list[int]] = {}
            for j, p in enumerate(prepared):
                by_length.setdefault(p[3], []).append(j)
            chunks = [js[c:c + size] for js in by_length.values() for c in range(0, len(js), size)]
        out: list[str] = [""] * len(prepared)
        with tqdm(total=len(prepared), desc="refusion generate_until", disable=disable_tqdm or self.rank != 0) as bar:
            for chunk in chunks:
                decoder = prepared[chunk[0]][4]
                prompts = [prepared[j][5] for j in chunk]
                if not self._warmed:
                    for _ in range(self.warmup):  # untimed: one-off costs (allocator, kernels) stay out of the stats
                        decoder.generate(prompts[0]) if size == 1 else decoder.generate_batch(prompts)
                    self._warmed = True
                results = [decoder.generate(prompts[0])] if size == 1 else decoder.generate_batch(prompts)
                batch: dict[str, Any] = {}
                if size > 1:
                    wall = results[0].stats.batch_wall_s
                    batch = {"batch_size": size, "batch_samples": len(chunk),
                             "batch_wall_s": wall if wall is not None else sum(r.stats.wall_s for r in results)}
                for j, result in zip(chunk, results):
                    context, gen_kwargs, until, gen_length, _, ids = prepared[j]
                    tokens = result.token_ids[:gen_length]
                    text = result.text if len(tokens) == len(result.token_ids) else \
                        self.tokenizer.decode(tokens, skip_special_tokens=True)
                    text = cut_at_stop(text, until)
                    s = result.stats
                    self._record({"prompt_tokens": len(ids), "generated_tokens": s.generated_tokens, "nfe": s.nfe,
                                  "wall_s": s.wall_s, "gen_length": gen_length, **batch, **(s.extra or {})})
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                    out[j] = text
                bar.update(len(chunk))
        return out

    def _record(self, rec: dict[str, Any]) -> None:
        rec = {"rank": self.rank, **rec}
        self.records.append(rec)
        if self.stats_path:
            Path(self.stats_path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.stats_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def summary(self, records: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Tokens/s (total tokens / total decode time: a chunk of requests counts its wall time once, so
        this is the aggregate throughput), TPF (tokens / forwards), mean NFE and mean per-request latency."""
        rs = self.records if records is None else records
        if not rs:
            return {}
        from dataclasses import fields

        from refusion.experiments.records import DecodeTiming, Speed

        names = {f.name for f in fields(DecodeTiming)}
        speed = Speed.of([DecodeTiming(**{k: v for k, v in r.items() if k in names}) for r in rs])
        return {"requests": len(rs), **speed.means()}

    # ---------------------------------------------------------------------- likelihoods
    def _require_causal(self, what: str) -> None:
        bb = self.backbone
        if bb.attention != "causal" or bb.logits_shifted:
            raise NotImplementedError(
                f"{what} is exact only for causal models; this model "
                f"({f'family {bb.family!r}, ' if bb.family else ''}{bb.attention} attention) is a masked diffusion "
                "model, whose likelihood needs a Monte-Carlo estimate over masking ratios (LLaDA's mc_num), "
                "which this adapter does not implement; evaluate it on generative tasks (output_type: generate_until)"
            )

    @torch.no_grad()
    def _continuation_logprobs(self, pairs: list[tuple[list[int], list[int]]], desc: str,
                               disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Per ``(context_ids, cont_ids)`` pair (``cont_ids`` not empty): the sum of log p(cont | context) over
        the continuation tokens and whether each was the argmax.

        Pairs go in chunks of ``batch_size``, longest first (so a chunk's rows pad little), each row
        left-padded: every row's continuation then ends the row, and ``logits_to_keep`` = the chunk's
        longest continuation sends only those rows through the output head, never the contexts'. Position
        ids count each row's real tokens from 0, so a row computes what it computes alone. One host read
        per chunk."""
        rows = []  # per pair: its fed tokens (context + continuation without the last token) and kept targets
        for context_ids, cont_ids in pairs:
            whole = (context_ids + cont_ids)[-(self.max_length + 1):]
            k = min(len(cont_ids), len(whole) - 1)  # a continuation longer than the window keeps its last tokens
            rows.append((whole[:-1], cont_ids[-k:]))
        order = sorted(range(len(rows)), key=lambda j: -len(rows[j][0]))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        model, size = self.backbone.model, self.batch_size
        with tqdm(total=len(rows), desc=desc, disable=disable_tqdm or self.rank != 0) as bar:
            for c in range(0, len(order), size):
                chunk = order[c:c + size]
                n = max(len(rows[j][0]) for j in chunk)
                k = max(len(rows[j][1]) for j in chunk)
                pad = [n - len(rows[j][0]) for j in chunk]
                ids = torch.tensor([[self.prefix_token_id] * p + rows[j][0] for p, j in zip(pad, chunk)])
                real = torch.tensor([[0] * p + [1] * (n - p) for p in pad])
                pos = (real.cumsum(-1) - 1).clamp(min=0)
                targets = torch.tensor([[0] * (k - len(rows[j][1])) + rows[j][1] for j in chunk])  # [b, k]
                scored = torch.tensor([[False] * (k - len(rows[j][1])) + [True] * len(rows[j][1]) for j in chunk])
                logits = model(input_ids=ids.to(self.device), position_ids=pos.to(self.device),
                               attention_mask=real.to(self.device), use_cache=False, logits_to_keep=k).logits
                self.backbone.nfe += 1
                self.backbone.tokens_in += int(real.sum())
                self.backbone.logits_rows += len(chunk) * k
                logp = F.log_softmax(logits[:, -k:].float(), dim=-1)  # [b, k, V]: row j predicts targets[:, j]
                targets, scored = targets.to(self.device), scored.to(self.device)
                token_logp = torch.where(scored, logp.gather(-1, targets[..., None]).squeeze(-1), 0.0)  # [b, k]
                greedy = ((logp.argmax(-1) == targets) | ~scored).all(-1)  # [b]
                sums, hits = host.to_host(token_logp.sum(-1), greedy)
                for j, ll, hit in zip(chunk, sums, hits):
                    out[j] = (float(ll), bool(hit))
                bar.update(len(chunk))
        return out

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The harness's convention: trailing spaces of the context move to the continuation; the
        continuation's tokens are those of ``context + continuation`` after the context's."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        enc = lambda s: list(self.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
        if not context:
            cont = enc(continuation)
            return [self.prefix_token_id], cont
        whole, ctx = enc(context + continuation), enc(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._require_causal("loglikelihood")
        pairs = [self._encode_pair(*req.args) for req in requests]
        scored = [j for j, (_, cont) in enumerate(pairs) if cont]  # an empty continuation scores (0.0, True)
        results = self._continuation_logprobs([pairs[j] for j in scored], "refusion loglikelihood", disable_tqdm)
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for j, res in zip(scored, results):
            out[j] = res
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", tuple(req.args), res)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        self._require_causal("loglikelihood_rolling")
        windows, owner = [], []  # every request's disjoint windows, scored together
        for j, req in enumerate(requests):
            (string,) = req.args
            tokens = list(self.tokenizer.encode(string, add_special_tokens=False))
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((list(ctx), list(cont)))
                owner.append(j)
        totals = [0.0] * len(requests)
        for j, (ll, _) in zip(owner, self._continuation_logprobs(windows, "refusion loglikelihood_rolling", disable_tqdm)):
            totals[j] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), total)
        return totals
