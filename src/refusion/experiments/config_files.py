"""The shipped experiment configs: one tree, each file found by its name.

``experiments/configs/`` holds every experiment config the package ships, by kind::

    configs/bench/      bench configs (``refusion bench --config``, an ablation's ``bench_config:``)
    configs/ablations/  the paper's analyses (``refusion ablate``, ``refusion results``)
    configs/tuning/     validation-split grids that choose the bench's settings (``refusion.experiments.tune``)
    configs/research/   studies the docs cite (training and decoding comparisons on models they train)

File names are unique across the tree, so a config is named by its stem (``kv_cache``), its file name
(``kv_cache.yaml``) or a path whose file name is a shipped one (``src/refusion/experiments/configs/tuning/tune_bench.yaml``, where the grids
lived before): :func:`find_config` resolves a path that exists first, then the name.
"""

from __future__ import annotations

from pathlib import Path

from refusion.core.config import ConfigError

CONFIGS_DIR = Path(__file__).parent / "configs"
KINDS = ("bench", "ablations", "tuning", "research")


def shipped_configs(kind: str | None = None) -> dict[str, Path]:
    """Stem -> path of every shipped config (of ``kind`` only, when given), in name order."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    files = [f for k in ([kind] if kind else KINDS) for f in (CONFIGS_DIR / k).glob("*.yaml")]
    return {f.stem: f for f in sorted(files, key=lambda f: f.stem)}


def find_config(name_or_path: str | Path, kind: str | None = None, what: str = "config") -> Path:
    """The file ``name_or_path`` names: an existing path as given, else the shipped config of that stem or
    file name (of ``kind``, when given); a :class:`ConfigError` listing the shipped ones otherwise."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = shipped_configs(kind)
    stem = p.name.removesuffix(".yaml").removesuffix(".yml")
    if stem in shipped:
        return shipped[stem]
    raise ConfigError(f"{what} {str(name_or_path)!r} not found (shipped{f' {kind}' if kind else ''}: "
                      f"{', '.join(shipped)})")
