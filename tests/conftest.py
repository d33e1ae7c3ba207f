"""Shared fixtures: plugin autoload off, a tiny random Qwen3 with a character tokenizer that has a mask token."""

from __future__ import annotations

import os

if not os.environ.get("REFUSION_TEST_AUTOLOAD"):  # REFUSION_TEST_AUTOLOAD=1: installed plugins are checked too
    os.environ["REFUSION_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # before any registry is built

import pytest
import torch
from helpers import MICRO_SENTENCE, make_char_tokenizer, make_tiny_qwen3
from hypothesis import HealthCheck, settings
from transformers import PreTrainedTokenizerFast

from refusion.core.registry import set_registry
from refusion.models.backend import Backbone

torch.set_num_threads(int(os.environ.get("REFUSION_TEST_THREADS", "2")))  # 1 beside a training run

# Hypothesis profiles: `ci` (fast, derandomized; the default) and `thorough` (>= 1000 examples per
# property): HYPOTHESIS_PROFILE=thorough python -m pytest -m property  (see docs/reliability.md)
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=1000, derandomize=False, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fresh_registry():
    set_registry(None)
    yield
    set_registry(None)


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    return make_char_tokenizer()


@pytest.fixture
def backbone(char_tokenizer) -> Backbone:
    return Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer)


@pytest.fixture(scope="session")
def micro_refusion(tmp_path_factory):
    """A micro Qwen3 (~0.1M parameters) trained in seconds with the ReFusion objective on a toy task
    (query: 3-5 letters; response: a fixed sentence that ends by copying the query)."""
    import random

    from refusion.core.registry import build_registry, make_plugin_manager
    from refusion.models.build import build_model
    from refusion.training.trainer import TrainConfig, Trainer

    tok = make_char_tokenizer()
    rng = random.Random(0)
    pairs = []
    for _ in range(2000):
        q = "".join(rng.choice("abcde") for _ in range(rng.randint(3, 5)))
        pairs.append((tok.encode(q + "\n", add_special_tokens=False),
                      tok.encode(MICRO_SENTENCE + q + ".", add_special_tokens=False) + [tok.eos_token_id]))
    model = build_model(tok, size="micro", seed=0)
    objective = build_registry(make_plugin_manager(autoload=False)).get("objective", "refusion").from_tokenizer(tok)
    cfg = TrainConfig(steps=400, batch_size=32, lr=3e-3, progress=False, log_every=100, save_every=0, eval_every=0)
    Trainer(model, tok, objective, pairs, cfg, tmp_path_factory.mktemp("micro")).train()
    return Backbone(model.eval(), tok)

