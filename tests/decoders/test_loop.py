"""The loop protocol across every decoder: streamed commits are the output, left to right and final;
sequences admitted into a running batch decode as alone and leave no cache rows behind; a sampled
sequence of a batch draws what it draws alone."""

import pytest
import torch
from helpers import make_tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import build_decoder
from refusion.core.loop import Commit, run_loops
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache

#: decoder -> (attention of its model, settings drawn by the properties)
SETTINGS = {
    "ar": ("causal", [{}]),
    "refusion": ("causal", [{"slot_size": 4}, {"slot_size": 4, "serial_blocks": 2, "cache": "kv_recompute"},
                            {"slot_size": 4, "remasker": {"name": "sub_slot", "threshold": 0.3}}]),
    "llada": ("bidirectional", [{"block_length": 4, "steps": 8}, {"block_length": 4, "kv_cache": "prefix"},
                                {"block_length": 8, "kv_cache": "dual", "refresh_every": 2}]),
    "block": ("block_causal", [{}, {"pipeline": True, "pipeline_threshold": 0.25}, {"kv_cache": False}]),
    "speculative": ("causal", [{"k": 3}, {"k": 2, "schedule": "heuristic", "proposer": {"name": "ngram",
                                                                                      "max_matching_ngram_size": 1}},
                               {"k": 3, "temperature": 1.0}]),
}
CASES = [(name, s) for name, (_, settings) in SETTINGS.items() for s in settings]


@pytest.fixture(scope="module")
def backbones(char_tokenizer) -> dict[str, Backbone]:
    out = {}
    for attention in ("causal", "bidirectional", "block_causal"):
        model = make_tiny_qwen3(len(char_tokenizer))
        model.config.refusion_attention = attention
        model.config.refusion_block_size = 4
        out[attention] = Backbone(model, char_tokenizer)
    return out


def decoder(backbones, name, setting, **extra):
    bb = backbones[SETTINGS[name][0]]
    return build_decoder(bb, {"decoder": name, "gen_length": 16, **setting, **extra})


def prompts_of(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]


def assert_commits_are_the_output(commits: list[Commit], prompt_len: int, output: list[int]) -> None:
    """Concatenated, the commits are the output; their positions run on from the prompt, never repeat."""
    positions = [p for c in commits for p in c.positions]
    assert positions == list(range(prompt_len, prompt_len + len(output)))
    assert [t for c in commits for t in c.token_ids] == output
    assert all(len(c.positions) == len(c.token_ids) > 0 for c in commits)


@pytest.mark.property
@given(case=st.sampled_from(CASES), lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       seed=st.integers(0, 1000))
def test_streamed_commits_are_the_final_output(backbones, case, lengths, seed):
    name, setting = case
    dec = decoder(backbones, name, setting)
    prompts = prompts_of(lengths, seed)
    for prompt in prompts:  # alone: Decoder.stream yields the commits, returns the result
        steps, commits = dec.stream(prompt), []
        while True:
            try:
                commits.append(next(steps))
            except StopIteration as stop:
                result = stop.value
                break
        assert_commits_are_the_output(commits, len(prompt), result.token_ids)
    seen: dict[int, list[Commit]] = {i: [] for i in range(len(prompts))}  # batched: one stream per prompt
    batch = dec.generate_batch(prompts, on_commit=lambda i, c: seen[i].append(c))
    for i, (prompt, result) in enumerate(zip(prompts, batch)):
        assert_commits_are_the_output(seen[i], len(prompt), result.token_ids)


def test_a_stream_commits_before_the_decode_ends(backbones):
    """Streaming is not a replay: the first commit comes while forwards are still to come."""
    dec = decoder(backbones, "llada", {"block_length": 4, "steps": 16})
    bb = backbones["bidirectional"]
    steps = dec.stream([5, 6, 7])
    nfe0 = bb.nfe
    first = next(steps)
    at_first = bb.nfe - nfe0
    result = None
    while result is None:
        try:
            next(steps)
        except StopIteration as stop:
            result = stop.value
    assert first.positions[0] == 3 and at_first < result.stats.nfe


@pytest.mark.property
@given(case=st.sampled_from(CASES), lengths=st.lists(st.integers(1, 9), min_size=2, max_size=5),
       arrivals=st.lists(st.integers(0, 12), min_size=5, max_size=5), seed=st.integers(0, 1000))
def test_sequences_admitted_mid_batch_decode_as_alone(backbones, case, lengths, arrivals, seed):
    """Continuous batching: the first prompt starts alone; each later one joins before the model call
    its arrival names (counted in calls of the running batch; at once when the batch has emptied). Each
    decodes to its tokens alone, and when the last one finishes the shared cache holds no rows."""
    name, setting = case
    dec = decoder(backbones, name, setting)
    bb = dec.backbone
    prompts = prompts_of(lengths, seed)
    alone = [dec.generate(p).token_ids for p in prompts]
    shared = RaggedCache(bb)
    due = sorted(zip(arrivals[: len(prompts) - 1], range(1, len(prompts))))
    calls = {"n": 0}

    def admit():
        calls["n"] += 1
        if due and not shared.lengths:  # the batch has emptied: the next arrival comes now
            due[0] = (0, due[0][1])
        ready = [i for at, i in due if at < calls["n"]]
        due[:] = [(at, i) for at, i in due if at >= calls["n"]]
        return [dec._loop(prompts[i], dec.new_generator(), shared.new_view()) for i in ready]

    order = [0] + [i for _, i in due]
    outputs = run_loops([dec._loop(prompts[0], dec.new_generator(), shared.new_view())], shared, admit=admit)
    assert [out.token_ids for out in outputs] == [alone[i] for i in order]
    assert shared.lengths == [] and shared.views == [] and shared.keys == []


@pytest.mark.parametrize("name,setting", [
    ("refusion", {"slot_size": 4, "drafter": {"name": "gumbel", "temperature": 1.0}}),
    ("llada", {"block_length": 4, "drafter": {"name": "gumbel", "temperature": 1.0}}),
    ("llada", {"block_length": 4, "remasking": "random"}),
    ("block", {"drafter": {"name": "gumbel", "temperature": 1.0}}),
])
def test_a_sampled_batch_draws_what_each_sequence_draws_alone(backbones, name, setting):
    dec = decoder(backbones, name, setting, seed=7)
    prompts = prompts_of([3, 7, 5], seed=1)
    alone = [dec.generate(p).token_ids for p in prompts]
    assert [r.token_ids for r in dec.generate_batch(prompts)] == alone
    greedy = decoder(backbones, name, {k: v for k, v in setting.items() if k in ("slot_size", "block_length")})
    assert alone != [greedy.generate(p).token_ids for p in prompts]  # sampling acts: the check can fail


def test_the_decoder_written_in_plugins_md_runs_alone_streamed_and_batched(backbones, tmp_path):
    """docs/plugins.md's "Writing a decoder" example, registered as a plugin: its batch decodes each
    prompt as alone (sampling included: each sequence has its own generator) and its stream is its output."""
    import re
    import types
    from pathlib import Path

    from refusion.core.registry import build_registry, make_plugin_manager, set_registry

    page = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    section = page.split("## Writing a decoder", 1)[1]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("sampled_decoder_example")
    exec(compile(source, "plugins.md", "exec"), module.__dict__)
    set_registry(build_registry(make_plugin_manager([module], autoload=False)))
    dec = build_decoder(backbones["causal"], {"decoder": "sampled", "gen_length": 12, "temperature": 2.0, "seed": 3})
    prompts = prompts_of([2, 6, 4], seed=5)
    alone = [dec.generate(p) for p in prompts]
    commits: dict[int, list[Commit]] = {i: [] for i in range(len(prompts))}
    batch = dec.generate_batch(prompts, on_commit=lambda i, c: commits[i].append(c))
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    for i, (prompt, result) in enumerate(zip(prompts, batch)):
        assert_commits_are_the_output(commits[i], len(prompt), result.token_ids)
    assert batch[0].stats.batch_nfe < sum(r.stats.nfe for r in alone)  # the batch shared its forwards
