"""Load and save Hugging Face checkpoints from local folders (never from a hub).

A model folder holds ``config.json``, ``model.safetensors`` (or sharded safetensors) and the tokenizer
files. Names of shipped checkpoints (``tiny-ar``, ``tiny-refusion``, ...) resolve to folders inside the
installed package. Checkpoints are stored in bfloat16 and loaded in the dtype asked for (float32 on
CPU by default). ``trust_remote_code`` stays off unless the caller asks for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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


def load_pretrained(
    name_or_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a local folder or shipped name, in eval mode."""
    path = resolve_model_path(name_or_path)
    check_model_dir(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    return model.to(device).eval(), tokenizer


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
