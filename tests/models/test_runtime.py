"""Runtime options (device, dtype, attention implementation, device_map): defaults, loading, the errors
that name the option, and how commands and config files pass them on."""

import json

import pytest
import torch
import yaml

from refusion.cli import main
from refusion.models.tokenizer import encode_prompt
from refusion.core.config import ConfigError, build_decoder
from refusion.models import loading
from refusion.models.backend import Backbone
from refusion.models.checkpoint import load_model
from refusion.models.families import get_family
from refusion.models.loading import Runtime, RuntimeOptionError, RuntimeOptions, resolve_model_path


@pytest.fixture
def cuda_present(monkeypatch):
    """Pretend this machine has one CUDA device (nothing is moved there in the tests using it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def packages(monkeypatch, **present: bool) -> None:
    """Pretend the named packages are (not) installed; the others are looked up as usual."""
    real = loading._has_package
    monkeypatch.setattr(loading, "_has_package", lambda name: present.get(name, real(name)))


def ar_tokens(backbone: Backbone, prompt: str = "1+1", n: int = 8) -> list[int]:
    ids = encode_prompt(backbone.tokenizer, prompt)
    return build_decoder(backbone, {"decoder": "ar", "gen_length": n}).generate(ids).token_ids


# ------------------------------------------------------------------------------ defaults and loading
def test_defaults_on_cpu_are_float32_and_sdpa():
    rt = Runtime.resolve()
    assert (rt.device, rt.dtype, rt.attn_implementation, rt.device_map) == ("cpu", "float32", "sdpa", None)
    assert rt.torch_dtype == torch.float32
    bb = Backbone.from_pretrained("tiny-ar")
    assert bb.model.dtype == torch.float32 and bb.model.config._attn_implementation == "sdpa"
    assert bb.device == torch.device("cpu")


def test_defaults_on_cuda_are_bfloat16(cuda_present):
    assert Runtime.resolve(device="cuda").dtype == "bfloat16"
    assert Runtime.resolve(device="cuda:0", dtype=torch.float32).dtype == "float32"
    assert Runtime.resolve(device_map="auto").dtype == "bfloat16"  # a strategy places weights on the GPUs
    assert Runtime.resolve(device_map="cpu").dtype == "float32"


@pytest.mark.parametrize("given, name", [(torch.bfloat16, "bfloat16"), ("float16", "float16"),
                                         ("torch.float32", "float32"), (None, "float32")])
def test_dtype_as_torch_dtype_or_name(given, name):
    assert Runtime.resolve(dtype=given).dtype == name


def test_bfloat16_loads_and_decodes_on_cpu():
    bb = Backbone.from_pretrained("tiny-ar", dtype="bfloat16")
    assert bb.model.dtype == torch.bfloat16
    assert 0 < len(ar_tokens(bb)) <= 8


def test_eager_and_sdpa_give_the_same_greedy_ar_output():
    eager = Backbone.from_pretrained("tiny-ar", attn_implementation="eager")
    sdpa = Backbone.from_pretrained("tiny-ar", attn_implementation="sdpa")
    assert eager.model.config._attn_implementation == "eager"
    assert ar_tokens(eager, n=16) == ar_tokens(sdpa, n=16)


def test_device_map_auto_loads_and_decodes_on_cpu():
    bb = Backbone.from_pretrained("tiny-ar", device_map="auto")
    assert bb.device == torch.device("cpu") and 0 < len(ar_tokens(bb)) <= 8


def test_remote_code_keeps_its_own_attention_unless_one_is_asked_for():
    assert "attn_implementation" not in Runtime.resolve().from_pretrained_kwargs(remote_code=True)
    assert Runtime.resolve(attn_implementation="eager").from_pretrained_kwargs(remote_code=True)[
        "attn_implementation"] == "eager"
    kw = Runtime.resolve(device_map="auto").from_pretrained_kwargs()
    assert kw == {"dtype": torch.float32, "attn_implementation": "sdpa", "device_map": "auto"}


def test_load_pretrained_takes_the_runtime_options():
    model, _ = loading.load_pretrained("tiny-ar", dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager" and not model.training


# ---------------------------------------------------------------------------------------- errors
def test_flash_attention_without_flash_attn_names_the_option(monkeypatch, cuda_present):
    packages(monkeypatch, flash_attn=False)
    with pytest.raises(RuntimeOptionError) as e:
        Runtime.resolve(device="cuda", attn_implementation="flash_attention_2")
    assert str(e.value) == ("--attn-implementation flash_attention_2: the flash_attn package is not installed; "
                            "allowed here: sdpa, eager")
    assert e.value.option == "attn_implementation" and isinstance(e.value, ConfigError)


def test_flash_attention_needs_cuda_and_16_bit_weights(monkeypatch):
    packages(monkeypatch, flash_attn=True)
    with pytest.raises(RuntimeOptionError, match=r"^--attn-implementation flash_attention_2: .*CUDA only"):
        Runtime.resolve(attn_implementation="flash_attention_2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeOptionError,
                       match=r"bfloat16 only \(dtype float32\); use --dtype bfloat16, or one of: sdpa, eager$"):
        Runtime.resolve(device="cuda", dtype="float32", attn_implementation="flash_attention_2")
    rt = Runtime.resolve(device="cuda", attn_implementation="flash_attention_2")
    assert (rt.dtype, rt.attn_implementation) == ("bfloat16", "flash_attention_2")


def test_flash_attention_is_refused_for_families_with_4d_masks():
    rt = Runtime(device="cuda", dtype="bfloat16", attn_implementation="flash_attention_2")  # as resolved on a GPU
    with pytest.raises(RuntimeOptionError, match=r"--attn-implementation flash_attention_2: 'tiny-mdm' .*4D masks"):
        load_model(resolve_model_path("tiny-mdm"), get_family("tiny-mdm"), runtime=rt)


def test_cuda_when_unavailable_names_the_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeOptionError) as e:
        Runtime.resolve(device="cuda")
    assert str(e.value) == "--device cuda: CUDA is not available on this machine; allowed here: cpu"
    with pytest.raises(RuntimeOptionError, match="^--device-map cuda:0: CUDA is not available"):
        Runtime.resolve(device_map="cuda:0")


def test_missing_cuda_index_and_unknown_devices(cuda_present):
    with pytest.raises(RuntimeOptionError, match=r"^--device cuda:3: this machine has 1 CUDA device\(s\); .*cuda:0"):
        Runtime.resolve(device="cuda:3")
    with pytest.raises(RuntimeOptionError, match="^--device mps: not a device; allowed: cpu, cuda, cuda:N"):
        Runtime.resolve(device="mps")


def test_unknown_dtype_and_attention_list_the_allowed_ones():
    with pytest.raises(RuntimeOptionError, match="^--dtype float64: unknown dtype; allowed: float32, bfloat16, float16$"):
        Runtime.resolve(dtype="float64")
    with pytest.raises(RuntimeOptionError, match="^--dtype float64: "):
        Runtime.resolve(dtype=torch.float64)
    with pytest.raises(RuntimeOptionError, match="^--attn-implementation flash: unknown .*allowed here: sdpa, eager$"):
        Runtime.resolve(attn_implementation="flash")


def test_device_map_needs_accelerate_and_a_known_placement(monkeypatch):
    with pytest.raises(RuntimeOptionError, match=r"^--device-map everywhere: not a placement; allowed: auto, balanced"):
        Runtime.resolve(device_map="everywhere")
    packages(monkeypatch, accelerate=False)
    with pytest.raises(RuntimeOptionError, match=r"^--device-map auto: needs the accelerate package"):
        Runtime.resolve(device_map="auto")


# ------------------------------------------------------------------------ options, flags, configs
def test_options_override_and_flags():
    base = RuntimeOptions(device="cpu", dtype="float16")
    merged = base.override(RuntimeOptions(dtype="bfloat16", device_map={"": "cpu"}))
    assert merged == RuntimeOptions(device="cpu", dtype="bfloat16", device_map={"": "cpu"})
    assert merged.as_flags() == ["--device", "cpu", "--dtype", "bfloat16", "--device-map", '{"": "cpu"}']
    with pytest.raises(ValueError, match="dtypes"):
        RuntimeOptions(dtypes="float32")


def test_generate_with_runtime_flags(capsys):
    rc = main(["generate", "--model", "tiny-ar", "--decoder", "ar", "--prompt", "1+1", "--attn-implementation", "eager",
               "--dtype", "float32", "--device-map", '{"": "cpu"}', "--set", "gen_length=8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < len(out["token_ids"]) <= 8


@pytest.mark.parametrize("flags, message", [
    (["--dtype", "float64"], "--dtype float64: unknown dtype; allowed: float32, bfloat16, float16"),
    (["--attn-implementation", "flash_attention_2"], "--attn-implementation flash_attention_2: "),
    (["--device", "cuda:7"], "--device cuda:7: "),
    (["--device-map", "{not json"], "--device-map {not json: not a JSON mapping"),
])
def test_generate_with_a_bad_runtime_flag_exits_2_naming_it(capsys, flags, message):
    rc = main(["generate", "--model", "tiny-ar", "--decoder", "ar", "--prompt", "1+1", *flags])
    assert rc == 2 and message in capsys.readouterr().err


def test_train_offers_no_flash_attention(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--objective", "ar", "--out", str(tmp_path), "--attn-implementation", "flash_attention_2"])
    assert e.value.code == 2 and "--attn-implementation" in capsys.readouterr().err


def test_bench_config_runtime_is_checked_and_flags_override_it(tmp_path, monkeypatch):
    from refusion.experiments import bench

    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump({"models": {"ar": "tiny-ar"}, "runtime": {"dtype": "bfloat16", "devcie": "cpu"}}))
    with pytest.raises(ConfigError, match=r"runtime\.devcie"):
        bench.load_bench_config(path)
    path.write_text(yaml.safe_dump({"models": {"ar": "tiny-ar"}, "runtime": {"dtype": "bfloat16", "device": "cpu"}}))
    seen = {}

    def fake_evaluate(runs, tasks, split, limit, out, resume=False, runtime=None, desc="", shard=None, **kw):
        seen["runtime"] = runtime
        raise StopIteration

    monkeypatch.setattr(bench, "evaluate", fake_evaluate)
    with pytest.raises(StopIteration):
        bench.run_bench(["arith"], ["ar"], 1, tmp_path / "out", config=str(path),
                        runtime=RuntimeOptions(attn_implementation="eager"))
    assert seen["runtime"] == RuntimeOptions(device="cpu", dtype="bfloat16", attn_implementation="eager")


def test_ablation_runtime_over_the_bench_config_under_the_flags(tmp_path, monkeypatch):
    from refusion.experiments import ablate, results

    bench_cfg = tmp_path / "bench.yaml"
    bench_cfg.write_text(yaml.safe_dump({"models": {"ar": "tiny-ar"}, "runtime": {"dtype": "float16", "device": "cpu"}}))
    cfg = tmp_path / "a.yaml"
    spec = {"name": "a", "tasks": ["arith"], "limit": 1, "bench_config": str(bench_cfg),
            "runs": [{"label": "ar", "decoder": "ar"}], "runtime": {"dtype": "bfloat16", "attn_implementation": "eager"}}
    cfg.write_text(yaml.safe_dump({**spec, "runtime": {"dtype": "bfloat16", "attn": "eager"}}))
    with pytest.raises(ConfigError, match=r"runtime\.attn: Extra inputs"):
        ablate.load_ablation(cfg)
    cfg.write_text(yaml.safe_dump(spec))
    seen = {}

    def fake_evaluate(runs, tasks, split, limit, out, resume=False, runtime=None, desc="", shard=None, **kw):
        seen["runtime"] = runtime
        raise StopIteration

    monkeypatch.setattr(ablate, "evaluate", fake_evaluate)
    with pytest.raises(StopIteration):
        ablate.run_ablation(cfg, tmp_path / "out", runtime=RuntimeOptions(attn_implementation="sdpa"))
    assert seen["runtime"] == RuntimeOptions(device="cpu", dtype="bfloat16", attn_implementation="sdpa")
    cmd = results.ablation_command("kv_cache", tmp_path, None, False, RuntimeOptions(device="cuda", dtype="float16"))
    from refusion.core.workers import decode

    call = decode(json.loads((tmp_path / "call.json").read_text())["kwargs"])  # the worker's written settings
    assert cmd[-1] == str(tmp_path / "call.json") and call["runtime"] == RuntimeOptions(device="cuda", dtype="float16")


def test_lm_eval_model_args_take_the_runtime_options():
    pytest.importorskip("lm_eval")
    from refusion.eval.lm_eval_adapter import RefusionLM

    lm = RefusionLM(pretrained="tiny-ar", decoder="ar", gen_length=8, dtype="bfloat16", attn_implementation="eager",
                    device="cpu")
    assert lm.backbone.model.dtype == torch.bfloat16 and lm.backbone.model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeOptionError, match="^--dtype double: "):
        RefusionLM(pretrained="tiny-ar", decoder="ar", dtype="double", device="cpu")


# ------------------------------------------------------------------------------------ --compile
def test_compile_modes_are_checked_naming_the_option(monkeypatch):
    with pytest.raises(RuntimeOptionError) as e:
        Runtime.resolve(compile="fast")
    assert str(e.value) == ("--compile fast: unknown mode; allowed: default, reduce-overhead, max-autotune, "
                            "max-autotune-no-cudagraphs, aot") and e.value.option == "compile"
    with pytest.raises(RuntimeOptionError, match=r"^--compile reduce-overhead: .*CUDA only \(device cpu\); "
                                                 r"allowed here: default, max-autotune-no-cudagraphs, aot$"):
        Runtime.resolve(compile="reduce-overhead")
    monkeypatch.setattr(loading, "cpp_compiler", lambda: None)
    with pytest.raises(RuntimeOptionError, match=r"^--compile default: torch.compile on the CPU builds C\+\+ kernels "
                                                 r"and no compiler .* allowed here: no --compile$"):
        Runtime.resolve(compile="default")


def test_compile_on_cuda_allows_cuda_graphs_without_a_host_compiler(monkeypatch, cuda_present):
    monkeypatch.setattr(loading, "cpp_compiler", lambda: None)
    assert Runtime.resolve(device="cuda", compile="reduce-overhead").compile == "reduce-overhead"


def test_compile_is_left_out_of_the_serialised_runtime_when_off():
    """Runs recorded before the option keep their manifest keys; a compiled run's key differs."""
    assert "compile" not in Runtime.resolve().model_dump(mode="json")
    assert Runtime.resolve(compile="default").model_dump(mode="json")["compile"] == "default"
    assert RuntimeOptions(compile="default").as_flags() == ["--compile", "default"]


@pytest.mark.parametrize("flags, mode", [([], None), (["--compile"], "default"),
                                         (["--compile", "max-autotune-no-cudagraphs"], "max-autotune-no-cudagraphs")])
def test_compile_flag(flags, mode):
    import argparse

    p = argparse.ArgumentParser()
    loading.add_runtime_args(p)
    assert loading.runtime_from_args(p.parse_args(flags)).compile == mode


def test_generate_with_a_bad_compile_mode_exits_2_naming_it(capsys):
    rc = main(["generate", "--model", "tiny-ar", "--decoder", "ar", "--prompt", "1+1", "--compile", "fast"])
    assert rc == 2 and "--compile fast: unknown mode" in capsys.readouterr().err


@pytest.mark.skipif(loading.cpp_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_from_pretrained_compiles_and_a_drafter_model_follows_its_target():
    bb = Backbone.from_pretrained("tiny-ar", compile="default")
    assert bb.compile == "default" and bb._call is not bb.model  # compiled at the first forward
    dec = build_decoder(bb, {"decoder": "speculative", "k": 4, "proposer": {"name": "diffusion", "model": "tiny-block"},
                             "gen_length": 8})
    assert dec.proposer.draft.compile == "default"
    eager = Backbone.from_pretrained("tiny-ar")
    assert eager.compile is None and eager._call is eager.model
