"""``--compile``: a backbone whose forwards run through torch.compile decodes the same token ids as the
eager one, alone and in a batch, with the decoders of each attention kind (tiny random models)."""

import pytest
import torch

from refusion.core.config import build_decoder
from refusion.models.backend import Backbone
from refusion.models.loading import cpp_compiler
from refusion.testing.models import make_tiny_qwen3

pytestmark = [pytest.mark.slow,  # about a minute: inductor compiles C++ kernels for each graph
              pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")]

CASES = [  # (model attention, decoder config)
    ("causal", {"decoder": "ar"}),
    ("causal", {"decoder": "refusion", "slot_size": 4}),
    ("bidirectional", {"decoder": "llada", "block_length": 8, "kv_cache": "dual"}),
    ("block_causal", {"decoder": "block"}),
]


@pytest.mark.parametrize("attention, config", CASES, ids=[c["decoder"] for _, c in CASES])
def test_compiled_forwards_decode_the_same_tokens(char_tokenizer, attention, config):
    model = make_tiny_qwen3(len(char_tokenizer), attention=attention)
    eager = Backbone(model, char_tokenizer)
    compiled = Backbone(model, char_tokenizer, compile="default")  # the same weights
    assert compiled._call is not model and compiled.compile == "default"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in (5, 9, 3)]
    cfg = {**config, "gen_length": 16}
    want, got = build_decoder(eager, cfg), build_decoder(compiled, cfg)
    assert [got.generate(p).token_ids for p in prompts] == [want.generate(p).token_ids for p in prompts]
    assert [r.token_ids for r in got.generate_batch(prompts)] == [r.token_ids for r in want.generate_batch(prompts)]
    assert compiled.nfe == eager.nfe  # the same forwards, counted the same way

