"""The lm-evaluation-harness adapter: registration, model args, generate_until (until, max_gen_toks,
chat template), exact log-likelihoods for causal models (checked against the harness's own HF model),
the refusal for masked diffusion models, and a harness run end to end on tinybench."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_char_tokenizer

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from refusion.core.config import ConfigError  # noqa: E402
from refusion.eval.lm_eval_adapter import RefusionLM, cut_at_stop  # noqa: E402
from refusion.eval.tasks import write_lm_eval_tasks  # noqa: E402
from refusion.eval.tasks.utils import process_results  # noqa: E402
from refusion.models.build import build_model  # noqa: E402
from refusion.models.families import FamilyError  # noqa: E402
from refusion.models.loading import save_pretrained  # noqa: E402
from refusion.models.tokenizer import CHAT_TEMPLATE  # noqa: E402
from refusion.tasks import get_task  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random micro models saved in float32: a causal one (with a chat template) and a bidirectional one."""
    root = tmp_path_factory.mktemp("lm_eval_models")
    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    out = {}
    for name, attention in (("causal", "causal"), ("mdm", "bidirectional")):
        save_pretrained(build_model(tok, size="micro", attention=attention, seed=1), tok, root / name, dtype=torch.float32)
        out[name] = root / name
    return out


def gen(ctx: str, **kw) -> Instance:
    return Instance(request_type="generate_until", doc={}, arguments=(ctx, kw), idx=0)


def ll(ctx: str, cont: str) -> Instance:
    return Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)


def test_registered_next_to_the_builtin_models():
    assert get_model("refusion") is RefusionLM
    assert get_model("hf").__name__ == "HFLM"  # lm_eval.models was imported before registering


def test_model_args_string_with_one_config_file(models, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("decoder: refusion\ngen_length: 16\nslot_size: 4\nselector: {name: threshold, slot_threshold: 0.8}\n")
    lm = RefusionLM.create_from_arg_string(
        f"pretrained={models['causal']},config={cfg},serial_blocks=2",
        {"batch_size": 8, "max_batch_size": None, "device": "cpu"},
    )
    assert lm.config["decoder"] == "refusion" and lm.config["serial_blocks"] == 2 and lm.backbone.family == "tiny-causal"
    assert lm.rank == 0 and lm.world_size == 1 and lm.device == torch.device("cpu")
    with pytest.raises(ConfigError, match="slot_sizee"):
        RefusionLM(pretrained=models["causal"], config=str(cfg), slot_sizee=3)


def test_generate_until_honours_until_and_max_gen_toks(models):
    lm = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=24)
    [full] = lm.generate_until([gen("abc\n", until=[])])
    assert lm.records[-1]["gen_length"] == 24 and lm.records[-1]["generated_tokens"] <= 24
    [short] = lm.generate_until([gen("abc\n", until=[], max_gen_toks=5)])
    assert lm.records[-1]["generated_tokens"] <= 5 and full.startswith(short)
    stop = full[3:5]
    [cut] = lm.generate_until([gen("abc\n", until=["zzzz", stop])])
    assert cut == cut_at_stop(full, [stop]) and stop not in cut and len(cut) <= full.index(stop)
    lm_cfg = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=24, gen_length_from="config")
    assert lm_cfg.generate_until([gen("abc\n", until=[], max_gen_toks=5)]) == [full]


def test_request_length_invalid_for_the_config_decodes_longer_and_cuts_back(models):
    lm = RefusionLM(pretrained=models["causal"], decoder="refusion", gen_length=32, slot_size=4, serial_blocks=4)
    [text] = lm.generate_until([gen("abc\n", until=[], max_gen_toks=5)])  # 2 slots cannot form 4 blocks
    assert lm.decoder_for(5).options.gen_length == 13  # the smallest valid length: 4 slots
    assert len(lm.tokenizer.encode(text, add_special_tokens=False)) <= 5


def test_chat_template_properties(models):
    lm = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=4, warmup=1)
    assert lm.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi\n"
    assert lm.chat_template() == CHAT_TEMPLATE and lm.tokenizer_name
    nfe = lm.backbone.nfe
    lm.generate_until([gen("hi\n", until=[])])
    assert lm.backbone.nfe - nfe == 2 * lm.records[-1]["nfe"]  # one untimed warm-up decode first


def test_loglikelihood_is_exact_and_matches_the_harness_hf_model(models):
    from lm_eval.models.huggingface import HFLM

    ours = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=4)
    hf = HFLM(pretrained=str(models["causal"]), device="cpu", dtype="float32", batch_size=1)
    reqs = [ll("the cat ", "sat"), ll("a", " b c"), ll("", "hello"), ll("x = 1", "\n")]
    rows, fed = ours.backbone.logits_rows, ours.backbone.tokens_in
    mine, theirs = ours.loglikelihood(reqs), hf.loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(mine, theirs):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    # only the continuation's rows go through the output head, never the context's
    continuation_tokens = sum(len(ours._encode_pair(*r.args)[1]) for r in reqs)
    assert ours.backbone.logits_rows - rows == continuation_tokens < ours.backbone.tokens_in - fed
    long = "the quick brown fox " * 40  # > max_length tokens: rolling windows
    ours.max_length = hf._max_length = 128
    roll = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(s,), idx=0) for s in ("abc de", long)]
    assert ours.loglikelihood_rolling(roll) == pytest.approx(hf.loglikelihood_rolling(roll), abs=1e-3)


def test_loglikelihood_in_batches_equals_one_request_at_a_time(models):
    one = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=4)
    batched = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=4, batch_size=3)
    reqs = [ll("the cat ", "sat"), ll("a", " b c"), ll("", "hello"), ll("x = 1", "\n"), ll("q", ""),
            ll("a much longer context than the others, " * 3, " ends here")]
    nfe = batched.backbone.nfe
    mine, want = batched.loglikelihood(reqs), one.loglikelihood(reqs)
    assert batched.backbone.nfe - nfe == 2  # 5 scored requests in chunks of 3, the empty continuation free
    assert mine[4] == (0.0, True)
    for (a, ga), (b, gb) in zip(mine, want):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    long = "the quick brown fox " * 40
    one.max_length = batched.max_length = 64
    roll = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(s,), idx=0) for s in ("abc de", long)]
    assert batched.loglikelihood_rolling(roll) == pytest.approx(one.loglikelihood_rolling(roll), abs=1e-3)


def test_loglikelihood_refused_for_masked_diffusion_models(models):
    lm = RefusionLM(pretrained=models["mdm"], gen_length=8)
    assert lm.config["decoder"] == "llada"  # the family's decoder by default
    with pytest.raises(NotImplementedError, match="Monte-Carlo"):
        lm.loglikelihood([ll("a", "b")])
    with pytest.raises(FamilyError, match="serves: llada"):
        RefusionLM(pretrained=models["mdm"], decoder="refusion")


def test_tinybench_tasks_are_local_jsonl_with_absolute_paths_and_score_with_the_task(tmp_path):
    out = write_lm_eval_tasks(tmp_path / "t", n=3)
    for name in ("arith", "code", "facts"):
        spec = (out / f"tinybench_{name}.yaml").read_text()
        assert f"test: {out}/tinybench_{name}.jsonl" in spec and "output_type: generate_until" in spec
        docs = [json.loads(line) for line in (out / f"tinybench_{name}.jsonl").read_text().splitlines()]
        assert len(docs) == 3 and docs[0]["prompt"] == get_task(name).examples("test", 1)[0].query + "\n"
        assert process_results(docs[0], [docs[0]["response"]]) == {"acc": 1.0}
        assert process_results(docs[0], ["no idea"]) == {"acc": 0.0}


def test_refusion_eval_runs_the_harness_end_to_end(models, tmp_path, capsys):
    from refusion.cli import main

    out = tmp_path / "res.json"
    rc = main(["eval", "--model", str(models["causal"]), "--tasks", "tinybench_arith,tinybench_facts", "--limit", "2",
               "--decoder", "refusion", "--set", "gen_length=16", "--set", "slot_size=4", "--gen-length-from", "config",
               "--output", str(out),
               "--log-samples", "--tinybench-n", "4"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tinybench_arith" in printed and "decode statistics" in printed
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"tinybench_arith", "tinybench_facts"}
    assert 0.0 <= res["results"]["tinybench_facts"]["acc,none"] <= 1.0
    assert len(res["samples"]["tinybench_arith"]) == 2 and res["refusion"]["stats"]["requests"] == 4
    assert res["refusion"]["decoder_config"]["decoder"] == "refusion"
    manifest = res["refusion"]["manifest"]  # what produced the file: validated config, weights, threads
    assert manifest["command"] == "eval" and manifest["torch_threads"] == 1
    entry = manifest["runs"]["eval"]["tinybench_arith"]
    assert entry["config"]["slot_size"] == 4 and len(entry["weights_sha256"]) == 64


REFERENCE = {  # task config: (slot size, serial blocks, slot threshold, token threshold), refusion-algorithm.md
    "gsm8k_cot": (32, 4, 0.9, 0.4), "minerva_math": (32, 8, 0.8, 0.6), "mbpp": (32, 4, 0.9, 0.3),
    "humaneval_instruct": (32, 4, 0.9, 0.4), "gpqa": (8, 32, 0.8, 0.2), "arc_challenge_chat": (8, 64, 0.8, 0.1),
    "mmlu_pro": (16, 4, 0.9, 0.4),
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_shipped_task_configs_hold_the_reference_settings(name):
    from importlib.resources import files

    from refusion.core.config import load_config_file, validate_config

    _, opts, parts = validate_config(load_config_file(files("refusion.eval") / "configs" / f"{name}.yaml"))
    got = (opts.slot_size, opts.serial_blocks, parts["selector"].options.slot_threshold,
           parts["verifier"].options.token_threshold)
    assert got == REFERENCE[name] and opts.gen_length == 512 and parts["drafter"].options.temperature == 0.0


def test_long_context_is_left_truncated_to_fit(models):
    lm = RefusionLM(pretrained=models["causal"], decoder="refusion", gen_length=8, slot_size=4)
    [text] = lm.generate_until([gen("ab " * 400, until=[])])  # 1200 tokens > 512 positions
    rec = lm.records[-1]
    assert rec["prompt_tokens"] == lm.max_length - 8 and isinstance(text, str)


def test_batch_size_groups_requests_into_generate_batch_chunks_in_request_order(models, monkeypatch):
    """batch_size=2: requests of one gen_length share chunks of at most 2 (one generate_batch call each),
    and the texts come back in request order, each cut at its own stop strings."""
    from refusion.core import interfaces

    calls = []

    def spy(self, prompts):  # decodes each prompt alone: the chunking, not the batched loop, is under test
        calls.append((self.options.gen_length, len(prompts)))
        return [self.generate(p) for p in prompts]

    reqs = [gen("abc\n", until=[]), gen("b\n", until=[], max_gen_toks=5), gen("ca\n", until=[]),
            gen("dd\n", until=[], max_gen_toks=5), gen("e\n", until=[]), gen("abc\n", until=["zz"])]
    single = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=12)
    expected = single.generate_until(reqs)
    lm = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=12, batch_size="2")
    assert lm.batch_size == 2
    monkeypatch.setattr(interfaces.Decoder, "generate_batch", spy)
    assert lm.generate_until(reqs) == expected
    assert calls == [(12, 2), (12, 2), (5, 2)]  # requests 0, 2 | 4, 5 (gen_length 12) | 1, 3 (gen_length 5)
    assert [r["gen_length"] for r in lm.records] == [12, 12, 12, 12, 5, 5]
    assert all(r["batch_size"] == 2 and r["batch_samples"] == 2 for r in lm.records)
    assert "batch_size" not in single.records[0]


def test_batched_stats_are_aggregate_throughput_and_bad_batch_sizes_name_the_field(models):
    from refusion.eval.lm_eval_adapter import parse_batch_size

    lm = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=4)
    recs = [{"generated_tokens": 4, "nfe": 4, "wall_s": w, "batch_size": 2, "batch_samples": 2, "batch_wall_s": 1.0}
            for w in (0.5, 1.0)]
    stats = lm.summary(recs)
    assert stats["tokens_per_second"] == pytest.approx(8 / 1.0) and stats["latency_s_mean"] == pytest.approx(0.75)
    assert parse_batch_size(None) == 1 and parse_batch_size(3) == 3 and parse_batch_size("auto") == 1
    assert parse_batch_size("auto:4", max_batch_size=8) == 8
    for bad in (0, "x", -1, "2.5"):
        with pytest.raises(ConfigError, match="batch_size: must be a positive integer or 'auto'"):
            RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=4, batch_size=bad)
    with pytest.raises(ConfigError, match="max_batch_size"):
        parse_batch_size("auto", max_batch_size=0)


def test_the_speculative_decoder_generates_through_the_adapter_as_ar_does(models):
    """lm-eval with ``decoder=speculative`` (prompt lookup, alone and batched) returns AR greedy's text."""
    ar = RefusionLM(pretrained=models["causal"], decoder="ar", gen_length=16)
    spec = RefusionLM(pretrained=models["causal"], decoder="speculative", gen_length=16, k=3)
    batched = RefusionLM(pretrained=models["causal"], decoder="speculative", gen_length=16, k=3, batch_size=2)
    requests = [gen("abcabc\n", until=[]), gen("xyz xyz\n", until=[])]
    expected = ar.generate_until(requests)
    assert spec.generate_until(requests) == expected == batched.generate_until(requests)
    assert spec.records[-1]["verifications"] == spec.records[-1]["nfe"] and "acceptance_rate" in spec.records[-1]
