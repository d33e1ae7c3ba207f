"""Run untrusted Python (model completions) in a contained subprocess.

:func:`run_sandboxed` writes the code to ``main.py`` in a fresh temporary folder and runs it with
``python -I`` there, under several layers:

* resource limits set before ``exec`` (``RLIMIT_AS`` memory, ``RLIMIT_CPU``, ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE``, no core dumps), a wall-clock timeout that kills the whole process group, and
  output captured in files outside the folder (so ``RLIMIT_FSIZE`` caps it too);
* when running as root: a new, empty network namespace (``unshare(CLONE_NEWNET)``) and a switch to
  the user ``nobody`` (when the interpreter is usable by it), so the kernel enforces the process
  limit and file permissions;
* always: a prelude that makes network calls, process creation (fork, exec, spawn, subprocess,
  kill), ``ctypes``, and deleting, renaming or writing files outside the folder stop the program
  with ``blocked: <what>``.

It never raises for a bad program: the result says ``ok=False`` with a reason (``timeout``,
``memory``, ``output limit``, ``blocked: ...`` or ``error: <last stderr line>``).
"""

from __future__ import annotations

import ctypes
import math
import os
import pwd
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CLONE_NEWNET = 0x40000000
BLOCKED_EXIT = 86
MAX_OUTPUT_BYTES = 8 * 1024 * 1024  # RLIMIT_FSIZE: the most a program may print
KEEP_OUTPUT_CHARS = 65536  # the tail of stdout / stderr kept in the result
MAX_PROCESSES = 32  # RLIMIT_NPROC (enforced for non-root users only)
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded up front: the child between fork and exec only calls it

_PRELUDE = r'''
import builtins, io, os, posix, shutil, socket, _socket, sys
_ROOT = os.path.realpath(os.getcwd())
_ALLOWED = (_ROOT, "/dev/null")

def _block(what):
    try:
        sys.stdout.flush()
    finally:
        os.write(2, ("\nSANDBOX-BLOCKED: %s\n" % what).encode())
        os._exit(BLOCKED_EXIT)

def _check(what, path, dir_fd=None):
    if dir_fd is not None or isinstance(path, int):
        _block(what)
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    if not any(real == a or real.startswith(a.rstrip("/") + "/") for a in _ALLOWED):
        _block("%s outside the sandbox folder: %s" % (what, real))

def _guard_paths(name, n_paths):
    original = getattr(os, name)
    def wrapper(*args, **kwargs):
        paths = list(args[:n_paths]) + [kwargs[k] for k in ("path", "name", "src", "dst") if k in kwargs]
        for path in paths:
            _check("os." + name, path, kwargs.get("dir_fd", kwargs.get("src_dir_fd")))
        return original(*args, **kwargs)
    for module in (os, posix):
        if hasattr(module, name):
            setattr(module, name, wrapper)

for _name in ("remove", "unlink", "rmdir", "removedirs", "mkdir", "makedirs", "truncate", "chmod",
              "chown", "lchown", "utime", "mkfifo", "mknod"):
    if hasattr(os, _name):
        _guard_paths(_name, 1)
for _name in ("rename", "renames", "replace", "link", "symlink"):
    _guard_paths(_name, 2)

_real_rmtree = shutil.rmtree

def _rmtree(path, *args, **kwargs):
    _check("shutil.rmtree", path, kwargs.get("dir_fd"))
    return _real_rmtree(path, *args, **kwargs)

shutil.rmtree = _rmtree
_real_open, _real_os_open = io.open, os.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _open(file, mode="r", *args, **kwargs):
    if not isinstance(file, int) and any(c in mode for c in "wax+"):
        _check("open for writing", file)
    return _real_open(file, mode, *args, **kwargs)

def _os_open(path, flags, *args, **kwargs):
    if flags & _WRITE_FLAGS:
        _check("os.open for writing", path, kwargs.get("dir_fd"))
    return _real_os_open(path, flags, *args, **kwargs)

builtins.open = io.open = _open
os.open = posix.open = _os_open

def _blocker(what):
    def blocked(*args, **kwargs):
        _block(what)
    return blocked

for _name in ("fork", "forkpty", "vfork", "system", "popen", "kill", "killpg", "execv", "execve", "execl",
              "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle",
              "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "fexecve"):
    for _module in (os, posix):
        if hasattr(_module, _name):
            setattr(_module, _name, _blocker("process creation (os.%s)" % _name))

for _module in (socket, _socket):
    for _name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo", "gethostbyname",
                  "gethostbyname_ex", "gethostbyaddr"):
        if hasattr(_module, _name):
            setattr(_module, _name, _blocker("network (socket.%s)" % _name))
    _module.socket = type("socket", (_module.socket,), {"__init__": _blocker("network (socket.socket)")})

class _ImportBlocker:
    BLOCKED = {"ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "pty"}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            _block("import " + name)
        return None

for _name in _ImportBlocker.BLOCKED:
    sys.modules.pop(_name, None)
sys.meta_path.insert(0, _ImportBlocker())

with _real_open("main.py") as _f:
    _source = _f.read()
exec(compile(_source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
'''.replace("BLOCKED_EXIT", str(BLOCKED_EXIT))


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    reason: str  # "ok", "timeout", "memory", "output limit", "blocked: ...", "error: ..."
    stdout: str
    stderr: str


@dataclass(frozen=True)
class _Runner:
    python: str
    uid: int | None  # switch to this user (nobody) when set
    gid: int | None
    unshare_net: bool


def _unshare_net() -> bool:
    """Move the calling process into a new network namespace; False when not permitted."""
    if hasattr(os, "unshare"):
        try:
            os.unshare(os.CLONE_NEWNET)
            return True
        except OSError:
            return False
    return _LIBC.unshare(CLONE_NEWNET) == 0


def _limits(runner: _Runner, memory_mb: int, cpu_s: int) -> None:
    """preexec_fn: runs in the child between fork and exec."""
    if runner.unshare_net:
        _unshare_net()
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_OUTPUT_BYTES, MAX_OUTPUT_BYTES))
    resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if runner.uid is not None and runner.gid is not None:
        os.setgroups([])
        os.setgid(runner.gid)
        os.setuid(runner.uid)


@cache
def _runner() -> _Runner:
    """How to run: as root, probe a network namespace and an interpreter that ``nobody`` can run."""
    if os.geteuid() != 0:
        return _Runner(sys.executable, None, None, False)
    unshare_net = _probe_unshare()
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return _Runner(sys.executable, None, None, unshare_net)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        as_nobody = _Runner(python, nobody.pw_uid, nobody.pw_gid, unshare_net)
        try:
            done = subprocess.run([python, "-I", "-c", ""], preexec_fn=lambda: _limits(as_nobody, 512, 5),
                                  capture_output=True, timeout=30, cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return as_nobody
    return _Runner(sys.executable, None, None, unshare_net)


def _probe_unshare() -> bool:
    """Whether a child may create a network namespace (needs CAP_SYS_ADMIN)."""
    read = "import os; print(os.readlink('/proc/self/ns/net'))"
    done = subprocess.run([sys.executable, "-I", "-c", read], preexec_fn=_unshare_net, capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() != os.readlink("/proc/self/ns/net")


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - KEEP_OUTPUT_CHARS))
        return f.read().decode("utf-8", errors="replace")


def _reason(returncode: int, timed_out: bool, stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == BLOCKED_EXIT and last.startswith("SANDBOX-BLOCKED: "):
        return "blocked: " + last.removeprefix("SANDBOX-BLOCKED: ")
    if last.startswith("MemoryError"):
        return "memory"
    if returncode == -signal.SIGXFSZ or "[Errno 27] File too large" in last:  # Python ignores SIGXFSZ
        return "output limit"
    if returncode < 0:
        return f"error: killed by {signal.Signals(-returncode).name}"
    return f"error: {last or f'exit status {returncode}'}"


def run_sandboxed(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh folder under the limits above; never raises for bad code."""
    runner = _runner()
    with tempfile.TemporaryDirectory(prefix="refusion-sandbox-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        if runner.uid is not None:
            root.chmod(0o711)
            for path in (work, work / "main.py"):
                os.chown(path, runner.uid, runner.gid)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": str(work), "HOME": str(work)}
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [runner.python, "-I", "-c", _PRELUDE], cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=err, start_new_session=True,
                preexec_fn=lambda: _limits(runner, memory_mb, max(1, math.ceil(timeout_s))),
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        stdout, stderr = _tail(root / "stdout"), _tail(root / "stderr")
    reason = "ok" if proc.returncode == 0 and not timed_out else _reason(proc.returncode, timed_out, stderr)
    return SandboxResult(reason == "ok", reason, stdout, stderr)
