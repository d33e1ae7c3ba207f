"""examples/refusion-plugin-example, installed as a user would: its entry point registers a scorer, a
verifier and an extender that `refusion plugins` lists and a decode uses; the example's own tests pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "refusion-plugin-example"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """The example installed into a folder of its own; the environment that sees it, with autoload on."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "REFUSION_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")])
    return env


def refusion(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "refusion.cli", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_refusion_plugins_lists_the_example_parts(installed):
    parts = {(e["kind"], e["name"]): e for e in json.loads(refusion(installed, "plugins", "--json"))}
    assert parts["scorer", "min_prob"]["class"] == "refusion_plugin_example.parts.MinProb"
    assert parts["verifier", "running_product"]["class"] == "refusion_plugin_example.parts.RunningProduct"
    assert parts["extender", "running_product"]["class"] == "refusion_plugin_example.parts.RunningProductExtender"
    assert "refusion-plugin-example" in parts["scorer", "min_prob"]["origin"]


def test_a_decode_uses_them_and_checks_their_options(installed):
    out = json.loads(refusion(installed, "generate", "--model", "tiny-refusion", "--decoder", "refusion",
                              "--set", "scorer=min_prob", "--set", "verifier=running_product",
                              "--set", "verifier.min_product=0.3", "--set", "extender=running_product",
                              "--set", "gen_length=16",
                              "--prompt", "What is 2 + 3?", "--json"))
    assert out["token_ids"] and out["stats"]["nfe"] >= 1
    bad = subprocess.run([sys.executable, "-m", "refusion.cli", "generate", "--model", "tiny-refusion", "--decoder", "refusion",
                          "--set", "verifier=running_product", "--set", "verifier.min_product=2",
                          "--prompt", "x"], env=installed, capture_output=True, text=True)
    assert bad.returncode == 2 and "min_product" in bad.stderr
    # the default extender takes its threshold from the verifier: one without a token_threshold needs another
    alone = subprocess.run([sys.executable, "-m", "refusion.cli", "generate", "--model", "tiny-refusion",
                            "--decoder", "refusion", "--set", "verifier=running_product", "--prompt", "x"],
                           env=installed, capture_output=True, text=True)
    assert alone.returncode == 2 and "extender.token_threshold" in alone.stderr


def test_the_examples_own_tests_pass(installed, monkeypatch):
    """Its tests check its parts with refusion.testing (REFUSION_CHECK_EXAMPLES keeps them short here). They
    run in this process, the installed example on the path and entry points loaded as an installed package
    is found (a pytest subprocess would spend most of its time importing torch and transformers again)."""
    import importlib.util

    from refusion.core.registry import build_registry, make_plugin_manager, set_registry

    monkeypatch.syspath_prepend(installed["PYTHONPATH"].split(os.pathsep)[0])
    monkeypatch.setenv("REFUSION_CHECK_EXAMPLES", "5")
    set_registry(build_registry(make_plugin_manager(autoload=True)))
    ran = []
    for path in sorted((EXAMPLE / "tests").glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"refusion_plugin_example_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in sorted(n for n in dir(module) if n.startswith("test_")):
            getattr(module, name)()
            ran.append(name)
    assert "test_the_decoders_keep_their_invariants_with_these_parts" in ran, ran  # check_decoder, with its parts


def test_check_plugin_runs_every_check_on_the_installed_parts(installed, monkeypatch, capsys):
    """`refusion check-plugin DIST` checks each part the distribution registered against its kind's contract
    and inside every decoder that takes it, with no test of the project naming them (in this process, the
    example's folder on the path and entry points loaded, as an installed package is found)."""
    from refusion.cli import main
    from refusion.core.registry import build_registry, make_plugin_manager, set_registry

    monkeypatch.syspath_prepend(installed["PYTHONPATH"].split(os.pathsep)[0])
    set_registry(build_registry(make_plugin_manager(autoload=True)))
    assert main(["check-plugin", "refusion-plugin-example", "--max-examples", "5"]) == 0
    out = capsys.readouterr().out
    for line in ("ok    scorer min_prob", "ok    verifier running_product", "ok    extender running_product",
                 "ok    decoder refusion with scorer min_prob", "ok    decoder llada with scorer min_prob",
                 "ok    decoder refusion with extender running_product"):
        assert line in out, out
    assert out.rstrip().endswith("checks passed for refusion-plugin-example"), out
