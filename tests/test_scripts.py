"""End to end: every script answers bad input, runs on Pong, learns CartPole and stops cleanly."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import common  # noqa: E402
import dqn_fast  # noqa: E402

DQN_SCRIPTS = ["dqn_baseline", "dqn_fast", "dqn_mp"]
A3C_SCRIPTS = ["a3c_data", "a3c_grad"]
MP_SCRIPTS = ["dqn_mp", "a3c_data", "a3c_grad"]
CHILDREN = {"dqn_baseline": [], "dqn_fast": [], "dqn_mp": ["play process"],
            "a3c_data": [f"worker {i}" for i in range(4)], "a3c_grad": [f"worker {i}" for i in range(4)]}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device"))]
SCRIPTS = DQN_SCRIPTS + A3C_SCRIPTS
A3C_TAGS = ["train/advantage", "train/values", "train/loss_entropy", "train/loss_policy", "train/loss_value",
            "train/loss_total", "train/grad_l2", "train/grad_max"]
# only the first child crashes: the others go on feeding the queue, which must not hide the crash
CRASH_HOOK = '''
import multiprocessing
import common
_iter = common.ExperienceSourceFirstLast.__iter__
def crashing_iter(self):
    for step, exps in enumerate(_iter(self)):
        if step == 20 and multiprocessing.current_process().name in ("play process", "worker 0"):
            raise RuntimeError("injected crash")
        yield exps
common.ExperienceSourceFirstLast.__iter__ = crashing_iter
'''
# each child writes its pid to $RL_TEST_PIDS/<its name> once it plays
PIDS_HOOK = """
import multiprocessing, os
import common
_iter = common.ExperienceSourceFirstLast.__iter__
def announcing_iter(self):
    path = os.path.join(os.environ["RL_TEST_PIDS"], multiprocessing.current_process().name)
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    yield from _iter(self)
common.ExperienceSourceFirstLast.__iter__ = announcing_iter
"""
# each child writes the device of its copy of the network to $RL_TEST_DEVICES/<its name>
DEVICES_HOOK = """
import multiprocessing, os
import common
_copy_to = common.SharedWeights.copy_to
def recording_copy_to(self, device):
    with open(os.path.join(os.environ["RL_TEST_DEVICES"], multiprocessing.current_process().name), "w") as f:
        f.write(str(device))
    return _copy_to(self, device)
common.SharedWeights.copy_to = recording_copy_to
"""
# the process that drew samples from the replay buffer writes how many, in all, to $RL_TEST_SAMPLES;
# every other Python process of the run (the play process, multiprocessing's resource tracker)
# runs this hook too, and must not overwrite it
SAMPLES_HOOK = '''
import atexit, os
import common
_sample, drawn = common.ReplayBuffer.sample, []
def counting_sample(self, batch_size):
    drawn.append(batch_size)
    return _sample(self, batch_size)
def write_total():
    if drawn:
        with open(os.environ["RL_TEST_SAMPLES"], "w") as f:
            f.write(str(sum(drawn)))
common.ReplayBuffer.sample = counting_sample
atexit.register(write_total)
'''

# every process writes a line to $RL_TEST_WEIGHTS/<its name> with a digest of the weights: a worker
# when it is about to take a gradient (net.zero_grad()), the learner before each optimizer step
WEIGHTS_HOOK = """
import hashlib, multiprocessing, os
import torch
def digest(params):
    return hashlib.md5(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest()
def record(params):
    name = os.environ.get("RANK") or multiprocessing.current_process().name
    with open(os.path.join(os.environ["RL_TEST_WEIGHTS"], name), "a") as f:
        f.write(digest(params) + "\\n")
_zero_grad, _step = torch.nn.Module.zero_grad, torch.optim.Adam.step
def recording_zero_grad(self, *args, **kwargs):
    record(self.parameters())
    return _zero_grad(self, *args, **kwargs)
def recording_step(self, *args, **kwargs):
    record(p for group in self.param_groups for p in group["params"])
    return _step(self, *args, **kwargs)
torch.nn.Module.zero_grad, torch.optim.Adam.step = recording_zero_grad, recording_step
"""


def assert_steps_average_one_gradient_per_worker_at_their_weights(folder, learner, workers):
    """Each optimizer step's weights are those that every worker took one gradient at, and the
    workers took theirs at no other weights (but the newest, whose step the run's end cut off)."""
    steps = (folder / learner).read_text().split()
    taken = {worker: (folder / worker).read_text().split() for worker in workers}
    assert len(steps) > 10
    for worker, digests in taken.items():
        assert digests[:len(steps)] == steps, worker
        assert len(digests) <= len(steps) + 1, worker


@pytest.fixture(autouse=True)
def sigint_not_ignored():
    """A shell without a terminal (nohup, a CI runner) may start pytest with SIGINT ignored, which the
    scripts would inherit: give them the default that a terminal gives."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def start(script, *args, cwd, env=None):
    """Start a script as a user would, in cwd, with its output captured, leading a process group
    of its own (as a terminal starts it)."""
    return subprocess.Popen([sys.executable, os.path.join(REPO, f"{script}.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def run(script, *args, cwd, env=None, timeout=900):
    """Run a script to its end; returns (exit code, stdout, stderr)."""
    proc = start(script, *args, cwd=cwd, env=env)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def summary(out):
    """The JSON object on the last line of a script's output."""
    return json.loads(out.strip().splitlines()[-1])


def events(cwd):
    """Scalars of the only run under cwd/runs, as {tag: [values]}."""
    (run_dir,) = os.listdir(os.path.join(cwd, "runs"))
    acc = EventAccumulator(os.path.join(cwd, "runs", run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tagged_env(tag):
    """The environment of a run whose processes can be found again by the tag."""
    return dict(os.environ, RL_TEST_TAG=tag)


def hooked_env(tmp_path, hook, env=None):
    """The environment (os.environ unless given) in which every Python process runs `hook` first."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(hook)
    return dict(env or os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "hook"), REPO]))


def environ_has(pid, entry):
    """Whether a live process's environment holds the entry ("NAME=value"; Linux /proc)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry.encode() in f.read().split(b"\0")
    except OSError:
        return False


def tagged_pids(tag):
    """Live processes carrying the tag in their environment (Linux /proc)."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if environ_has(pid, f"RL_TEST_TAG={tag}")]


def assert_none_left(tag, seconds=5.0):
    """No process of the run is alive within a few seconds."""
    deadline = time.time() + seconds
    while tagged_pids(tag) and time.time() < deadline:
        time.sleep(0.2)
    assert tagged_pids(tag) == []


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="process checks read /proc")


# ---------------------------------------------------------------- bad input
BAD_INPUT = [(["--env", "mars"], "invalid choice"), (["--max-frames", "-1"], "positive integer"),
             (["--max-frames", "lots"], "positive integer"), (["--seed", "x"], "expected an integer"),
             (["--seed", "-1"], "expected an integer"), (["--seed", str(2 ** 40)], "expected an integer")]
BAD_INPUT += [] if torch.cuda.is_available() else [(["--cuda"], "no CUDA device")]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_ends_with_one_line_and_exit_code_2(script, args, message, tmp_path):
    code, out, err = run(script, *args, cwd=tmp_path)
    assert code == 2
    assert err.count("\n") == 1 and message in err and f"{script}.py: error:" in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("script, option", [("dqn_fast", "--envs"), ("dqn_mp", "--envs"), ("a3c_data", "--envs"),
                                            ("a3c_grad", "--envs"), ("a3c_data", "--processes"),
                                            ("a3c_grad", "--processes")])
def test_bad_counts_end_with_one_line_and_exit_code_2(script, option, tmp_path):
    code, _, err = run(script, option, "0", cwd=tmp_path)
    assert code == 2 and err.count("\n") == 1 and "positive integer" in err and "Traceback" not in err


# ---------------------------------------------------------------- Pong, tiny budget
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("device", DEVICES)
def test_runs_on_pong_with_optimizer_steps_and_logs(script, device, tmp_path):
    warmup = dqn_fast.HYPERPARAMS["pong"]["replay_start"] if script in DQN_SCRIPTS else 0
    options = ["--max-frames", str(warmup + 100)] if script == "dqn_baseline" else \
        ["--max-frames", str(warmup + 600), "--envs", "3"]
    options += ["--cuda"] if device == "cuda" else []
    (tmp_path / "devices").mkdir()
    env = dict(hooked_env(tmp_path, DEVICES_HOOK), RL_TEST_DEVICES=str(tmp_path / "devices"))
    code, out, err = run(script, *options, cwd=tmp_path, env=env)
    assert code == 0, err
    result = summary(out)
    assert result["script"] == script and result["env"] == "pong" and result["train_frames"] > 0
    scalars = events(tmp_path)
    assert len(scalars["train/loss"]) > 0 and "train/avg_loss" in scalars
    expected = ["train/epsilon", "episodes/reward", "episodes/avg_reward", "episodes/steps", "train/avg_fps"] \
        if script in DQN_SCRIPTS else A3C_TAGS
    assert set(expected) <= set(scalars)
    assert os.path.exists(os.path.join(tmp_path, "runs", os.listdir(tmp_path / "runs")[0], "best.pt"))
    # every child runs its own copy of the network on the run's device
    children = {path.name: path.read_text() for path in (tmp_path / "devices").iterdir()}
    assert sorted(children) == CHILDREN[script] and set(children.values()) <= {device}


# ---------------------------------------------------------------- CartPole learning
BUDGET = {"dqn_baseline": 100_000, "dqn_fast": 100_000, "dqn_mp": 100_000,
          "a3c_data": 1_000_000, "a3c_grad": 1_000_000}


@pytest.mark.parametrize("script", SCRIPTS)
def test_learns_cartpole_within_budget(script, tmp_path):
    code, out, err = run(script, "--env", "cartpole", "--seed", "1", "--max-frames", str(BUDGET[script]),
                         cwd=tmp_path)
    assert code == 0, err
    result = summary(out)
    assert result["solved"], result
    assert result["mean_reward"] >= common.STOP_REWARDS["cartpole"]


@pytest.mark.parametrize("script, envs", [("dqn_baseline", 1), ("dqn_fast", 3), ("dqn_mp", 3)])
def test_dqn_trains_32_samples_per_frame(script, envs, tmp_path):
    args = ["--env", "cartpole", "--max-frames", "3000"] + (["--envs", str(envs)] if envs > 1 else [])
    env = dict(hooked_env(tmp_path, SAMPLES_HOOK), RL_TEST_SAMPLES=str(tmp_path / "samples"))
    code, out, err = run(script, *args, cwd=tmp_path, env=env)
    assert code == 0, err
    result, steps = summary(out), len(events(tmp_path)["train/loss"])
    samples = int((tmp_path / "samples").read_text())
    assert samples == 32 * envs * steps           # every training step draws 32 * envs samples
    # and comes with one step of all envs: envs frames, less the slots that only reset an env
    # (at most one per finished episode)
    assert envs * steps - result["episodes"] - envs <= result["train_frames"] <= envs * steps


# ---------------------------------------------------------------- a3c_grad's synchronous steps
def test_a3c_grad_steps_average_one_gradient_from_each_worker_taken_at_the_weights_they_update(tmp_path):
    (tmp_path / "weights").mkdir()
    env = dict(hooked_env(tmp_path, WEIGHTS_HOOK), RL_TEST_WEIGHTS=str(tmp_path / "weights"))
    code, _, err = run("a3c_grad", "--env", "cartpole", "--processes", "3", "--max-frames", "5000",
                       cwd=tmp_path, env=env)
    assert code == 0, err
    assert_steps_average_one_gradient_per_worker_at_their_weights(
        tmp_path / "weights", "MainProcess", [f"worker {i}" for i in range(3)])


@needs_proc
def test_a3c_grad_workers_waiting_for_a_step_end_when_the_main_process_is_killed(tmp_path):
    tag = uuid.uuid4().hex
    proc = start("a3c_grad", "--env", "cartpole", cwd=tmp_path, env=tagged_env(tag))
    assert proc.stdout.readline().strip()          # a progress line: the run is under way
    os.kill(proc.pid, signal.SIGSTOP)              # no step comes: each worker sends a gradient, then waits
    time.sleep(3)
    os.kill(proc.pid, signal.SIGKILL)              # and no step will come, nor a broken pipe
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)        # a hang fails the test, and leaves nothing behind
        raise
    assert_none_left(tag)


# ---------------------------------------------------------------- processes
@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_normal_end_leaves_no_process(script, tmp_path):
    tag = uuid.uuid4().hex
    code, out, _ = run(script, "--env", "cartpole", "--max-frames", "3000", cwd=tmp_path, env=tagged_env(tag))
    assert code == 0 and summary(out)["frames"] >= 3000
    assert_none_left(tag)


@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_sigint_stops_everything_with_a_summary(script, tmp_path):
    tag = uuid.uuid4().hex
    proc = start(script, "--env", "cartpole", cwd=tmp_path, env=tagged_env(tag))
    assert proc.stdout.readline().strip()          # a progress line: the run is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert summary(out)["solved"] is False and "Traceback" not in err
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
@pytest.mark.parametrize("script", MP_SCRIPTS)
@pytest.mark.parametrize("when", ["start-up", "later"])
def test_ctrl_c_to_the_process_group_stops_everything_with_one_summary(script, when, tmp_path):
    tag = uuid.uuid4().hex
    proc = start(script, "--env", "cartpole", cwd=tmp_path, env=tagged_env(tag))
    if when == "start-up":    # all children have been started, and they are still importing
        deadline = time.time() + 60
        while len(spawned_children(tag)) < (1 if script == "dqn_mp" else 4) and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
    else:
        assert proc.stdout.readline().strip()      # a progress line: the run is under way
    os.killpg(proc.pid, signal.SIGINT)             # what a terminal's Ctrl-C does
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert [line.startswith("{") for line in out.splitlines()].count(True) == 1
    assert summary(out)["solved"] is False
    assert_none_left(tag)


@needs_proc
@pytest.mark.parametrize("script", MP_SCRIPTS)
def test_crash_in_child_reaches_the_user_and_stops_everything(script, tmp_path):
    tag = uuid.uuid4().hex
    env = hooked_env(tmp_path, CRASH_HOOK, tagged_env(tag))
    code, out, err = run(script, "--env", "cartpole", cwd=tmp_path, env=env, timeout=120)
    assert code == 1
    child = "play process" if script == "dqn_mp" else "worker 0"
    assert "RuntimeError: injected crash" in err and f"{child} exited with code 1" in err
    assert "frames" in summary(out)
    assert_none_left(tag)


@needs_proc
@pytest.mark.parametrize("script, child, options", [("dqn_mp", "play process", []),
                                                    ("a3c_data", "worker 0", ["--processes", "1"]),
                                                    ("a3c_grad", "worker 0", ["--processes", "1"])])
def test_child_killed_mid_message_ends_the_run_within_seconds(script, child, options, tmp_path):
    tag = uuid.uuid4().hex
    (tmp_path / "pids").mkdir()
    env = dict(hooked_env(tmp_path, PIDS_HOOK, tagged_env(tag)), RL_TEST_PIDS=str(tmp_path / "pids"))
    proc = start(script, "--envs", "3", *options, cwd=tmp_path, env=env)   # Pong: messages larger than a pipe
    pid_file = tmp_path / "pids" / child
    deadline = time.time() + 120
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(3)
    os.kill(proc.pid, signal.SIGSTOP)             # the main process stops reading: the child blocks mid-message
    time.sleep(2)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    os.kill(proc.pid, signal.SIGCONT)
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)        # a hang fails the test, and leaves nothing behind
        raise
    assert proc.returncode == 1, err
    assert f"{child} exited with code -9 (SIGKILL)" in err
    assert "frames" in summary(out)
    assert_none_left(tag)


def test_seed_reproduces_the_play_process_of_dqn_mp(tmp_path):
    # CartPole trains from frame 1000: before that, what the play process does depends on the seed alone
    rewards = []
    for seed, folder in [(3, "a"), (3, "b"), (4, "c")]:
        (tmp_path / folder).mkdir()
        code, _, err = run("dqn_mp", "--env", "cartpole", "--seed", str(seed), "--max-frames", "900",
                           cwd=tmp_path / folder)
        assert code == 0, err
        rewards.append(events(tmp_path / folder)["episodes/reward"])
    assert rewards[0] == rewards[1]
    assert rewards[0] != rewards[2]


# ---------------------------------------------------------------- a3c_dist under torchrun
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]   # rank 0 and 2 workers
# rank 1 crashes in the middle of the run
DIST_CRASH_HOOK = """
import os
if os.environ.get("RANK") == "1":
    import common
    _iter = common.ExperienceSourceFirstLast.__iter__
    def crashing_iter(self):
        for step, exps in enumerate(_iter(self)):
            if step == 20:
                raise RuntimeError("injected crash")
            yield exps
    common.ExperienceSourceFirstLast.__iter__ = crashing_iter
"""


def start_dist(*args, cwd, env=None):
    """Start a3c_dist.py under torchrun, as a user would, leading a process group of its own."""
    return subprocess.Popen([sys.executable, *TORCHRUN, os.path.join(REPO, "a3c_dist.py"), *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("args, message", [([], "start it with torchrun"), (["--env", "mars"], "invalid choice"),
                                           (["--envs", "0"], "positive integer"), (["--seed", "-1"], "expected an integer")])
def test_a3c_dist_bad_input_or_no_torchrun_ends_with_one_line_and_exit_code_2(args, message, tmp_path):
    code, out, err = run("a3c_dist", *args, cwd=tmp_path)
    assert code == 2 and err.count("\n") == 1 and message in err and "a3c_dist.py: error:" in err
    assert "Traceback" not in err and out == ""


@needs_proc
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a3c_dist_learns_cartpole_within_budget(seed, tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist("--env", "cartpole", "--seed", str(seed), "--max-frames", "1000000", cwd=tmp_path,
                      env=tagged_env(tag))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    result = summary(out)
    assert result["solved"] and result["mean_reward"] >= common.STOP_REWARDS["cartpole"], result
    assert_none_left(tag)


def test_a3c_dist_runs_on_pong_with_optimizer_steps_and_logs(tmp_path):
    proc = start_dist("--max-frames", "600", "--envs", "3", cwd=tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    result = summary(out)
    assert result["script"] == "a3c_dist" and result["env"] == "pong" and result["train_frames"] > 0
    scalars = events(tmp_path)                         # rank 0 alone writes TensorBoard
    assert len(scalars["train/loss"]) > 0 and set(A3C_TAGS) <= set(scalars)


@needs_proc
@pytest.mark.parametrize("target", ["launcher", "process group"])
def test_a3c_dist_ctrl_c_stops_every_rank_with_one_summary(target, tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist("--env", "cartpole", cwd=tmp_path, env=tagged_env(tag))
    assert proc.stdout.readline().strip()              # a progress line: the run is under way
    if target == "launcher":
        proc.send_signal(signal.SIGINT)
    else:
        os.killpg(proc.pid, signal.SIGINT)             # what a terminal's Ctrl-C does
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert [line.startswith("{") for line in out.splitlines()].count(True) == 1
    assert summary(out)["solved"] is False
    assert_none_left(tag)


def test_a3c_dist_steps_average_one_gradient_from_each_worker_taken_at_the_weights_they_update(tmp_path):
    (tmp_path / "weights").mkdir()
    env = dict(hooked_env(tmp_path, WEIGHTS_HOOK), RL_TEST_WEIGHTS=str(tmp_path / "weights"))
    proc = start_dist("--env", "cartpole", "--max-frames", "5000", cwd=tmp_path, env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert_steps_average_one_gradient_per_worker_at_their_weights(tmp_path / "weights", "0", ["1", "2"])


@needs_proc
def test_a3c_dist_crash_in_a_worker_stops_every_rank_and_names_it(tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist("--env", "cartpole", cwd=tmp_path, env=hooked_env(tmp_path, DIST_CRASH_HOOK, tagged_env(tag)))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "RuntimeError: injected crash" in err and "local_rank: 1" in err   # torchrun names the rank
    assert "frames" in summary(out)                                         # rank 0's summary
    assert_none_left(tag)


@needs_proc
def test_a3c_dist_death_of_rank_0_stops_every_worker_within_seconds(tmp_path):
    tag = uuid.uuid4().hex
    proc = start_dist("--env", "cartpole", cwd=tmp_path, env=tagged_env(tag))
    assert proc.stdout.readline().strip()              # a progress line: the run is under way
    (rank_0,) = [pid for pid in tagged_pids(tag) if environ_has(pid, "RANK=0") and environ_has(pid, "LOCAL_RANK=0")]
    os.kill(rank_0, signal.SIGKILL)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode != 0
    assert re.search(r"rank\s*:\s*0 \(local_rank", err)  # torchrun names the failed rank;
    assert err.count("lost rank 0") <= 2                # a worker that notices before torchrun stops
    assert 'a3c_dist.py", line' not in err              # it says so in one line, with no traceback
    assert_none_left(tag)
