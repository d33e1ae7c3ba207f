import os
import socket
import sys

import pytest

from refusion.tasks import sandbox
from refusion.tasks.sandbox import MAX_PROCESSES, _runner, run_sandboxed


@pytest.fixture(params=["all layers", "prelude only"])
def layers(request, monkeypatch):
    """Run a test with every layer this machine allows, then as an unprivileged setup would (no
    namespace, no user switch), where the prelude alone must contain the program."""
    if request.param == "prelude only":
        monkeypatch.setattr(sandbox, "_runner", lambda: sandbox._Runner(sys.executable, None, None, False))


def test_a_correct_program_passes():
    result = run_sandboxed("def f(x):\n    return x + 1\n\nassert f(1) == 2\nprint('done')\n")
    assert result.ok and result.reason == "ok" and result.stdout == "done\n"


def test_errors_are_reported_not_raised():
    assert run_sandboxed("assert 1 == 2").reason == "error: AssertionError"
    assert run_sandboxed("def f(:\n    pass").reason.startswith("error: SyntaxError")
    assert run_sandboxed("import sys\nsys.exit(3)").reason == "error: exit status 3"


def test_endless_loop_times_out():
    result = run_sandboxed("while True:\n    pass\n", timeout_s=0.5)
    assert not result.ok and result.reason == "timeout"


def test_fork_bomb_is_contained(layers):
    result = run_sandboxed("import os\nwhile True:\n    os.fork()\n", timeout_s=2)
    assert not result.ok and result.reason.startswith("blocked: process creation")
    assert run_sandboxed("import subprocess\nsubprocess.run(['ls'])").reason == "blocked: import subprocess"


def test_memory_hog_is_contained(layers):
    result = run_sandboxed("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n", memory_mb=128)
    assert not result.ok and result.reason == "memory"


def test_network_access_is_blocked(layers):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
        result = run_sandboxed(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            server.accept()
    assert not result.ok and result.reason.startswith("blocked: network")


def test_files_outside_the_sandbox_cannot_be_deleted_or_written(layers, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    attempts = [
        f"import os\nos.remove({str(victim)!r})",
        f"import pathlib\npathlib.Path({str(victim)!r}).unlink()",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"open({str(victim)!r}, 'w').write('gone')",
        f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
    ]
    for code in attempts:
        result = run_sandboxed(code)
        assert not result.ok and result.reason.startswith("blocked: "), (code, result)
    assert victim.read_text() == "precious"


def test_files_inside_the_sandbox_folder_are_usable():
    code = "import os, tempfile\nopen('a.txt', 'w').write('x')\nos.remove('a.txt')\ntempfile.mkstemp()\n"
    assert run_sandboxed(code).ok


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and the user switch need root")
def test_os_level_layers_when_root():
    code = ("import os, resource\n"
            "print(os.getuid(), resource.getrlimit(resource.RLIMIT_NPROC)[0], os.readlink('/proc/self/ns/net'))\n")
    result = run_sandboxed(code)
    uid, nproc, netns = result.stdout.split()
    runner = _runner()
    assert int(nproc) == MAX_PROCESSES
    if runner.uid is not None:
        assert int(uid) == runner.uid != 0
    if runner.unshare_net:
        assert netns != os.readlink("/proc/self/ns/net")
