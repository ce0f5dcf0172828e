"""Plain `pytest` runs the fast tests; `pytest --all` adds those marked slow (learning CartPole,
the whole stop and signal matrix, Pong and torchrun runs, play and plot on a trained run)."""

import json
import os
import pathlib
import re
import runpy
import signal
import socket
import subprocess
import sys
import types

import pytest
import torch

# The repository: pytest.ini puts it on sys.path, so that tests import the scripts.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKS = pathlib.Path(__file__).parent / "hooks"
# Two tests run at once (pytest.ini): their scripts compute on one thread each, as under torchrun.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The frames a CartPole run from seed 1 may take to solve: about twice the most any seed took in
# docs/RESULTS.md's records (DQN 78.3k, A3C 298k). A run can lose what it learned and learn it
# again: dqn_mp from seed 1, stopped and resumed, took over 50k frames in 2 of 15 tries (56.4k).
BUDGET = {
    "dqn_baseline": 150_000,
    "dqn_fast": 150_000,
    "dqn_mp": 150_000,
    "dqn_compile": 150_000,
    "a3c_data": 600_000,
    "a3c_grad": 600_000,
    "a3c_dist": 600_000,
}
DQN_SCRIPTS = ["dqn_baseline", "dqn_fast", "dqn_mp", "dqn_compile"]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run the slow tests too")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of plain pytest; `pytest --all` runs it")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def signal_handlers():
    """Every test starts with SIGINT as a terminal gives it, and leaves SIGINT and SIGTERM as it
    found them. A process a test starts inherits an ignored SIGINT, and Python in it then raises no
    KeyboardInterrupt: a shell without a terminal (nohup, a CI runner) may start pytest with SIGINT
    ignored, and a Run a test runs in this process ignores both signals at its exit."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def hooked_env(tmp_path, hook, env=None):
    """The environment (os.environ unless given) in which every Python process runs `hook` first;
    its PYTHONPATH comes after the hook's (packages may be installed there)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(hook)
    env = dict(env or os.environ)
    paths = [str(tmp_path / "hook"), REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    return dict(env, PYTHONPATH=os.pathsep.join(paths))


def hook(name):
    """The source of tests/hooks/<name>.py, for hooked_env; hooks run together are added up into one
    sitecustomize.py (hook("cuda_standin") + hook("acting_weights")), in the order given."""
    return (HOOKS / f"{name}.py").read_text()


def summary(out):
    """The JSON object on the last line of a script's output."""
    return json.loads(out.strip().splitlines()[-1])


def our_lines(err):
    """The lines of stderr that the project's code wrote ("script.py: error: ..."), whatever
    warnings a library prints around them; a traceback fails the test."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if re.match(r"\w+\.py: ", line)]


def free_port():
    """A TCP port free on the loopback now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def bf16_solve(tmp_path_factory):
    """A script's CartPole run from seed 1 with --bf16 within its BUDGET, made once a session and
    shared: test_scripts judges its learning, test_play_plot plays and plots dqn_compile's. Returns
    (exit code, stdout, stderr, the folder it ran in)."""
    made = {}

    def solve(script):
        if script not in made:
            cwd = tmp_path_factory.mktemp(f"{script}-bf16")
            proc = subprocess.run(
                [
                    sys.executable,
                    os.path.join(REPO, f"{script}.py"),
                    "--env",
                    "cartpole",
                    "--seed",
                    "1",
                    "--max-frames",
                    str(BUDGET[script]),
                    "--bf16",
                ],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=900,
            )
            made[script] = (proc.returncode, proc.stdout, proc.stderr, cwd)
        return made[script]

    return solve


@pytest.fixture
def run_main(monkeypatch):
    """Run a script's command line in this process, as `python script.py ARGS` would; returns its
    exit code (0 when it returns without sys.exit). A script is named, or a path to a copy."""

    def run(script, *args):
        path = str(script) if str(script).endswith(".py") else os.path.join(REPO, f"{script}.py")
        monkeypatch.setattr(sys, "argv", [path, *args])
        if "runs" in sys.modules:  # a fresh process starts with no stop asked
            monkeypatch.setattr(sys.modules["runs"], "stop_signal", None)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_info:
            return exit_info.code
        return 0

    return run


@pytest.fixture
def in_process(run_main, monkeypatch):
    """run_main for a command line that must stop in its checks, before any work: an env made here
    fails the test."""
    import common

    def refuse(*args, **kwargs):
        raise AssertionError("the script went past its checks")

    monkeypatch.setattr(common, "make_fast_env", refuse)
    monkeypatch.setattr(common, "make_python_env", refuse)
    return run_main


@pytest.fixture
def fake_shm_free(monkeypatch):
    """Make /dev/shm report the given bytes free (and its whole size) to os.statvfs."""
    statvfs = os.statvfs

    def fake(free):
        blocks = free // 4096
        monkeypatch.setattr(
            os,
            "statvfs",
            lambda path: (
                types.SimpleNamespace(
                    f_bavail=blocks, f_bfree=blocks, f_blocks=blocks, f_frsize=4096
                )
                if path == "/dev/shm"
                else statvfs(path)
            ),
        )

    return fake
