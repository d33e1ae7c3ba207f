"""Load and save Hugging Face checkpoints from local folders (never from a hub).

A model folder holds ``config.json``, ``model.safetensors`` (or sharded safetensors) and the tokenizer
files. Names of shipped checkpoints (``tiny-ar``, ``tiny-refusion``, ...) resolve to folders inside the
installed package. Checkpoints are stored in bfloat16 and loaded as :class:`Runtime` says (device,
dtype, attention implementation, ``device_map``). ``trust_remote_code`` stays off unless the caller asks for it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr, SerializerFunctionWrapHandler, model_serializer

from refusion.core.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """A model folder is missing, incomplete or unusable."""


def shipped_checkpoints() -> list[str]:
    """Names of the checkpoints shipped inside the package."""
    if not CHECKPOINTS_DIR.is_dir():
        return []
    return sorted(p.name for p in CHECKPOINTS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A local folder, or the folder of a shipped checkpoint called ``name_or_path``."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    shipped = CHECKPOINTS_DIR / str(name_or_path)
    if shipped.is_dir():
        return shipped
    names = ", ".join(shipped_checkpoints()) or "none installed"
    raise CheckpointError(
        f"model {str(name_or_path)!r} is neither a local folder nor a shipped checkpoint ({names}); "
        "models are loaded from local folders only (no hub downloads)"
    )


def check_model_dir(path: Path) -> None:
    """Raise :class:`CheckpointError` listing every file a model folder lacks."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("model.safetensors (weights must be safetensors)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json)")
    if missing:
        raise CheckpointError(f"model folder {str(path)!r} is incomplete: missing {', '.join(missing)}")


# ------------------------------------------------------------------------------ runtime options
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")
#: modes of ``--compile``: ``torch.compile``'s (``default``: inductor without CUDA graphs; the ``reduce-overhead``
#: and ``max-autotune`` modes add CUDA graphs, so they need CUDA) and ``aot``, the forward exported and compiled
#: ahead of time by AOTInductor (:mod:`refusion.models.aot`), on one device
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "aot")
AOT_MODE = "aot"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class RuntimeOptionError(ConfigError):
    """A runtime option that is unknown or not available on this machine. The message starts with the
    option as its command-line flag and the value (``--device cuda: ...``) and ends with what is allowed."""

    def __init__(self, option: str, value: Any, reason: str) -> None:
        self.option = option
        super().__init__(f"--{option.replace('_', '-')} {value}: {reason}")


def _has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _check_device(value: str, option: str = "device") -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, present on this machine; else a :class:`RuntimeOptionError`."""
    if value == "cpu":
        return value
    m = _CUDA_DEVICE.fullmatch(value)
    if m is None:
        raise RuntimeOptionError(option, value, "not a device; allowed: cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise RuntimeOptionError(option, value, "CUDA is not available on this machine; allowed here: cpu")
    count = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= count:
        raise RuntimeOptionError(option, value, f"this machine has {count} CUDA device(s); allowed here: cpu, cuda, "
                                                f"cuda:0..cuda:{count - 1}")
    return value


def _check_device_map(value: str | dict[str, Any]) -> str | dict[str, Any]:
    """A placement strategy, a device, or a mapping module name -> device; needs accelerate."""
    if not _has_package("accelerate"):
        raise RuntimeOptionError("device_map", value, "needs the accelerate package (pip install accelerate), which "
                                                      "is not installed; allowed here: no device map")
    if isinstance(value, dict):
        if not value:
            raise RuntimeOptionError("device_map", value, "an empty mapping; give module name -> device")
        return value
    if value in DEVICE_MAP_STRATEGIES:
        return value
    if value == "cpu" or _CUDA_DEVICE.fullmatch(value):
        return _check_device(value, "device_map")
    allowed = ", ".join(DEVICE_MAP_STRATEGIES)
    raise RuntimeOptionError("device_map", value, f"not a placement; allowed: {allowed}, a device (cpu, cuda, "
                                                  "cuda:N) or a JSON mapping of module name -> device")


def _map_uses_cuda(device_map: str | dict[str, Any]) -> bool:
    """Whether a device map puts weights on GPUs (a strategy does whenever CUDA is available)."""
    if isinstance(device_map, dict):
        return any(isinstance(v, int) or str(v).startswith("cuda") for v in device_map.values())
    if device_map in DEVICE_MAP_STRATEGIES:
        return torch.cuda.is_available()
    return device_map.startswith("cuda")


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call (``$CXX``, else ``g++``), when it is on the PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


def _check_compile(value: str, device: str, on_cuda: bool, device_map: Any = None) -> str:
    """A ``--compile`` mode this machine can run; else a :class:`RuntimeOptionError` naming ``--compile``."""
    if value not in COMPILE_MODES:
        raise RuntimeOptionError("compile", value, f"unknown mode; allowed: {', '.join(COMPILE_MODES)}")
    if value == AOT_MODE and device_map is not None:
        raise RuntimeOptionError("compile", value, "the ahead-of-time compiled forward runs a model on one device, "
                                                   "not spread by --device-map; allowed with --device-map: "
                                                   + ", ".join(m for m in COMPILE_MODES if m != AOT_MODE))
    here = [m for m in COMPILE_MODES if on_cuda or m not in CUDA_GRAPH_MODES]
    if value in CUDA_GRAPH_MODES and not on_cuda:
        raise RuntimeOptionError("compile", value, f"this mode records CUDA graphs, which run on CUDA only (device "
                                                   f"{device}); allowed here: {', '.join(here)}")
    if not on_cuda and cpp_compiler() is None:
        raise RuntimeOptionError("compile", value, f"torch.compile on the CPU builds C++ kernels and no compiler "
                                                   f"({os.environ.get('CXX') or 'g++'}; set $CXX) is on the PATH; "
                                                   "allowed here: no --compile")
    return value


def dtype_name(dtype: torch.dtype | str) -> str:
    """``float32`` / ``bfloat16`` / ``float16`` for a torch dtype or its name (``torch.`` prefix allowed)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise RuntimeOptionError("dtype", name, f"unknown dtype; allowed: {', '.join(DTYPES)}")
    return name


def attn_implementations_here(on_cuda: bool, dtype: str = "bfloat16") -> list[str]:
    """The attention implementations usable for weights on CUDA (``on_cuda``) or not, in ``dtype``."""
    fast = on_cuda and dtype != "float32" and _has_package("flash_attn")
    return ["sdpa", "eager"] + (["flash_attention_2"] if fast else [])


class Runtime(BaseModel):
    """Where and how a model runs: resolved and checked by :meth:`resolve`, never half-filled.

    - ``device``: ``cpu``, ``cuda`` or ``cuda:N``; the model is moved there unless ``device_map`` places it.
    - ``dtype``: weights' dtype; ``bfloat16`` when the weights go to CUDA, else ``float32``.
    - ``attn_implementation``: ``sdpa`` (default), ``eager``, or ``flash_attention_2`` (needs the
      ``flash_attn`` package, CUDA and float16 / bfloat16).
    - ``device_map``: accelerate's placement over several devices (``auto``, ``balanced``, ...,
      a device, or a mapping module name -> device), for models larger than one device; None: one device.
    - ``compile``: a ``--compile`` mode (:data:`COMPILE_MODES`: ``torch.compile``'s, or ``aot``) for the
      model's forward, or None (eager);
      left out of the serialised form when None, so records made before the option keep their keys.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    device_map: str | dict[str, Any] | None = None
    compile: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "aot"] | None = None
    _attn_requested: bool = PrivateAttr(default=False)

    @model_serializer(mode="wrap")
    def _without_eager_compile(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("compile", 0) is None:
            out.pop("compile")
        return out

    @classmethod
    def resolve(
        cls, device: str | torch.device | None = "cpu", dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None, device_map: str | dict[str, Any] | None = None,
        compile: str | None = None,
    ) -> "Runtime":
        """Fill the defaults and check every option against this machine; a :class:`RuntimeOptionError`
        names the first option that is unknown or unavailable and what is allowed. ``device`` None is cpu."""
        device = _check_device(str(device) if device is not None else "cpu")
        if device_map is not None:
            device_map = _check_device_map(device_map)
        on_cuda = _map_uses_cuda(device_map) if device_map is not None else device.startswith("cuda")
        name = dtype_name(dtype) if dtype is not None else ("bfloat16" if on_cuda else "float32")
        attn = attn_implementation or "sdpa"
        if attn not in ATTN_IMPLEMENTATIONS:
            raise RuntimeOptionError("attn_implementation", attn, "unknown attention implementation; allowed here: "
                                     + ", ".join(attn_implementations_here(on_cuda, name)))
        if attn == "flash_attention_2":
            where = ", ".join(attn_implementations_here(on_cuda, name))
            if not _has_package("flash_attn"):
                raise RuntimeOptionError("attn_implementation", attn,
                                         f"the flash_attn package is not installed; allowed here: {where}")
            if not on_cuda:
                raise RuntimeOptionError("attn_implementation", attn,
                                         f"flash attention runs on CUDA only (device {device}); allowed here: {where}")
            if name == "float32":
                raise RuntimeOptionError("attn_implementation", attn, "flash attention runs in float16 or bfloat16 "
                                         f"only (dtype float32); use --dtype bfloat16, or one of: {where}")
        if compile is not None:
            compile = _check_compile(str(compile), device, on_cuda, device_map)
        runtime = cls(device=device, dtype=name, attn_implementation=attn, device_map=device_map, compile=compile)
        runtime._attn_requested = attn_implementation is not None
        return runtime

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def from_pretrained_kwargs(self, remote_code: bool = False) -> dict[str, Any]:
        """Keyword arguments for transformers' ``from_pretrained``: ``dtype``, ``attn_implementation`` and,
        when set, ``device_map``. A model running its own code (``remote_code``) keeps the attention its
        code chooses unless one was asked for."""
        kw: dict[str, Any] = {"dtype": self.torch_dtype}
        if self._attn_requested or not remote_code:
            kw["attn_implementation"] = self.attn_implementation
        if self.device_map is not None:
            kw["device_map"] = self.device_map
        return kw

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` on ``device`` in eval mode (left where ``device_map`` put it when one is set)."""
        return (model if self.device_map is not None else model.to(self.device)).eval()


class RuntimeOptions(BaseModel):
    """Runtime options as asked for (a config's ``runtime:`` mapping, command-line flags); None: the
    default. :meth:`resolve` checks them (:class:`Runtime`)."""

    model_config = ConfigDict(extra="forbid")

    device: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = None
    device_map: str | dict[str, Any] | None = None
    compile: str | None = None

    def override(self, other: "RuntimeOptions | None") -> "RuntimeOptions":
        """These options with every option ``other`` sets replacing this one's."""
        if other is None:
            return self
        return self.model_copy(update=other.model_dump(exclude_none=True))

    def resolve(self) -> Runtime:
        return Runtime.resolve(**self.model_dump())

    def as_flags(self) -> list[str]:
        """The command-line flags that ask for these options (unset ones omitted)."""
        out: list[str] = []
        for key, value in self.model_dump(exclude_none=True).items():
            out += [f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, dict) else str(value)]
        return out


def add_runtime_args(p: argparse.ArgumentParser, device_help: str = "cpu, cuda or cuda:N (default cpu)") -> None:
    """Add ``--device``, ``--dtype``, ``--attn-implementation``, ``--device-map``, ``--compile`` to ``p`` (each
    default None: :class:`Runtime` fills it)."""
    p.add_argument("--device", default=None, help=device_help)
    p.add_argument("--dtype", default=None,
                   help=f"{', '.join(DTYPES)} (default: bfloat16 when the weights go to CUDA, else float32)")
    p.add_argument("--attn-implementation", default=None,
                   help="sdpa (default), eager, or flash_attention_2 (flash_attn package, CUDA, 16-bit dtype)")
    p.add_argument("--device-map", default=None,
                   help="spread a model over devices with accelerate: auto, balanced, balanced_low_0, sequential, "
                        "or a JSON mapping of module name -> device (default: the whole model on --device)")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="run the model forward through torch.compile: default (the mode without a value), "
                        "max-autotune-no-cudagraphs, or on CUDA reduce-overhead / max-autotune (CUDA graphs); aot: "
                        "exported and compiled ahead of time by AOTInductor (docs/profile.md); "
                        "needs a C++ compiler on the CPU (default: eager)")


def runtime_from_args(args: argparse.Namespace) -> RuntimeOptions:
    """The :class:`RuntimeOptions` of the flags :func:`add_runtime_args` added (``--device-map`` may be JSON)."""
    device_map = getattr(args, "device_map", None)
    if isinstance(device_map, str) and device_map.lstrip().startswith("{"):
        try:
            device_map = json.loads(device_map)
        except json.JSONDecodeError as e:
            raise RuntimeOptionError("device_map", device_map, f"not a JSON mapping ({e})") from None
    return RuntimeOptions(device=getattr(args, "device", None), dtype=getattr(args, "dtype", None),
                          attn_implementation=getattr(args, "attn_implementation", None), device_map=device_map,
                          compile=getattr(args, "compile", None))


def load_pretrained(
    name_or_path: str | os.PathLike,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    device_map: str | dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a local folder or shipped name, in eval mode, as
    :meth:`Runtime.resolve` makes of the options (float32 and sdpa on the CPU by default)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    runtime = Runtime.resolve(device=device, dtype=dtype, attn_implementation=attn_implementation,
                              device_map=device_map)
    path = resolve_model_path(name_or_path)
    check_model_dir(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, trust_remote_code=trust_remote_code, local_files_only=True,
        **runtime.from_pretrained_kwargs(remote_code=trust_remote_code),
    )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    return runtime.place(model), tokenizer


def save_pretrained(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files), weights in ``dtype``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu())
             for k, v in model.state_dict().items()}
    model.save_pretrained(out, state_dict=state, safe_serialization=True)  # the in-memory model is untouched
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")  # the stored weights' dtype, not the model's in memory
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tokenizer, out)
    return out


# Arguments of how a tokenizer was loaded, which transformers 5 writes into tokenizer_config.json on save;
# they describe the loading machine, not the tokenizer.
LOAD_TIME_KEYS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike) -> None:
    """``tokenizer.save_pretrained(out_dir)`` without the load-time keys in ``tokenizer_config.json``."""
    tokenizer.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if any(k in cfg for k in LOAD_TIME_KEYS):
            path.write_text(json.dumps({k: v for k, v in cfg.items() if k not in LOAD_TIME_KEYS}, indent=2) + "\n")
