"""Fresh processes for tests, without paying the same heavy imports in each.

Tests that must see an import happen for the first time (verl loading its plugins when ``verl``
is imported, under different environment variables) run their check in a new process each
time. A new interpreter also pays torch's and Megatron's imports, ~10-15 s of CPU that has
nothing to do with the check. :class:`ForkServer` pays them once: a server process imports the
given third-party ``modules`` and nothing else, then forks one child per script. Each child
starts as a fresh ``python -c SCRIPT`` with the given environment would, as far as the script
can tell: ``os.environ`` is exactly the given one, ``sys.path`` is the interpreter's own with
the environment's ``PYTHONPATH`` in front (as a new interpreter builds it), a new ``__main__``,
its own stdout and stderr (a new interpreter's C-locale coercion, PEP 538, is not redone: give
the environment a locale); only the preloaded modules (and what they imported, and the few
standard-library modules the server itself uses) are already in ``sys.modules``. So only
modules that do not take part in the check may be preloaded.

The server keeps one thread (``OMP_NUM_THREADS=1``: no OpenMP or OpenBLAS workers), so a fork
never copies a lock held by another thread. CUDA does not survive a fork: the server asks torch
for devices through NVML only (``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and where a preload
initialised CUDA all the same (a GPU host), every script runs in a new interpreter instead
(:attr:`ForkServer.forks` says which). Children are for checks that do not need a GPU.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["ForkServer"]

_SERVER = r"""
import builtins, importlib, json, os, sys, traceback, types

def pythonpath(value):
    # As a new interpreter reads PYTHONPATH: each entry made absolute (an empty one is the folder
    # it starts in), each once.
    entries = []
    for entry in value.split(os.pathsep) if value else ():
        entry = os.path.abspath(entry)
        if entry not in entries:
            entries.append(entry)
    return entries


for name in sys.argv[1:]:
    importlib.import_module(name)
requests = os.fdopen(os.dup(0), "rb")
replies = os.fdopen(os.dup(1), "wb")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
own = pythonpath(os.environ.get("PYTHONPATH", ""))
base_path = [sys.path[0], *(p for p in sys.path[1:] if p not in own)]  # '' (python -c), the interpreter's folders
torch = sys.modules.get("torch")
cuda = bool(torch is not None and torch.cuda.is_initialized())
replies.write((json.dumps({"cuda_initialized": cuda}) + "\n").encode())
replies.flush()
for line in requests:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            requests.close()
            replies.close()
            os.environ.clear()
            os.environ.update(job["env"])
            os.chdir(job["cwd"])
            sys.path[:] = [base_path[0], *pythonpath(job["env"].get("PYTHONPATH", "")), *base_path[1:]]
            sys.argv = ["-c"]
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            sys.modules["__main__"] = main
            exec(compile(job["code"], "<string>", "exec"), main.__dict__)
            status = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                status = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    replies.write((json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status)}) + "\n").encode())
    replies.flush()
"""


class ForkServer:
    """A server process that has imported ``modules``; :meth:`run` forks a fresh child per script.

    Use it as a context manager (or call :meth:`close`). One script at a time. ``fork=False``
    (and a server whose imports initialised CUDA) runs each script in a new interpreter instead.
    """

    def __init__(self, modules: tuple[str, ...], *, start_timeout: float = 600.0, fork: bool = True) -> None:
        self.modules = tuple(modules)
        #: Whether scripts run in forks of the server (else each in a new interpreter).
        self.forks = False
        self._proc: subprocess.Popen | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="mcore_ppo_fork_server_")
        self._log = Path(self._folder.name) / "server.log"
        self._jobs = 0
        if not fork:
            return
        env = dict(os.environ)  # PYTHONPATH too: the modules may be found through it
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTORCH_NVML_BASED_CUDA_CHECK="1")
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, *self.modules],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        ready = self._reply(start_timeout)
        if not ready:
            self.close()
            raise RuntimeError(f"the fork server could not import {self.modules}:\n{self._log.read_text()[-3000:]}")
        self.forks = not json.loads(ready)["cuda_initialized"]
        if not self.forks:
            self.close()  # CUDA would be unusable in a fork

    def _reply(self, timeout: float) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired(["fork server", *self.modules], timeout)
        return self._proc.stdout.readline()

    def run(self, code: str, *, env: dict[str, str], cwd: str | Path = ".", timeout: float = 600.0):
        """``python -c code`` with exactly ``env`` in ``cwd``, as a fork of the server: a
        :class:`subprocess.CompletedProcess` with text stdout and stderr."""
        cwd = Path(cwd).resolve()
        if not self.forks:
            return subprocess.run(
                [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
            )
        assert self._proc is not None and self._proc.stdin is not None
        self._jobs += 1
        out = Path(self._folder.name) / f"job{self._jobs}.out"
        err = Path(self._folder.name) / f"job{self._jobs}.err"
        job = {"code": code, "env": dict(env), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self._proc.stdin.write((json.dumps(job) + "\n").encode())
        self._proc.stdin.flush()
        reply = self._reply(timeout)
        if not reply:
            raise RuntimeError(f"the fork server exited:\n{self._log.read_text()[-3000:]}")
        status = json.loads(reply)["returncode"]
        return subprocess.CompletedProcess(["python", "-c", code], status, out.read_text(), err.read_text())

    def close(self) -> None:
        """End the server and any child it is running (later scripts run in new interpreters)."""
        self.forks = False
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._folder.cleanup()
