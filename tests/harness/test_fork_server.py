"""mcore_ppo_testing.fork_server: each child starts as ``python -c`` with its environment would,
but for the modules the server preloaded."""

from __future__ import annotations

import json
import os
import sys

import pytest

from mcore_ppo_testing.fork_server import ForkServer

REPORT = """
import json, os, sys
main = sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__"))
print(json.dumps({
    "env": dict(os.environ), "path": sys.path, "cwd": os.getcwd(), "argv": sys.argv,
    "preloaded": "decimal" in sys.modules, "main": main,
}))
"""


@pytest.fixture(scope="module", params=[True, False], ids=["forked", "new-interpreter"])
def server(request):
    """A server that forks its children, and one that runs each in a new interpreter (its way
    where the preloads initialised CUDA): the same answers either way."""
    with ForkServer(("decimal",), fork=request.param) as running:
        assert running.forks == request.param
        yield running


def test_a_child_sees_exactly_its_environment_path_and_folder(server, tmp_path):
    # A locale named: a new interpreter without one would add LC_CTYPE (PEP 538), a fork does not.
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "PYTHONPATH": "/first:/second", "ONLY_HERE": "1"}
    done = server.run(REPORT, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["env"] == env
    assert seen["path"][:3] == ["", "/first", "/second"] and sys.prefix in " ".join(seen["path"][3:])
    assert seen["cwd"] == str(tmp_path.resolve()) and seen["argv"] == ["-c"]
    assert seen["preloaded"] == server.forks
    assert seen["main"] == ["json", "os", "sys"]  # a new __main__: nothing of the server's


def test_a_forked_child_sees_what_a_new_interpreter_sees(tmp_path):
    """The same script with the same environment (PYTHONPATH with a relative, an empty and a
    repeated entry), forked and in a new interpreter: the same report but for the preload."""
    pythonpath = os.pathsep.join(["rel", "", str(tmp_path / "x") + "/", "rel"])
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "PYTHONPATH": pythonpath, "ONLY_HERE": "1"}
    with ForkServer(("decimal",)) as forked, ForkServer(("decimal",), fork=False) as new:
        seen = [json.loads(s.run(REPORT, env=env, cwd=tmp_path).stdout) for s in (forked, new)]
    assert [s.pop("preloaded") for s in seen] == [True, False]
    assert seen[0] == seen[1]
    assert seen[0]["path"][1:4] == [str(tmp_path / "rel"), str(tmp_path), str(tmp_path / "x")], seen[0]["path"]


def test_children_do_not_share_what_they_import(server):
    first = server.run("import fractions, sys; print('fractions' in sys.modules)", env={})
    second = server.run("import sys; print('fractions' in sys.modules)", env={})
    assert (first.stdout, second.stdout) == ("True\n", "False\n"), (first, second)


def test_exit_status_and_output_as_python_c(server):
    done = server.run("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)", env={})
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    done = server.run("raise ValueError('boom')", env={})
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: boom"), done.stderr
    done = server.run("import sys; sys.exit('a message')", env={})
    assert (done.returncode, done.stderr) == (1, "a message\n")
    assert server.run("pass", env={}).returncode == 0
