"""End to end: every script answers bad input, runs on Pong, learns CartPole and stops cleanly.
The fast tests launch each mechanism once; those marked slow (`pytest --all`) launch every script
and learn CartPole."""

import ast
import hashlib
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
import types
import uuid

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import a3c_dist
import common
import processes
import runs
from conftest import (
    BUDGET,
    DEVICES,
    DQN_SCRIPTS,
    REPO,
    free_port,
    hook,
    hooked_env,
    our_lines,
    summary,
)

A3C_SCRIPTS = ["a3c_data", "a3c_grad"]
MP_SCRIPTS = ["dqn_mp", "a3c_data", "a3c_grad"]
# Where a test runs a script for what its processes do, not for what it learns, the A3C scripts run
# 2 workers: 2 take every path that 4 take, and start in half the time.
WORKERS = {"a3c_data": ["--processes", "2"], "a3c_grad": ["--processes", "2"]}
CHILDREN = {
    "dqn_baseline": [],
    "dqn_fast": [],
    "dqn_mp": ["play process"],
    "dqn_compile": [],
    "a3c_data": ["worker 0", "worker 1"],
    "a3c_grad": ["worker 0", "worker 1"],
}
SCRIPTS = DQN_SCRIPTS + A3C_SCRIPTS
A3C_TAGS = [
    "train/advantage",
    "train/values",
    "train/loss_entropy",
    "train/loss_policy",
    "train/loss_value",
    "train/loss_total",
    "train/grad_l2",
    "train/grad_max",
]


def assert_steps_average_one_gradient_per_worker_at_their_weights(folder, learner, workers):
    """Each optimizer step's weights are those that every worker took one gradient at, and the
    workers took theirs at no other weights (but the newest, whose step the run's end cut off)."""
    steps = (folder / learner).read_text().split()
    taken = {worker: (folder / worker).read_text().split() for worker in workers}
    assert len(steps) > 10
    for worker, digests in taken.items():
        assert digests[: len(steps)] == steps, worker
        assert len(digests) <= len(steps) + 1, worker


def start(script, *args, cwd, env=None):
    """Start a script as a user would, in cwd, with its output captured, leading a process group
    of its own (as a terminal starts it)."""
    return subprocess.Popen(
        [sys.executable, os.path.join(REPO, f"{script}.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run(script, *args, cwd, env=None, timeout=900):
    """Run a script to its end; returns (exit code, stdout, stderr)."""
    proc = start(script, *args, cwd=cwd, env=env)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def events(cwd):
    """Scalars of the only run under cwd/runs, as {tag: [values]}."""
    (run_dir,) = os.listdir(os.path.join(cwd, "runs"))
    acc = EventAccumulator(os.path.join(cwd, "runs", run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tagged_env(tag):
    """The environment of a run whose processes can be found again by the tag."""
    return dict(os.environ, RL_TEST_TAG=tag)


def environ_has(pid, entry):
    """Whether a live process's environment holds the entry ("NAME=value"; Linux /proc)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry.encode() in f.read().split(b"\0")
    except OSError:
        return False


def tagged_pids(tag):
    """Live processes carrying the tag in their environment (Linux /proc)."""
    return [
        int(pid)
        for pid in filter(str.isdigit, os.listdir("/proc"))
        if environ_has(pid, f"RL_TEST_TAG={tag}")
    ]


def parent(pid):
    """A live process's parent pid (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def assert_none_left(tag, seconds=5.0):
    """No process of the run is alive within a few seconds."""
    deadline = time.time() + seconds
    while tagged_pids(tag) and time.time() < deadline:
        time.sleep(0.2)
    assert tagged_pids(tag) == []


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="process checks read /proc")


slow = pytest.mark.slow


def slow_but(fast, cases):
    """pytest params of cases, all but `fast` marked slow."""
    return [
        case
        if case == fast
        else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=slow)
        for case in cases
    ]


# ---------------------------------------------------------------- bad input, --help
BAD_INPUT = [
    (["--env", "mars"], "invalid choice"),
    (["--max-frames", "-1"], "positive integer"),
    (["--max-frames", "lots"], "positive integer"),
    (["--seed", "x"], "expected an integer"),
    (["--seed", "-1"], "expected an integer"),
    (["--seed", str(2**40)], "expected an integer"),
    (["--checkpoint-minutes", "-1"], "a number of minutes"),
    (["--checkpoint-minutes", "nan"], "a number of minutes"),
    (["--checkpoint-minutes", "soon"], "a number of minutes"),
]
BAD_INPUT += [] if torch.cuda.is_available() else [(["--cuda"], "no CUDA device")]
BAD_COUNTS = [
    ("dqn_fast", "--envs"),
    ("dqn_mp", "--envs"),
    ("dqn_compile", "--envs"),
    ("a3c_data", "--envs"),
    ("a3c_grad", "--envs"),
    ("a3c_data", "--processes"),
    ("a3c_grad", "--processes"),
    ("a3c_dist", "--envs"),
]


@pytest.mark.parametrize("script", SCRIPTS + ["a3c_dist"])
@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_ends_with_one_line_and_exit_code_2(
    script, args, message, in_process, monkeypatch, capsys
):
    if script == "a3c_dist":  # as torchrun starts rank 0, which reads the options
        monkeypatch.setenv("RANK", "0")
    assert in_process(script, *args) == 2
    out, err = capsys.readouterr()
    (line,) = our_lines(err)
    assert line.startswith(f"{script}.py: error:") and message in line and out == ""


@pytest.mark.parametrize("script, option", BAD_COUNTS)
def test_bad_counts_end_with_one_line_and_exit_code_2(script, option, in_process, capsys):
    assert in_process(script, option, "0") == 2
    out, err = capsys.readouterr()
    (line,) = our_lines(err)
    assert line.startswith(f"{script}.py: error:") and "positive integer" in line and out == ""


@pytest.mark.parametrize("script", DQN_SCRIPTS)
def test_each_dqn_script_gives_torch_its_threads_before_it_makes_its_env(
    script, in_process, monkeypatch
):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(2)
    try:
        with pytest.raises(AssertionError, match="past its checks"):
            in_process(script, "--env", "cartpole")
        assert torch.get_num_threads() == 1  # CartPole's
    finally:
        torch.set_num_threads(threads)


def test_a3c_dist_without_torchrun_says_how_to_start_it(in_process, capsys):
    assert in_process("a3c_dist") == 2
    out, err = capsys.readouterr()
    assert (
        our_lines(err)
        == [
            "a3c_dist.py: error: start it with torchrun, e.g. torchrun --standalone "
            "--nproc-per-node 4 a3c_dist.py"
        ]
        and out == ""
    )


@pytest.mark.parametrize("script", SCRIPTS + ["a3c_dist"])
def test_help_says_what_the_script_does_in_its_first_paragraph(script, in_process, capsys):
    assert in_process(script, "--help") == 0
    out = " ".join(capsys.readouterr().out.split())
    doc = runpy.run_path(os.path.join(REPO, f"{script}.py"))["__doc__"]
    first, _, rest = doc.partition("\n\n")
    assert " ".join(first.split()) in out
    assert rest == "" or " ".join(rest.split()[:8]) not in out  # how it works stays in the code
    assert "--max-frames" in out and "--seed" in out and "--bf16" in out


@pytest.mark.parametrize(
    "script, table_line, shown",
    [
        ("dqn_fast", "    envs=3,", "envs stepped as one (default: 5)"),
        ("a3c_grad", "    processes=4,", "workers (default: 5)"),
    ],
)
def test_help_shows_the_defaults_of_the_hyperparameter_table_as_edited(
    script, table_line, shown, tmp_path, monkeypatch, capsys
):
    source = open(os.path.join(REPO, f"{script}.py")).read()
    assert source.count(table_line) == 1
    edited = tmp_path / f"{script}.py"  # a learner's copy, with 5 in the table
    edited.write_text(source.replace(table_line, table_line.replace("3", "5").replace("4", "5")))
    monkeypatch.setattr(sys, "argv", [str(edited), "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(edited), run_name="__main__")
    assert shown in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "script, args",
    slow_but(
        ("dqn_fast", ["--env", "mars"]),
        [(script, ["--env", "mars"]) for script in SCRIPTS] + [("a3c_dist", [])],
    ),
)
def test_bad_input_from_the_shell_exits_with_code_2_and_no_traceback(script, args, tmp_path):
    # one script in the fast set: the in-process tests above check every script's answers
    code, out, err = run(script, *args, cwd=tmp_path)
    (line,) = our_lines(err)
    assert code == 2 and line.startswith(f"{script}.py: error:") and out == ""


@slow
def test_dqn_compile_without_a_working_compiler_ends_with_one_line_and_exit_code_2(tmp_path):
    # a compiler that is not there, and a cache of its own: no kernel compiled before can stand in
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-c++"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
    )
    code, out, err = run("dqn_compile", "--env", "cartpole", cwd=tmp_path, env=env)
    assert code == 2 and out == "" and not (tmp_path / "runs").exists(), err
    (line,) = our_lines(err)
    assert (
        line.startswith("dqn_compile.py: error: torch.compile fails here (")
        and "C++ compiler" in line
    )


def test_dqn_compile_on_a_python_that_torch_cannot_compile_for_ends_with_one_line_and_exit_code_2(
    run_main, monkeypatch, tmp_path, capsys
):
    def unsupported(*args, **kwargs):  # what torch.compile raises at once on Python 3.15
        raise RuntimeError("torch.compile is not supported on Python 3.15+")

    monkeypatch.setattr(torch, "compile", unsupported)
    monkeypatch.chdir(tmp_path)
    assert run_main("dqn_compile", "--env", "cartpole") == 2
    out, err = capsys.readouterr()
    assert (
        our_lines(err)
        == [
            "dqn_compile.py: error: torch.compile fails here (torch.compile is not supported "
            "on Python 3.15+); dqn_fast.py runs without it"
        ]
        and out == ""
    )
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- shared memory
# What each script shares by default on Pong, worked out from the networks' sizes: the A2C net has
# 3,293,863 parameters (13.2 MB), the DQN 1,687,206 (6.7 MB); a3c_grad adds a gradient slot per
# worker, a3c_data two slots of 63 states (28,224 bytes each) per worker: 14.2 MB.
SHARED = {"dqn_mp": ("6.7", "16m"), "a3c_data": ("27.4", "64m"), "a3c_grad": ("65.9", "128m")}


@pytest.fixture
def before_children(run_main, monkeypatch, tmp_path):
    """run_main in tmp_path, for a command line that must stop before any child starts."""

    def refuse(self):
        raise AssertionError("a child process started")

    monkeypatch.setattr(processes.ChildProcesses, "__enter__", refuse)
    monkeypatch.chdir(tmp_path)
    return run_main


@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_too_little_shared_memory_ends_with_one_line_and_exit_code_2_before_any_child(
    script, before_children, fake_shm_free, tmp_path, capsys
):
    fake_shm_free(2**20)
    assert before_children(script) == 2
    out, err = capsys.readouterr()
    needed, size = SHARED[script]
    assert our_lines(err) == [
        f"{script}.py: error: shared memory is short: this run shares {needed} MB and "
        f"/dev/shm has 1.0 MB free; in Docker, give the container more with docker run "
        f"--shm-size={size}"
    ]
    assert out == "" and not (tmp_path / "runs").exists()


def test_a3c_grad_with_its_4_workers_fits_dockers_64_mib(before_children, fake_shm_free):
    fake_shm_free(64 * 2**20)
    with pytest.raises(AssertionError, match="a child process started"):  # past the check
        before_children("a3c_grad")


def test_a3c_grad_where_torch_cannot_share_ends_with_one_line_and_exit_code_2(
    before_children, monkeypatch, tmp_path, capsys
):
    def no_room(self):
        raise RuntimeError(
            "unable to allocate shared memory(shm) for file </torch_1_2_3>: "
            "No space left on device (28)"
        )

    monkeypatch.setattr(torch.Tensor, "share_memory_", no_room)
    assert before_children("a3c_grad") == 2
    out, err = capsys.readouterr()
    (line,) = our_lines(err)
    assert line.startswith("a3c_grad.py: error: shared memory is short: this run shares 65.9 MB")
    assert "No space left on device" in line and "--shm-size=128m" in line and out == ""


def small_dev_shm(mib, command):
    """The command line that runs command with a /dev/shm of its own of mib MiB (Linux: a user and
    mount namespace, as a container has), or None where that cannot be made."""
    wrapped = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec "$@"',
        "sh",
        *command,
    ]
    try:
        probe = subprocess.run(wrapped[: -len(command)] + ["true"], capture_output=True)
    except OSError:
        return None
    return wrapped if probe.returncode == 0 else None


@slow
@needs_proc
def test_a3c_grad_in_a_40_mib_dev_shm_stops_with_one_line_and_in_64_mib_runs(tmp_path):
    script = os.path.join(REPO, "a3c_grad.py")
    short = small_dev_shm(40, [sys.executable, script, "--processes", "8"])
    if short is None:
        pytest.skip("no user and mount namespaces here (unshare -rm)")
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        short, cwd=tmp_path, env=tagged_env(tag), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == "" and not (tmp_path / "runs").exists()
    assert our_lines(proc.stderr) == [
        "a3c_grad.py: error: shared memory is short: this run shares 118.6 MB and "
        "/dev/shm has 41.9 MB free; in Docker, give the container more with docker "
        "run --shm-size=256m"
    ]
    assert_none_left(tag)
    fits = small_dev_shm(64, [sys.executable, script, "--max-frames", "2000"])
    proc = subprocess.run(
        fits, cwd=tmp_path, env=tagged_env(tag), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert summary(proc.stdout)["frames"] >= 2000
    assert_none_left(tag)


@slow
@needs_proc
def test_torchs_own_failure_where_shared_memory_runs_out_ends_with_one_line():
    # 84 MB go into a 40 MiB /dev/shm with no room counted first (macOS, Windows): torch fails.
    share = (
        "import os, processes, runs, torch; isdir = os.path.isdir; "
        "os.path.isdir = lambda path: path != '/dev/shm' and isdir(path); "
        "processes.share_memory(runs.ArgumentParser(prog='test'), torch.ones(20 * 2 ** 20))"
    )
    short = small_dev_shm(40, [sys.executable, "-c", share])
    if short is None:
        pytest.skip("no user and mount namespaces here (unshare -rm)")
    proc = subprocess.run(short, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("test: error: ")]
    assert (
        line.startswith(
            "test: error: shared memory is short: this run shares 83.9 MB and the system could "
            "not give it ("
        )
        and "No space left on device" in line
    ), proc.stderr
    assert line.endswith("; in Docker, give the container more with docker run --shm-size=256m")


# ---------------------------------------------------------------- a script copied alone
def project_imports(module):
    """The project's modules that module imports, followed to the end, itself included."""
    found, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in found or not os.path.isfile(os.path.join(REPO, f"{name}.py")):
            continue
        found.add(name)
        with open(os.path.join(REPO, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        todo += [
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        ]
        todo += [
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        ]
    return found


# ---------------------------------------------------------------- what a learner reads
SHARED_MODULES = ("common", "runs", "processes")  # the modules a script's calls reach


def definitions(module):
    """{name: (node, lines)} of each top-level class, function or assignment of a shared module."""
    with open(os.path.join(REPO, f"{module}.py")) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node]
            if hasattr(node, "name")
            else []
        )
        for target in targets:
            found[getattr(target, "name", getattr(target, "id", None))] = (
                node,
                node.end_lineno - node.lineno + 1,
            )
    return found


def reading_path(script):
    """The lines a learner reads for a script: its own, and those of each shared module's top-level
    definitions its names reach, recursively (module.name in any module, a bare name in its own)."""
    defs = {module: definitions(module) for module in SHARED_MODULES}
    with open(os.path.join(REPO, script)) as f:
        text = f.read()

    def names(tree, module):
        return {
            (node.value.id, node.attr)
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in SHARED_MODULES
        } | {(module, node.id) for node in ast.walk(tree) if module and isinstance(node, ast.Name)}

    todo, reached = list(names(ast.parse(text), None)), set()
    while todo:
        module, name = todo.pop()
        if (module, name) not in reached and name in defs[module]:
            reached.add((module, name))
            todo += names(defs[module][name][0], module)
    return len(text.splitlines()) + sum(defs[module][name][1] for module, name in reached)


def test_reading_path_counts_the_script_and_each_definition_it_reaches_once(tmp_path, monkeypatch):
    # runs.warn, reached twice, is 2 lines and reaches nothing of the shared modules
    for module in SHARED_MODULES:
        shutil.copy(os.path.join(REPO, f"{module}.py"), tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    (tmp_path / "two.py").write_text("import runs\nruns.warn(None, 'a')\nruns.warn(None, 'b')\n")
    assert reading_path("two.py") == 3 + 2


# Runs a script as `python script.py ARGS` would, from the current folder, and writes where every
# project module it loaded came from, at any exit (a3c_dist ends with os._exit), to a file of its
# own in a folder: torchrun's processes share one stdout, where their lines can run into each other.
ALONE = """
import atexit, json, os, runpy, sys
names, folder = sys.argv[1].split(","), sys.argv[2]
def report():
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
        json.dump({name: sys.modules[name].__file__ for name in names if name in sys.modules}, f)
atexit.register(report)
_exit = os._exit
os._exit = lambda code: (report(), _exit(code))
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@slow
@pytest.mark.parametrize("script", SCRIPTS + ["a3c_dist"])
def test_a_script_runs_alone_in_an_empty_folder_with_the_modules_it_imports(script, tmp_path):
    modules = project_imports(script)
    assert {"common", "runs"} <= modules and ("processes" in modules) == (script in MP_SCRIPTS)
    alone, reports = tmp_path / "alone", tmp_path / "loaded"
    alone.mkdir()
    reports.mkdir()
    for name in modules:
        shutil.copy(os.path.join(REPO, f"{name}.py"), alone)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    names = ",".join(
        sorted(os.path.splitext(name)[0] for name in os.listdir(REPO) if name.endswith(".py"))
    )
    command = [
        "-c",
        ALONE,
        names,
        str(reports),
        f"{script}.py",
        "--env",
        "cartpole",
        *WORKERS.get(script, []),
        "--max-frames",
        "1500" if script in DQN_SCRIPTS else "3000",
        "--checkpoint-minutes",
        "0",
    ]
    if script == "a3c_dist":
        command = [*TORCHRUN, "2", "--no-python", sys.executable, *command]
    proc = subprocess.run(
        [sys.executable, *command], cwd=alone, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    loaded = [json.loads(path.read_text()) for path in reports.iterdir()]
    # There is one report a process that the command starts.
    assert len(loaded) == (2 if script == "a3c_dist" else 1)
    for found in loaded:
        assert set(found) == modules - {script} and {
            os.path.dirname(path) for path in found.values()
        } == {str(alone)}
    assert "train/loss" in events(alone)  # it trained


# ---------------------------------------------------------------- Pong, tiny budget
@slow
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("device", DEVICES)
def test_runs_on_pong_with_optimizer_steps_and_logs(script, device, tmp_path):
    # DQN: a replay warm-up in which each env ends a game (about 900 frames at random), then 60
    # frames of training; A3C: a few steps.
    envs = 1 if script == "dqn_baseline" else 3
    warm_up = 1100 * envs
    frames = warm_up + 60 if script in DQN_SCRIPTS else 600
    options = ["--max-frames", str(frames), *WORKERS.get(script, [])] + (
        [] if envs == 1 else ["--envs", str(envs)]
    )
    options += ["--cuda"] if device == "cuda" else []
    (tmp_path / "devices").mkdir()
    env = dict(
        hooked_env(tmp_path, hook("child_devices") + hook("short_warm_up")),
        RL_TEST_DEVICES=str(tmp_path / "devices"),
        RL_TEST_REPLAY_START=str(warm_up),
    )
    code, out, err = run(script, *options, cwd=tmp_path, env=env)
    assert code == 0, err
    assert our_lines(err) == err.splitlines()  # no library's warnings or banners
    result = summary(out)
    assert result["script"] == script and result["env"] == "pong"
    scalars = events(tmp_path)
    assert len(scalars["train/loss"]) > 0
    expected = (
        [
            "train/epsilon",
            "train/avg_loss",
            "episodes/reward",
            "episodes/avg_reward",
            "episodes/steps",
            "episodes/minutes",
            "train/avg_fps",
        ]
        if script in DQN_SCRIPTS
        else A3C_TAGS
    )
    assert set(expected) <= set(scalars)
    folder = tmp_path / "runs" / os.listdir(tmp_path / "runs")[0]
    assert os.path.exists(folder / "best.pt")
    checkpoint = torch.load(folder / runs.CHECKPOINT, mmap=True, weights_only=True)
    assert (
        checkpoint["tracker"]["frames"] == result["frames"]
        and len(checkpoint["tracker"]["rewards"]) == result["episodes"]
    )
    # every child acts with a network on the run's device
    children = {path.name: path.read_text() for path in (tmp_path / "devices").iterdir()}
    assert sorted(children) == CHILDREN[script] and set(children.values()) <= {device}


# ---------------------------------------------------------------- the same math from a seed
FIRST_STEPS_ARGS = {"a3c_data": ["--processes", "1"], "a3c_grad": ["--processes", "4"]}


# The DQN scripts' third record is the first step after a target sync (CartPole's target_sync: 200).
FIRST_STEPS_AT = {
    "dqn_baseline": [1, 2, 201],
    "dqn_fast": [1, 2, 201],
    "dqn_mp": [1, 2, 201],
    "dqn_compile": [1, 2, 201],
    "a3c_data": [1, 2],
    "a3c_grad": [1, 2],
    "a3c_dist": [1, 2],
}


@slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("script", SCRIPTS + ["a3c_dist"])
def test_the_first_steps_from_a_seed_take_the_weights_where_they_took_them_before(
    script, precision, tmp_path
):
    # tests/first_steps.json holds each parameter's sum after the listed Adam steps (CartPole, seed
    # 7), recorded at 2dbaf75 (the DQN scripts' Adam with eps 1.5e-4) on a CPU machine with an Intel
    # Xeon (AVX512, bf16 native, AMX; an AMD EPYC without AMX rounds bf16 otherwise past step 200),
    # a3c_grad and a3c_dist with 4 workers and 4 ranks (128 samples a step: the table's learning
    # rate); the A3C scripts' sums are those recorded at 75347b4 and 9e5add1 within 1e-7. A change
    # to the math, or to what the generators draw, moves these sums: a Pong solve on record counts
    # for today's code while the record it ran under is this one.
    env = dict(
        hooked_env(tmp_path, hook("first_steps")),
        RL_TEST_STEPS=str(tmp_path / "steps.json"),
        RL_TEST_AT=json.dumps(FIRST_STEPS_AT[script]),
    )
    args = [
        "--env",
        "cartpole",
        "--seed",
        "7",
        "--max-frames",
        "2000" if script in DQN_SCRIPTS else "3000",
        "--checkpoint-minutes",
        "0",
        *FIRST_STEPS_ARGS.get(script, []),
        *(["--bf16"] if precision == "bf16" else []),
    ]
    if script == "a3c_dist":
        # 4 ranks take 4 x 32 samples a step, as 4 workers do.
        proc = start_dist(*args, cwd=tmp_path, env=env, ranks=4)
        err = proc.communicate(timeout=300)[1]
        code = proc.returncode
    else:
        code, _, err = run(script, *args, cwd=tmp_path, env=env)
    assert code == 0, err
    with open(os.path.join(REPO, "tests", "first_steps.json")) as f:
        record = json.load(f)
    expected = record[precision][script]
    with open(tmp_path / "steps.json") as f:
        steps = json.load(f)
    assert list(steps) == list(expected) == [str(step) for step in FIRST_STEPS_AT[script]]
    # fp32's first two steps hold on any CPU; bf16 and 200 steps on, other kernels round otherwise.
    same_kind = record["cpu"] == {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_native": runs.bf16_native(cuda=False),
        "amx_bf16": torch.cpu.get_capabilities().get("amx_bf16", False),
    }
    for step in (
        expected
        if same_kind
        else [step for step in expected if precision == "fp32" and step in ("1", "2")]
    ):
        assert steps[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), (
            f"after step {step}"
        )


@slow
@pytest.mark.parametrize("script", ["a3c_grad", "a3c_dist"])
def test_a3c_scales_the_learning_rate_by_the_square_root_of_its_batch(script, tmp_path):
    # CartPole's 1e-3 is for 4 x 32 = 128 samples a step: one worker's 32 take
    # 1e-3 * sqrt(32 / 128) = 5e-4.
    args = ["--env", "cartpole", "--max-frames", "500"]
    if script == "a3c_dist":
        proc = start_dist(*args, cwd=tmp_path, ranks=1)
        err = proc.communicate(timeout=300)[1]
        code = proc.returncode
    else:
        code, _, err = run(script, *args, "--processes", "1", cwd=tmp_path)
    assert code == 0, err
    (folder,) = (tmp_path / "runs").iterdir()
    checkpoint = torch.load(folder / runs.CHECKPOINT, weights_only=True)
    assert checkpoint["optimizer"]["param_groups"][0]["lr"] == pytest.approx(5e-4)


# ---------------------------------------------------------------- CartPole learning
# fp32's learning is test_resume's: each run, stopped by SIGTERM and resumed, solves within BUDGET.
@slow
@pytest.mark.parametrize(
    "script",
    [
        # dqn_compile's run is play and plot's too, so it runs in their group.
        script
        if script != "dqn_compile"
        else pytest.param(script, marks=pytest.mark.xdist_group("play_plot"))
        for script in SCRIPTS
    ],
)
def test_learns_cartpole_with_bf16_within_budget(script, bf16_solve):
    code, out, err, _ = bf16_solve(script)
    assert code == 0, err
    result = summary(out)
    assert result["solved"], result
    assert result["mean_reward"] >= common.STOP_REWARDS["cartpole"]
    assert our_lines(err) == err.splitlines()  # no library's warnings


# CartPole to 1,400 frames measures a fresh network's health once (at the 200th step): alive, it is
# not told. The fast test_dqn_trains_32_samples_per_frame sees each DQN script's stderr empty.
@slow
@pytest.mark.parametrize("env, frames", [("cartpole", "1400"), ("pong", "300")])
def test_a_run_prints_no_library_warning_or_banner(env, frames, tmp_path):
    # torch warned of a loss read in its graph; ALE printed its banner for each Python Atari env.
    code, out, err = run("dqn_baseline", "--env", env, "--max-frames", frames, cwd=tmp_path)
    assert code == 0 and err == ""


@pytest.mark.parametrize("native", slow_but(False, [True, False]))
def test_bf16_says_in_one_line_where_it_is_emulated_and_goes_on(
    native, tmp_path, run_main, monkeypatch, capsys
):
    real = torch.cpu.get_capabilities()  # as a CPU with or without bf16 instructions reports them
    monkeypatch.setattr(
        torch.cpu,
        "get_capabilities",
        lambda: types.MappingProxyType(
            {**real, "avx512_bf16": native, "amx_bf16": native, "bf16": native}
        ),
    )
    monkeypatch.chdir(tmp_path)
    code = run_main("dqn_baseline", "--env", "cartpole", "--bf16", "--max-frames", "300")
    out, err = capsys.readouterr()
    assert code == 0, err
    assert summary(out)["frames"] >= 300
    assert our_lines(err) == (
        []
        if native
        else [
            "dqn_baseline.py: warning: --bf16 is emulated on this CPU: it may run slower than fp32"
        ]
    )


@slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_learns_cartpole_with_cuda_within_budget(script, tmp_path):
    # Every process running the net runs it on the GPU (test_runs_on_pong_... checks the children).
    code, out, err = run(
        script,
        "--env",
        "cartpole",
        "--seed",
        "1",
        "--cuda",
        "--max-frames",
        str(BUDGET[script]),
        cwd=tmp_path,
    )
    assert code == 0, err
    assert summary(out)["solved"]


@pytest.mark.parametrize(
    "script, envs", [("dqn_baseline", 1), ("dqn_fast", 3), ("dqn_mp", 3), ("dqn_compile", 3)]
)
def test_dqn_trains_32_samples_per_frame(script, envs, tmp_path):
    args = ["--env", "cartpole", "--max-frames", "1600"] + (
        ["--envs", str(envs)] if envs > 1 else []
    )
    env = dict(
        hooked_env(tmp_path, hook("count_samples")), RL_TEST_SAMPLES=str(tmp_path / "samples")
    )
    code, out, err = run(script, *args, cwd=tmp_path, env=env)
    # There is no library's warning, nor one of a dead network: it measured a live one.
    assert code == 0 and err == ""
    (run_dir,) = (tmp_path / "runs").iterdir()
    result, steps = (
        summary(out),
        torch.load(run_dir / runs.CHECKPOINT, weights_only=True)["counts"]["train_steps"],
    )
    samples = int((tmp_path / "samples").read_text())
    # Every training step's loss is on 32 * envs samples and comes with one step of all envs: envs
    # frames, less the slots that only reset an env (at most one per finished episode), from the
    # first step, within envs frames of the warm-up's 1,000.
    assert samples == 32 * envs * steps
    assert (
        envs * steps - result["episodes"] - envs <= result["frames"] - 1000 <= envs * steps + envs
    )


@slow
@pytest.mark.parametrize("script", ["dqn_baseline", "dqn_fast"])
def test_a_seed_reproduces_a_single_process_run(script, tmp_path):
    losses = []
    for seed, folder in [(3, "a"), (3, "b"), (4, "c")]:
        (tmp_path / folder).mkdir()
        code, _, err = run(
            script,
            "--env",
            "cartpole",
            "--seed",
            str(seed),
            "--max-frames",
            "3000",
            cwd=tmp_path / folder,
        )
        assert code == 0, err
        (run_dir,) = (tmp_path / folder / "runs").iterdir()
        weights = torch.load(run_dir / runs.CHECKPOINT, weights_only=True)["net"]
        losses.append(
            (events(tmp_path / folder)["train/loss"], [w.tolist() for w in weights.values()])
        )
    # The records hold the loss of every LOG_EVERY-th step, and the weights after all of them.
    assert len(losses[0][0]) > 5
    assert losses[0] == losses[1] and losses[0][0] != losses[2][0] and losses[0][1] != losses[2][1]


@slow
def test_a_seed_reproduces_the_play_process_of_dqn_mp_until_training_starts(tmp_path):
    # CartPole trains from frame 1000: until then, the play process depends on the seed alone.
    rewards = []
    for seed, folder in [(3, "a"), (3, "b"), (4, "c")]:
        (tmp_path / folder).mkdir()
        code, _, err = run(
            "dqn_mp",
            "--env",
            "cartpole",
            "--seed",
            str(seed),
            "--max-frames",
            "900",
            cwd=tmp_path / folder,
        )
        assert code == 0, err
        rewards.append(events(tmp_path / folder)["episodes/reward"])
    assert rewards[0] == rewards[1]
    assert rewards[0] != rewards[2]


# -------------------------------------------------------------- --cuda's lines, on the CPU stand-in


@needs_proc
@pytest.mark.parametrize(
    "script, children", [("dqn_mp", ["play process"]), ("a3c_data", ["worker 0", "worker 1"])]
)
def test_children_act_with_the_weights_the_main_process_publishes_on_the_cpu_stand_in(
    script, children, tmp_path
):
    tag = uuid.uuid4().hex
    (tmp_path / "acting").mkdir()
    env = dict(
        hooked_env(tmp_path, hook("cuda_standin") + hook("acting_weights"), tagged_env(tag)),
        RL_TEST_ACTING=str(tmp_path / "acting"),
    )
    code, out, err = run(
        script,
        "--cuda",
        "--env",
        "cartpole",
        "--max-frames",
        "1200" if script == "dqn_mp" else "2000",
        "--checkpoint-minutes",
        "0",
        *WORKERS.get(script, []),
        cwd=tmp_path,
        env=env,
    )
    assert code == 0, err
    stepped = set((tmp_path / "acting" / "stepped").read_text().split())
    assert len(stepped) > 10
    # a3c_data's second worker may start after the first played the whole run on a loaded machine.
    acting = {
        child: (tmp_path / "acting" / child).read_text().split()
        for child in children
        if (tmp_path / "acting" / child).exists()
    }
    assert acting
    # Each child acted with the weights it started with, then only with weights that a step made.
    for child, acted in acting.items():
        assert set(acted[1:]) <= stepped | {acted[0]}, child
    assert len(set().union(*acting.values()) & stepped) > 5  # and many of them
    assert_none_left(tag)


# dqn_fast's lines are dqn_baseline's.
@pytest.mark.parametrize("script", ["dqn_baseline", "dqn_compile", "a3c_dist"])
def test_a_single_process_script_runs_its_gpu_lines_end_to_end_on_the_cpu_stand_in(
    script, tmp_path
):
    env = hooked_env(tmp_path, hook("cuda_standin"))
    # dqn_compile runs eagerly: inductor takes minutes on a CPU; a3c_dist's graphs are traced.
    if script == "dqn_compile":
        env["RL_TEST_EAGER"] = "1"
    args = ["--cuda", "--env", "cartpole", "--max-frames", "1300", "--checkpoint-minutes", "0"]
    if script == "a3c_dist":  # one rank, as torchrun would start it, without its agent
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE="1",
            RANK="0",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
        )
    code, out, err = run(script, *args, cwd=tmp_path, env=env)
    assert code == 0 and our_lines(err) == [], err
    assert "train/loss" in events(tmp_path)  # it trained


# -------------------------------------------------------------- dqn_mp: play at most one step ahead
@needs_proc
def test_dqn_mp_plays_at_most_one_step_ahead_of_a_slow_learner(tmp_path):
    tag = uuid.uuid4().hex
    (tmp_path / "ahead").mkdir()
    env = dict(
        hooked_env(tmp_path, hook("slow_learner"), tagged_env(tag)),
        RL_TEST_AHEAD=str(tmp_path / "ahead"),
    )
    code, _, err = run("dqn_mp", "--env", "cartpole", "--max-frames", "1300", cwd=tmp_path, env=env)
    assert code == 0, err
    notes = [
        tuple(map(int, line.split()))
        for line in (tmp_path / "ahead" / "notes").read_text().splitlines()
    ]
    assert len(notes) > 100
    # after each 20 ms training step the play process has played the step after the one the learner
    # took last, and no further: CartPole steps are small messages, hundreds of which fit a pipe
    ahead = [played - taken for taken, played in notes]
    assert max(ahead) == 1 and ahead.count(1) >= 0.9 * len(ahead)
    assert_none_left(tag)


# ---------------------------------------------------------------- a3c_grad's synchronous steps
@needs_proc
@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu-lines-on-the-cpu-stand-in"])
def test_a3c_grad_steps_average_one_gradient_from_each_worker_taken_at_the_weights_they_update(
    cuda, tmp_path
):
    # On the CPU the workers take their gradients with the main process's net itself; with --cuda
    # (here its lines on the CPU) with copies of the weights that it publishes after each step. Each
    # gradient is weighted by its own worker's samples, however many each has and whatever the order
    # they came in.
    tag = uuid.uuid4().hex
    (tmp_path / "weights").mkdir()
    env = dict(
        hooked_env(
            tmp_path,
            hook("weight_digests")
            + hook("a3c_grad_weights")
            + (hook("cuda_standin") if cuda else ""),
            tagged_env(tag),
        ),
        RL_TEST_WEIGHTS=str(tmp_path / "weights"),
        RL_TEST_STEPS=str(tmp_path / "steps"),
    )
    code, _, err = run(
        "a3c_grad",
        "--env",
        "cartpole",
        "--processes",
        "3",
        "--max-frames",
        "2000",
        *(["--cuda"] if cuda else []),
        cwd=tmp_path,
        env=env,
    )
    assert code == 0, err
    assert_steps_average_one_gradient_per_worker_at_their_weights(
        tmp_path / "weights", "MainProcess", [f"worker {i}" for i in range(3)]
    )
    assert int((tmp_path / "steps").read_text()) >= 10
    assert_none_left(tag)


def test_a3c_data_trains_on_the_states_its_worker_sent_though_it_has_refilled_the_slot_since(
    tmp_path,
):
    env = dict(
        hooked_env(tmp_path, hook("a3c_data_batches")), RL_TEST_BATCHES=str(tmp_path / "batches")
    )
    code, _, err = run(
        "a3c_data",
        "--env",
        "cartpole",
        "--processes",
        "1",
        "--max-frames",
        "2000",
        "--checkpoint-minutes",
        "0",
        cwd=tmp_path,
        env=env,
    )
    assert code == 0, err
    assert int((tmp_path / "batches").read_text()) >= 10


@slow
@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_children_waiting_on_the_main_process_end_when_it_is_killed(script, tmp_path):
    tag = uuid.uuid4().hex
    proc = start(
        script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=tagged_env(tag)
    )
    assert proc.stdout.readline().strip()  # a progress line: the run is under way
    # Nothing is taken: each child sends, then waits (a3c_grad's workers for a step too).
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(3)
    os.kill(proc.pid, signal.SIGKILL)  # and no step will come, nor a broken pipe
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a hang fails the test, and leaves nothing behind
        raise
    assert_none_left(tag)


# ---------------------------------------------------------------- stops
@slow
@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_normal_end_leaves_no_process(script, tmp_path):
    tag = uuid.uuid4().hex
    code, out, _ = run(
        script,
        "--env",
        "cartpole",
        *WORKERS.get(script, []),
        "--max-frames",
        "3000",
        cwd=tmp_path,
        env=tagged_env(tag),
    )
    assert code == 0 and summary(out)["frames"] >= 3000
    assert_none_left(tag)


@slow
@needs_proc
@pytest.mark.parametrize(
    "script, signum, code",
    [
        (script, signum, 128 + signum)
        for script in SCRIPTS
        for signum in (signal.SIGINT, signal.SIGTERM)
    ],
)
def test_sigint_and_sigterm_stop_everything_with_a_summary_and_exit_codes_130_and_143(
    script, signum, code, tmp_path
):
    tag = uuid.uuid4().hex
    proc = start(
        script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=tagged_env(tag)
    )
    assert proc.stdout.readline().strip()  # a progress line: the run is under way
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert summary(out)["solved"] is False and "Traceback" not in err
    assert_none_left(tag)


STARTUP = [(script, "setup") for script in SCRIPTS + ["a3c_dist"]] + [("dqn_compile", "probe")]


@needs_proc
@pytest.mark.parametrize("script, moment", slow_but(("dqn_fast", "setup"), STARTUP))
def test_a_sigterm_at_start_up_stops_as_cleanly_as_one_mid_run(script, moment, tmp_path):
    tag = uuid.uuid4().hex
    env = dict(
        hooked_env(tmp_path, hook("sigterm_at_start_up"), tagged_env(tag)), RL_TEST_SIGNAL_AT=moment
    )
    if script == "a3c_dist":
        proc = start_dist("--env", "cartpole", cwd=tmp_path, env=env, ranks=2)
    else:
        proc = start(script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=env)
    out, err = proc.communicate(timeout=120)
    if script != "a3c_dist":  # under torchrun, the code and the report are torchrun's
        assert proc.returncode == 143 and "Traceback" not in err, err
    assert [line.startswith("{") for line in out.splitlines()].count(True) == 1
    # The run stopped at its first boundary.
    assert summary(out)["episodes"] == 0 and not summary(out)["solved"]
    assert_none_left(tag)


def spawned_children(tag):
    """Pids of the run's processes that multiprocessing spawned (not its resource tracker)."""
    pids = []
    for pid in tagged_pids(tag):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


@needs_proc
@pytest.mark.parametrize("script", slow_but("dqn_mp", MP_SCRIPTS))
def test_ctrl_c_to_the_process_group_stops_everything_with_one_summary(script, tmp_path):
    tag = uuid.uuid4().hex
    proc = start(
        script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=tagged_env(tag)
    )
    assert proc.stdout.readline().strip()  # a progress line: the run is under way
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert [line.startswith("{") for line in out.splitlines()].count(True) == 1
    assert summary(out)["solved"] is False
    assert_none_left(tag)


# frames in a child's first message: a step of dqn_mp's 3 envs; 32 samples of 4 steps from 8 envs
FIRST_MESSAGE = {"dqn_mp": 3, "a3c_data": 8 * (32 // 8 + 3), "a3c_grad": 8 * (32 // 8 + 3)}


@slow
@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_ctrl_c_to_the_process_group_while_the_children_start_stops_everything_with_one_summary(
    script, tmp_path
):
    tag = uuid.uuid4().hex
    (tmp_path / "starting").mkdir()
    env = dict(
        hooked_env(tmp_path, hook("slow_child_start"), tagged_env(tag)),
        RL_TEST_STARTING=str(tmp_path / "starting"),
    )
    proc = start(script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=env)
    deadline = time.time() + 60
    while (
        len(list((tmp_path / "starting").iterdir())) < len(CHILDREN[script])
        and time.time() < deadline
    ):
        time.sleep(0.01)
    # All the children started, and none imported.
    assert len(list((tmp_path / "starting").iterdir())) == len(CHILDREN[script])
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert [line.startswith("{") for line in out.splitlines()].count(True) == 1
    assert 0 < summary(out)["frames"] <= FIRST_MESSAGE[script]  # stopped at the first boundary
    assert_none_left(tag)


@slow
@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_crash_in_child_reaches_the_user_and_stops_everything(script, tmp_path):
    tag = uuid.uuid4().hex
    env = hooked_env(tmp_path, hook("first_child_crashes"), tagged_env(tag))
    code, out, err = run(
        script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=env, timeout=120
    )
    assert code == 1
    child = "play process" if script == "dqn_mp" else "worker 0"
    assert (
        "RuntimeError: injected crash" in err
        and f"{script}.py: error: {child} exited with code 1" in err
    )
    assert "frames" in summary(out)
    assert_none_left(tag)


@needs_proc
@pytest.mark.parametrize(
    "script, child",
    slow_but(
        ("dqn_mp", "play process"),
        [("dqn_mp", "play process"), ("a3c_data", "worker 0"), ("a3c_grad", "worker 0")],
    ),
)
def test_child_killed_in_the_middle_of_a_message_ends_the_run_within_seconds(
    script, child, tmp_path
):
    tag = uuid.uuid4().hex
    env = dict(
        hooked_env(tmp_path, hook("stall_mid_message"), tagged_env(tag)),
        RL_TEST_STALLED=str(tmp_path / "stalled"),
    )
    proc = start(script, "--env", "cartpole", *WORKERS.get(script, []), cwd=tmp_path, env=env)
    deadline = time.time() + 120
    while not (tmp_path / "stalled").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the pid is written: half a message is in the pipe
    os.kill(int((tmp_path / "stalled").read_text()), signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a hang fails the test, and leaves nothing behind
        raise
    assert proc.returncode == 1, err
    assert f"{child} exited with code -9 (SIGKILL)" in err
    assert "frames" in summary(out)
    assert_none_left(tag)


# ---------------------------------------------------------------- a3c_dist under torchrun
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def start_dist(*args, cwd, env=None, ranks=3):
    """Start a3c_dist.py under torchrun with 3 ranks unless told (all playing), as a user would,
    leading a process group of its own."""
    return subprocess.Popen(
        [sys.executable, *TORCHRUN, str(ranks), os.path.join(REPO, "a3c_dist.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@needs_proc
def test_a3c_dist_counts_every_ranks_frames_and_each_game_once_and_stops_at_the_total(tmp_path):
    # Each rank's last report came with the stopping step: the run counted those before it.
    (tmp_path / "reports").mkdir()
    env = dict(
        hooked_env(tmp_path, hook("rank_reports")),
        RL_TEST_REPORTS=str(tmp_path / "reports"),
    )
    proc = start_dist(
        "--env",
        "cartpole",
        "--max-frames",
        "1500",
        "--checkpoint-minutes",
        "0",
        cwd=tmp_path,
        env=env,
        ranks=2,
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    reports = {
        path.name: [tuple(map(int, line.split())) for line in path.read_text().splitlines()]
        for path in (tmp_path / "reports").iterdir()
    }
    assert sorted(reports) == ["0", "1"] and len({len(lines) for lines in reports.values()}) == 1
    counted = [
        sum(lines[step][0] for lines in reports.values()) for step in range(len(reports["0"]) - 1)
    ]
    result = summary(out)
    assert result["frames"] == counted[-1] and counted[-2] < 1500 <= counted[-1]
    assert (
        result["episodes"]
        == sum(games for lines in reports.values() for _, games in lines[:-1])
        > 20
    )


@slow
@needs_proc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a3c_dist_learns_cartpole_with_cuda_within_budget(tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist(
        "--env",
        "cartpole",
        "--seed",
        "1",
        "--cuda",
        "--max-frames",
        str(BUDGET["a3c_dist"]),
        cwd=tmp_path,
        env=tagged_env(tag),
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert summary(out)["solved"]
    assert_none_left(tag)


@slow
def test_a3c_dist_runs_on_pong_with_optimizer_steps_and_logs(tmp_path):
    proc = start_dist(
        "--max-frames",
        "600",
        "--envs",
        "3",
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert our_lines(err) == err.splitlines()  # no library's warnings or banners
    result = summary(out)
    assert result["script"] == "a3c_dist" and result["env"] == "pong"
    scalars = events(tmp_path)  # rank 0 alone writes TensorBoard
    assert len(scalars["train/loss"]) > 0 and set(A3C_TAGS) <= set(scalars)


@slow
@needs_proc
@pytest.mark.parametrize(
    "target, signum",
    [("launcher", signal.SIGINT), ("launcher", signal.SIGTERM), ("process group", signal.SIGINT)],
)
def test_a3c_dist_ctrl_c_or_sigterm_stops_every_rank_with_one_summary(target, signum, tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist("--env", "cartpole", cwd=tmp_path, env=tagged_env(tag), ranks=2)
    assert proc.stdout.readline().strip()  # a progress line: the run is under way
    if target == "launcher":
        proc.send_signal(signum)
    else:
        os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0  # torchrun's own code
    assert [line.startswith("{") for line in out.splitlines()].count(True) == 1
    assert summary(out)["solved"] is False
    assert_none_left(tag)


def start_agents(tmp_path, *args, env):
    """Two torchrun agents, as on two machines (each --nnodes 2 --nproc-per-node 1, one c10d
    rendezvous on the loopback), each in a folder of its own and leading a process group of its own;
    the README's command across machines, on one machine."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        os.path.join(REPO, "a3c_dist.py"),
        *args,
    ]
    agents = []
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
        agents.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path / node,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return agents


@slow
@needs_proc
def test_a3c_dist_on_two_torchrun_agents_solves_cartpole_with_bf16_equal_weights_and_one_warning(
    tmp_path,
):
    tag = uuid.uuid4().hex
    (tmp_path / "weights").mkdir()
    env = dict(
        hooked_env(tmp_path, hook("weight_digests") + hook("cpu_bf16"), tagged_env(tag)),
        RL_TEST_WEIGHTS=str(tmp_path / "weights"),
        RL_TEST_BF16="0",
    )  # as a CPU without bf16 instructions
    agents = start_agents(
        tmp_path,
        "--env",
        "cartpole",
        "--seed",
        "2",
        "--max-frames",
        str(BUDGET["a3c_dist"]),
        "--bf16",
        env=env,
    )
    outputs = [agent.communicate(timeout=900) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err for _, err in outputs]
    summaries = [summary(out) for out, _ in outputs if out.strip()]
    assert len(summaries) == 1 and summaries[0]["solved"]  # rank 0's agent alone prints it
    # The run says once that bf16 is emulated.
    assert sorted(our_lines(err) for _, err in outputs) == [
        [],
        ["a3c_dist.py: warning: --bf16 is emulated on this CPU: it may run slower than fp32"],
    ]
    digests = {path.name: path.read_text().split() for path in (tmp_path / "weights").iterdir()}
    assert sorted(digests) == ["0", "1"] and len(digests["0"]) > 20 and digests["0"] == digests["1"]
    assert_none_left(tag)


@slow
@needs_proc
def test_a3c_dist_across_two_torchrun_agents_a_lost_agent_ends_the_other_with_one_line(tmp_path):
    tag = uuid.uuid4().hex
    agents = start_agents(tmp_path, "--env", "cartpole", env=tagged_env(tag))
    assert agents[0].stdout.readline().strip()  # rank 0's first progress line: steps under way
    # a machine lost: its agent and its rank (torchrun starts each rank in a session of its own)
    for pid in [agents[1].pid] + [pid for pid in tagged_pids(tag) if parent(pid) == agents[1].pid]:
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    out, err = agents[0].communicate(timeout=120)
    assert time.monotonic() - started < 60 + 30  # the collective timeout, and torchrun's teardown
    assert agents[0].returncode != 0
    lost = [line for line in err.splitlines() if "lost a rank" in line]
    # rank 0 ends through its tracker, another rank with its number
    assert len(lost) == 1 and re.fullmatch(
        r"a3c_dist\.py: error: rank [01] lost a rank: .*", lost[0]
    ), err
    assert 'a3c_dist.py", line' not in err  # no traceback of ours
    after = err.splitlines()[err.splitlines().index(lost[0]) + 1 :]
    assert not after or not after[0].startswith("frame #")  # nor gloo's C++ frames after our line
    assert_none_left(tag)


def dist_weights(tmp_path, *args, ranks=3):
    """Run a3c_dist.py on CartPole with the weight_digests hook; the digests each rank wrote, by
    RANK."""
    tag = uuid.uuid4().hex
    (tmp_path / "weights").mkdir(parents=True)
    env = dict(
        hooked_env(tmp_path, hook("weight_digests"), tagged_env(tag)),
        RL_TEST_WEIGHTS=str(tmp_path / "weights"),
    )
    proc = start_dist("--env", "cartpole", *args, cwd=tmp_path, env=env, ranks=ranks)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert_none_left(tag)
    return {path.name: path.read_text().split() for path in (tmp_path / "weights").iterdir()}


@needs_proc
def test_a3c_dist_ranks_hold_equal_weights_and_step_from_those_of_their_gradients_also_resumed(
    tmp_path,
):
    digests = dist_weights(tmp_path, "--max-frames", "1500")
    assert sorted(digests) == ["0", "1", "2"]
    assert digests["0"] == digests["1"] == digests["2"]  # every rank, at every moment
    # each rank writes a digest as it takes a gradient, then one before the optimizer step: the step
    # starts from the weights that every gradient was taken at, and moves them
    taken, stepped = digests["0"][0::2], digests["0"][1::2]
    assert (
        len(stepped) > 10 and taken[: len(stepped)] == stepped and len(set(stepped)) == len(stepped)
    )
    # Resumed: every rank builds the same net from the seed, so only the broadcasts give ranks 1 and
    # 2 rank 0's weights from the checkpoint, and its Adam state, which keeps their steps equal.
    (folder,) = (tmp_path / "runs").iterdir()
    # These are the parameters only, in order.
    saved = torch.load(folder / runs.CHECKPOINT, weights_only=True)["net"].values()
    digest = hashlib.md5(b"".join(tensor.numpy().tobytes() for tensor in saved)).hexdigest()
    resumed = dist_weights(tmp_path / "resumed", "--resume", str(folder), "--max-frames", "2100")
    assert resumed["0"][0] == resumed["1"][0] == resumed["2"][0] == digest
    assert resumed["0"] == resumed["1"] == resumed["2"] and len(resumed["0"]) > 6


@needs_proc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a3c_dist_with_cuda_2_ranks_sharing_one_gpu_hold_equal_weights(tmp_path):
    digests = dist_weights(tmp_path, "--cuda", "--max-frames", "3000", ranks=2)
    assert sorted(digests) == ["0", "1"] and len(digests["0"]) > 20 and digests["0"] == digests["1"]


@slow
@needs_proc
def test_a3c_dist_a_seed_reproduces_its_weights(tmp_path):
    digests = [
        dist_weights(tmp_path / name, "--max-frames", "2000", "--seed", str(seed), ranks=2)["0"]
        for name, seed in [("a", 3), ("b", 3), ("c", 4)]
    ]
    # The first 40 digests are 20 steps: the collective waits for every rank.
    assert len(digests[0]) > 40 and digests[0][:40] == digests[1][:40]
    assert digests[0][:40] != digests[2][:40]  # and another seed makes other weights


@slow
@needs_proc
def test_a3c_dist_first_step_with_3_ranks_is_a3c_grads_with_3_workers(tmp_path):
    saved = {}
    for script in ["a3c_grad", "a3c_dist"]:
        folder = tmp_path / script
        (folder / "first").mkdir(parents=True)
        env = dict(
            hooked_env(folder, hook("save_first_step")), RL_TEST_FIRST_STEP=str(folder / "first")
        )
        args = ["--env", "cartpole", "--seed", "5", "--max-frames", "1000"]
        if script == "a3c_grad":
            code, _, err = run(script, *args, "--processes", "3", cwd=folder, env=env)
        else:
            proc = start_dist(*args, cwd=folder, env=env)
            err = proc.communicate(timeout=600)[1]
            code = proc.returncode
        assert code == 0, err
        saved[script] = {path.name: torch.load(path) for path in (folder / "first").iterdir()}
    assert sorted(saved["a3c_grad"]) == ["MainProcess"] and sorted(saved["a3c_dist"]) == [
        "0",
        "1",
        "2",
    ]
    grads, weights = saved["a3c_grad"]["MainProcess"]
    for rank_grads, rank_weights in saved["a3c_dist"].values():  # the sums run in other orders
        for got, expected in zip(rank_grads + rank_weights, grads + weights):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@slow
@needs_proc
def test_a3c_dist_crash_in_a_worker_stops_every_rank_and_names_it(tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist(
        "--env",
        "cartpole",
        cwd=tmp_path,
        env=hooked_env(tmp_path, hook("rank_1_crashes"), tagged_env(tag)),
        ranks=2,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    # torchrun names the rank.
    assert "RuntimeError: injected crash" in err and "local_rank: 1" in err
    assert "frames" in summary(out)  # rank 0's summary
    assert_none_left(tag)


def start_ranks(tmp_path, *args, env, ranks=3):
    """a3c_dist.py's ranks with the environment torchrun gives them, but no torchrun agent to end
    the others when one ends: what a rank's loss leaves to the others is theirs to handle, as across
    machines. Each leads a process group of its own."""
    common_env = dict(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
    )
    return [
        subprocess.Popen(
            [sys.executable, os.path.join(REPO, "a3c_dist.py"), *args],
            cwd=tmp_path,
            env=dict(common_env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(ranks)
    ]


def assert_lost_a_rank(rank, proc, out, err):
    """A rank that lost another ends with code 1 and one line saying so; rank 0 with its summary."""
    assert proc.returncode == 1, err
    (line,) = our_lines(err)
    assert line.startswith(f"a3c_dist.py: error: rank {rank} lost a rank: "), err
    if rank == 0:
        assert summary(out)["solved"] is False  # its tracker's summary
    else:
        assert out == ""


@slow
@needs_proc
@pytest.mark.parametrize("victim", [0, 2])
def test_a3c_dist_ranks_that_lose_a_rank_each_end_with_one_line_and_code_1(victim, tmp_path):
    tag = uuid.uuid4().hex
    ranks = start_ranks(tmp_path, "--env", "cartpole", env=tagged_env(tag))
    assert ranks[0].stdout.readline().strip()  # a progress line: steps under way
    os.kill(ranks[victim].pid, signal.SIGKILL)  # a machine lost, at once
    started = time.monotonic()
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=90)
        if rank != victim:
            assert_lost_a_rank(rank, proc, out, err)
    # A reset connection is seen at the next step, not at the timeout.
    assert time.monotonic() - started < 30
    assert_none_left(tag)


@slow
@needs_proc
def test_a3c_dist_a_silent_rank_ends_the_others_at_the_collective_timeout(tmp_path):
    tag = uuid.uuid4().hex
    ranks = start_ranks(
        tmp_path,
        "--env",
        "cartpole",
        env=hooked_env(tmp_path, hook("short_dist_timeout"), tagged_env(tag)),
    )
    assert ranks[0].stdout.readline().strip()
    os.kill(ranks[2].pid, signal.SIGSTOP)  # alive, connected, and silent
    started = time.monotonic()
    try:
        for rank, proc in enumerate(ranks[:2]):
            out, err = proc.communicate(timeout=150)
            assert_lost_a_rank(rank, proc, out, err)
        waited = time.monotonic() - started
    finally:
        os.kill(ranks[2].pid, signal.SIGKILL)
    assert (
        a3c_dist.TIMEOUT.total_seconds() / 6 - 2
        < waited
        < a3c_dist.TIMEOUT.total_seconds() / 6 + 20
    )
    ranks[2].communicate(timeout=10)
    assert_none_left(tag)


@slow
@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a3c_dist_a_signal_to_every_rank_ends_each_with_its_code_and_rank_0_with_the_summary(
    signum, tmp_path
):
    # torchrun's agent sends SIGTERM to every rank; a terminal's Ctrl-C reaches every rank on it
    tag = uuid.uuid4().hex
    ranks = start_ranks(tmp_path, "--env", "cartpole", env=tagged_env(tag), ranks=2)
    assert ranks[0].stdout.readline().strip()
    for proc in ranks:
        os.kill(proc.pid, signum)
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signum and our_lines(err) == [], err
        assert [line.startswith("{") for line in out.splitlines()].count(True) == (rank == 0)
    assert_none_left(tag)


@slow
@needs_proc
def test_a3c_dist_a_ranks_40_episodes_of_one_report_all_arrive_at_its_step(tmp_path):
    proc = start_dist(
        "--env",
        "cartpole",
        "--max-frames",
        "3000",
        cwd=tmp_path,
        env=hooked_env(tmp_path, hook("many_episodes_on_rank_1")),
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    (run_dir,) = os.listdir(tmp_path / "runs")
    acc = EventAccumulator(str(tmp_path / "runs" / run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    frames = [event.step for event in acc.Scalars("episodes/reward") if event.value == 0.5]
    # All 40 are logged at the frames of the step that brought them.
    assert len(frames) == 40 and len(set(frames)) == 1
