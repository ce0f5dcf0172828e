"""Checkpoints and --resume: what a checkpoint holds comes back, a stop never cuts a step, a kill
mid-write leaves the checkpoint before it, a bad --resume stops with one line. The slow set stops
each script on CartPole with SIGTERM, resumes it and sees it solve."""

import copy
import errno
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
import types

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn as nn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import common
import dqn_compile
import runs
from conftest import BUDGET, DEVICES, REPO, hook, hooked_env, our_lines

SCRIPTS = ["dqn_baseline", "dqn_fast", "dqn_mp", "dqn_compile", "a3c_data", "a3c_grad"]
SPACE = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
PARAMS = types.SimpleNamespace(gamma=0.99, learning_rate=0.1)  # a run's hyperparameters


def fake_args(resume=None, segment=0):
    return types.SimpleNamespace(
        script="test",
        env="pong",
        name="unit",
        max_frames=None,
        bf16=False,
        cuda=False,
        resume=resume,
        checkpoint_minutes=10,
        seed=0,
        segment=segment,
        folder=resume or os.path.join("runs", "test-pong-unit"),
    )


def fake_env(shape=(4,)):
    return types.SimpleNamespace(
        single_observation_space=gym.spaces.Box(0, 1, shape),
        single_action_space=gym.spaces.Discrete(3),
    )


def transitions(count, seed):
    """count Pong-shaped one-step transitions of one env's random-frame episodes, each 7th terminal:
    a state shares all but its newest frame with the next, an episode's first is zero-padded."""
    rng = np.random.default_rng(seed)

    def frame():
        return rng.integers(0, 256, (1, *SPACE.shape[1:]), np.uint8)

    played, state = [], np.concatenate([np.zeros((3, *SPACE.shape[1:]), np.uint8), frame()])
    for i in range(count):
        last = np.concatenate([state[1:], frame()])
        played.append(
            common.ExperienceFirstLast(
                state, int(rng.integers(6)), float(rng.normal()), None if i % 7 == 6 else last, 1
            )
        )
        state = (
            np.concatenate([np.zeros((3, *SPACE.shape[1:]), np.uint8), frame()])
            if i % 7 == 6
            else last
        )
    return played


def trained(seed):
    """A net, its target net and Adam after three steps, from seed."""
    torch.manual_seed(seed)
    net = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        net(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
    return net, copy.deepcopy(net), optimizer


def checkpoint_in(folder):
    """The checkpoint that the test runs here wrote in folder, read as --resume reads it."""
    return runs.read_checkpoint(runs.ArgumentParser(), folder, "test")


@pytest.fixture
def stop_handler():
    """SIGTERM and SIGINT as a script's setup() sets them (conftest puts back the tests' own)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, runs.request_stop)
    runs.stop_signal = None
    yield
    runs.stop_signal = None


# ---------------------------------------------------------------- what a checkpoint holds
def test_restore_brings_back_weights_optimizer_buffer_tracker_and_counters_and_lets_the_file_go(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs, "LOG_EVERY", 1)  # every loss logged, and kept for the mean
    net, tgt_net, optimizer = trained(seed=0)
    buffer = common.ReplayBuffer(50, SPACE, seed=0)
    for exp in transitions(80, seed=0):  # the ring wraps: position 30 of 50
        buffer.append(exp)
    buffer.sample(4)  # the sampling generator has moved
    tracker = runs.RewardTracker(fake_args(), net, fake_env())
    contents = dict(
        net=net,
        tgt_net=tgt_net,
        optimizer=optimizer,
        buffer=buffer,
        tracker=tracker,
        counts=runs.Counters(train_steps=7),
    )
    with runs.Run(fake_args(), PARAMS, tracker, contents):
        tracker.update(600, [(-20.0, 900), (-19.0, 800)])
        for loss in (0.5, 0.25):
            tracker.record_step(loss=loss)
        tracker.update(1234, [(-18.0, 700)])
    expected = buffer.rng.integers(0, 10**9, 3).tolist()  # the sampling generator's next draws

    torch.manual_seed(99)
    np.random.seed(99)
    net2, tgt_net2, optimizer2 = trained(seed=1)
    buffer2 = common.ReplayBuffer(50, SPACE, seed=1)
    tracker2 = runs.RewardTracker(
        fake_args(resume=tracker.args.folder, segment=1), net2, fake_env()
    )
    contents2 = dict(
        net=net2,
        tgt_net=tgt_net2,
        optimizer=optimizer2,
        buffer=buffer2,
        tracker=tracker2,
        counts=runs.Counters(train_steps=0),
    )
    checkpoint = checkpoint_in(tracker.args.folder)
    runs.restore(tracker2.args, checkpoint, contents2)
    assert checkpoint == {}  # its tensors, and with them the file's mapping, are let go

    for a, b in [(net, net2), (tgt_net, tgt_net2)]:
        for name, tensor in a.state_dict().items():
            assert torch.equal(tensor, b.state_dict()[name]), name
    state, state2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    for i in state:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][key], state2[i][key]), (i, key)
    assert (buffer2.pos, buffer2.size) == (30, 50)
    for name in common.ReplayBuffer.ARRAYS:
        assert np.array_equal(getattr(buffer, name), getattr(buffer2, name)), name
    # Each transition's frames are alike.
    assert np.array_equal(buffer.frames[buffer.index.rows], buffer2.frames[buffer2.index.rows])
    assert (tracker2.frames, tracker2.steps, tracker2.seconds) == (1234, 2, tracker.seconds)
    assert tracker2.rewards == [-20.0, -19.0, -18.0] and tracker2.losses == [0.5, 0.25]
    assert contents2["counts"].train_steps == 7
    assert buffer2.rng.integers(0, 10**9, 3).tolist() == expected


def test_a_resumed_tracker_keeps_its_best_mean_for_best_pt_and_its_window_of_losses(
    tmp_path, monkeypatch
):
    # a first segment: 100 games of 10 make best.pt, two losses logged; the second: a worse window
    # (mean 9.99) leaves best.pt as it was, and the loss logged next averages with the first two
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs, "LOG_EVERY", 1)
    net = nn.Linear(4, 3)
    tracker = runs.RewardTracker(fake_args(), net, fake_env())
    with runs.Run(fake_args(), PARAMS, tracker, dict(net=net, tracker=tracker)):
        tracker.update(100, [(10.0, 5)] * 100)
        for loss in (1.0, 3.0):
            tracker.record_step(loss=loss)
    folder = tracker.args.folder
    best = (tmp_path / folder / "best.pt").read_bytes()
    resumed = fake_args(resume=folder, segment=1)
    tracker = runs.RewardTracker(resumed, net, fake_env())
    runs.restore(resumed, checkpoint_in(folder), dict(net=net, tracker=tracker))
    with torch.no_grad():
        net.weight += 1  # a network best.pt must not take
    with runs.Run(resumed, PARAMS, tracker, dict(net=net, tracker=tracker)):
        tracker.update(200, [(9.0, 5)])
        tracker.record_step(loss=5.0)
    assert (tmp_path / folder / "best.pt").read_bytes() == best
    assert scalars(tmp_path / folder)["train/avg_loss"] == [(100, 1.0), (100, 2.0), (200, 3.0)]


def test_a_checkpoint_holds_only_the_filled_part_of_the_buffer_each_frame_once(tmp_path):
    buffer = common.ReplayBuffer(1000, SPACE)  # a store of 1,189 frames of 7,056 bytes
    for exp in transitions(10, seed=0):  # 11 frames and the zeros, in the store's first slots
        buffer.append(exp)
    path = str(tmp_path / "buffer.pt")
    runs.save_whole(buffer.state_dict(), path)
    assert os.path.getsize(path) < 12 * 7_056 + 50_000


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_buffer_comes_back_where_it_was_and_samples_what_it_held(device, tmp_path):
    device = torch.device(device)
    buffer = dqn_compile.DeviceReplayBuffer(50, SPACE, device)
    for step in range(0, 80, 3):  # a step of 3 envs at a time; the ring wraps
        buffer.extend(transitions(80, seed=0)[step : step + 3])
    path = str(tmp_path / "buffer.pt")
    runs.save_whole(buffer.state_dict(), path)
    # The file holds a frame a transition, and an episode's last.
    assert os.path.getsize(path) < (50 + 50 // 7 + 5) * 7_056 + 50_000
    restored = dqn_compile.DeviceReplayBuffer(50, SPACE, device)
    restored.load_state_dict(torch.load(path, mmap=True, weights_only=True))
    assert restored.count == buffer.count == 80 and restored.size.item() == 50
    idx = torch.arange(50, device=device)
    for a, b in zip(buffer.transitions(idx), restored.transitions(idx)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stored", [30, 81], ids=["filling", "wrapped"])
@pytest.mark.parametrize("kind", ["ReplayBuffer", "DeviceReplayBuffer"])
def test_a_restored_buffer_stores_new_frames_past_wraps_and_reads_what_a_buffer_never_stopped_reads(
    kind, stored, tmp_path
):
    # Transitions of 3 envs' steps into a ring of 50, saved, loaded and saved again byte for byte;
    # then up to 200 (more wraps) into the restored buffer and one never stopped: every transition
    # alike at each step.
    def make():
        if kind == "ReplayBuffer":
            return common.ReplayBuffer(50, SPACE)
        return dqn_compile.DeviceReplayBuffer(50, SPACE, torch.device("cpu"))

    def store(buffer, exps):
        if kind == "ReplayBuffer":
            for exp in exps:
                buffer.append(exp)
        else:
            buffer.extend(exps)

    played, never_stopped, saved = transitions(200, seed=0), make(), make()
    for step in range(0, stored, 3):
        store(never_stopped, played[step : step + 3])
        store(saved, played[step : step + 3])
    runs.save_whole(saved.state_dict(), str(tmp_path / "saved.pt"))
    restored = make()
    restored.load_state_dict(torch.load(tmp_path / "saved.pt", mmap=True, weights_only=True))
    runs.save_whole(restored.state_dict(), str(tmp_path / "again.pt"))
    assert (tmp_path / "saved.pt").read_bytes() == (tmp_path / "again.pt").read_bytes()
    for step in range(stored, 200, 3):
        store(never_stopped, played[step : step + 3])
        store(restored, played[step : step + 3])
        every = np.arange(len(restored))
        for expected, got in zip(never_stopped.transitions(every), restored.transitions(every)):
            assert np.array_equal(np.asarray(expected), np.asarray(got))


def test_set_capturable_makes_a_restored_gpu_state_step_on_the_cpu():
    net, _, optimizer = trained(seed=0)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group["capturable"] = True  # as dynamo leaves a state saved on a GPU
    optimizer.load_state_dict(state)
    dqn_compile.set_capturable(optimizer, torch.device("cpu"))
    assert not optimizer.param_groups[0]["capturable"]
    net(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    assert optimizer.state[net.weight]["step"].item() == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_resumed_dqn_compile_step_on_cuda_replays_its_graph_with_no_recompile_or_skip(tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    device = torch.device("cuda")
    path = str(tmp_path / "state.pt")
    for segment in range(2):
        torch.manual_seed(segment)
        net = dqn_compile.DQN(SPACE.shape, 6).to(device)
        tgt_net = copy.deepcopy(net)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
        buffer = dqn_compile.DeviceReplayBuffer(200, SPACE, device)
        saved = dict(net=net, tgt_net=tgt_net, optimizer=optimizer, buffer=buffer)
        if segment:
            for name, state in torch.load(path, map_location="cpu", weights_only=True).items():
                saved[name].load_state_dict(state)
        else:
            buffer.extend(transitions(100, seed=0))
        dqn_compile.set_capturable(optimizer, device)
        step = dqn_compile.compile_train_step(buffer, net, tgt_net, optimizer, 32, 0.99)
        with torch._dynamo.config.patch(error_on_recompile=segment == 1):
            for _ in range(5):
                loss = step()
        assert np.isfinite(loss.item())
        runs.save_whole({name: obj.state_dict() for name, obj in saved.items()}, path)
        torch._dynamo.reset()
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


# ---------------------------------------------------------------- a stop never cuts a step
def test_a_sigterm_mid_step_stops_after_the_step_with_all_of_it_in_the_checkpoint(
    tmp_path, monkeypatch, stop_handler
):
    monkeypatch.chdir(tmp_path)
    net = nn.Linear(4, 3)
    tracker = runs.RewardTracker(fake_args(), net, fake_env())
    with runs.Run(fake_args(), PARAMS, tracker, dict(net=net, tracker=tracker)) as run:
        for frames in range(1, 100):
            tracker.update(frames, [])
            run.save_checkpoint_if_due()
            if run.should_stop():
                break
            with torch.no_grad():  # a step that writes the weight, then the bias
                net.weight += 1
                if frames == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                net.bias += 1
            tracker.record_step(loss=0.0)
    assert run.exit_code == 143 and tracker.frames == 4
    checkpoint = torch.load(os.path.join(tracker.args.folder, runs.CHECKPOINT), weights_only=True)
    assert checkpoint["tracker"]["frames"] == 4 and checkpoint["tracker"]["steps"] == 3
    assert torch.equal(checkpoint["net"]["weight"], net.weight)
    # The step that the signal landed in is whole.
    assert torch.equal(checkpoint["net"]["bias"], net.bias)


# --------------------------------------------------- a stop's checkpoint, its events, its exit code
def test_a_resumed_segment_drops_the_events_that_a_killed_run_logged_past_its_checkpoint(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    net = nn.Linear(4, 3)
    tracker = runs.RewardTracker(fake_args(), net, fake_env())
    run = runs.Run(fake_args(), PARAMS, tracker, dict(net=net, tracker=tracker))
    run.__enter__()
    for frames in (10, 20):
        tracker.update(frames, [(-21.0 + frames, 1)])
    run.save_checkpoint()
    for frames in (25, 30):  # logged after the checkpoint, then the run is killed:
        tracker.update(frames, [(-21.0 + frames, 1)])  # no stop, no last checkpoint
    tracker.writer.flush()

    folder = tracker.args.folder
    resumed = runs.RewardTracker(fake_args(resume=folder, segment=1), net, fake_env())
    runs.restore(resumed.args, checkpoint_in(folder), dict(net=net, tracker=resumed))
    with runs.Run(
        fake_args(resume=folder, segment=1), PARAMS, resumed, dict(net=net, tracker=resumed)
    ):
        for frames in (24, 28):
            resumed.update(frames, [(-21.0 + frames, 1)])
    events = EventAccumulator(folder)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("episodes/reward")] == [
        (10, -11.0),
        (20, -1.0),
        (24, 3.0),
        (28, 7.0),
    ]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("solved", [False, True])
def test_a_signalled_stop_whose_checkpoint_fails_says_so_and_exits_with_code_2(
    signum, solved, tmp_path, monkeypatch, stop_handler, capsys
):
    monkeypatch.chdir(tmp_path)
    tracker = runs.RewardTracker(fake_args(), nn.Linear(4, 3), fake_env())

    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with runs.Run(fake_args(), PARAMS, tracker, dict(tracker=tracker)) as run:
        tracker.solved = solved
        os.kill(os.getpid(), signum)
        monkeypatch.setattr(runs, "save_whole", full_disk)
    out, err = capsys.readouterr()
    assert run.exit_code == 2 and json.loads(out.splitlines()[-1])["solved"] == solved
    assert our_lines(err) == [
        "test.py: error: cannot write runs/test-pong-unit/checkpoint.pt (No space left on device)"
    ]


def test_no_periodic_checkpoint_is_written_once_a_signal_has_asked_the_run_to_stop(
    tmp_path, monkeypatch, stop_handler
):
    monkeypatch.chdir(tmp_path)
    args = dict(vars(fake_args()), checkpoint_minutes=1e-6)  # due at every question
    tracker = runs.RewardTracker(types.SimpleNamespace(**args), nn.Linear(4, 3), fake_env())
    written = []
    with runs.Run(types.SimpleNamespace(**args), PARAMS, tracker, dict(tracker=tracker)) as run:
        monkeypatch.setattr(run, "save_checkpoint", lambda: written.append(tracker.frames))
        for frames in range(1, 6):
            time.sleep(0.001)
            tracker.update(frames, [])
            if frames == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            run.save_checkpoint_if_due()
    assert written == [1, 2, 5]  # none at frames 3 and 4, after the signal: the stop's own at 5


# ---------------------------------------------------------------- a bad --resume
def run_script(script, *args, cwd, env=None, timeout=300):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, f"{script}.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


def stop_short_run(cwd, script, *args):
    """The folder of a short CartPole run of script in cwd, stopped at --max-frames with its
    checkpoint; made in this process, whose signal handlers the run's end leaves as they were."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    path = os.path.join(REPO, f"{script}.py")
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", [path, "--env", "cartpole", *args])
        runpy.run_path(path, run_name="__main__")
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    assert exit_info.value.code == 0
    (folder,) = (cwd / "runs").iterdir()
    return folder


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A dqn_baseline CartPole run stopped at 300 frames."""
    return stop_short_run(tmp_path_factory.mktemp("stopped"), "dqn_baseline", "--max-frames", "300")


@pytest.fixture(scope="module")
def stopped_a3c_run(tmp_path_factory):
    """An a3c_grad CartPole run of one worker, stopped at 300 frames."""
    cwd = tmp_path_factory.mktemp("stopped_a3c")
    return stop_short_run(cwd, "a3c_grad", "--max-frames", "300", "--processes", "1", "--envs", "2")


def listing(folder):
    return {
        entry.name: (entry.stat().st_size, entry.stat().st_mtime_ns) for entry in folder.iterdir()
    }


FORMAT = runs.CHECKPOINT_FORMAT
BAD_RESUME = [
    ("dqn_fast", [], f"is not a checkpoint of dqn_fast, format {FORMAT}"),
    ("dqn_baseline", ["--bf16"], "--bf16 True contradicts the run in"),
    ("dqn_baseline", ["--env", "pong"], "--env pong contradicts the run in"),
    ("dqn_baseline", ["--seed", "5"], "--seed 5 contradicts the run in"),
]


@pytest.mark.parametrize("script, args, message", BAD_RESUME)
def test_a_resume_that_contradicts_the_checkpoint_stops_with_one_line_and_changes_nothing(
    script, args, message, stopped_run, in_process, capsys
):
    before = listing(stopped_run)
    assert in_process(script, "--resume", str(stopped_run), *args) == 2
    err = capsys.readouterr().err
    (line,) = our_lines(err)
    assert line.startswith(f"{script}.py: error: ") and message in line
    assert listing(stopped_run) == before


@pytest.mark.parametrize("damage", ["none", "truncated", "not a checkpoint"])
def test_a_folder_without_a_whole_checkpoint_stops_with_one_line_and_changes_nothing(
    damage, stopped_run, tmp_path, in_process, capsys
):
    data = (stopped_run / runs.CHECKPOINT).read_bytes()
    if damage == "truncated":
        (tmp_path / runs.CHECKPOINT).write_bytes(data[: len(data) // 2])
    elif damage == "not a checkpoint":
        (tmp_path / runs.CHECKPOINT).write_bytes(b"hello")
    before = listing(tmp_path)
    assert in_process("dqn_baseline", "--resume", str(tmp_path)) == 2
    err = capsys.readouterr().err
    expected = (
        "does not load (No such file or directory)"
        if damage == "none"
        else "does not load (RuntimeError)"
    )
    (line,) = our_lines(err)
    assert line.startswith("dqn_baseline.py: error: --resume: ") and expected in line
    assert listing(tmp_path) == before


def test_a_checkpoint_of_another_format_stops_with_one_line_and_changes_nothing(
    stopped_run, tmp_path, in_process, capsys
):
    checkpoint = torch.load(stopped_run / runs.CHECKPOINT, weights_only=True)
    del checkpoint["format"]  # as the code before formats wrote them
    torch.save(checkpoint, tmp_path / runs.CHECKPOINT)
    before = listing(tmp_path)
    assert in_process("dqn_baseline", "--resume", str(tmp_path)) == 2
    (line,) = our_lines(capsys.readouterr().err)
    assert line.startswith("dqn_baseline.py: error: --resume: ") and line.endswith(
        f"is not a checkpoint of dqn_baseline, format {FORMAT}: go on with the code that wrote it"
    )
    assert listing(tmp_path) == before


class Made(Exception):
    """Raised by a stand-in for the tracker: the script got that far."""


def options_at_start(monkeypatch):
    """The options of the next run in this process, stopped where it makes its tracker (Made)."""
    options = {}

    def tracker(args, *rest, **kwargs):
        options.update(vars(args))
        raise Made

    monkeypatch.setattr(runs, "RewardTracker", tracker)
    return options


def test_resume_takes_the_runs_options_and_a_new_frame_budget(
    stopped_run, run_main, monkeypatch, stop_handler
):
    options = options_at_start(monkeypatch)
    with pytest.raises(Made):
        run_main("dqn_baseline", "--resume", str(stopped_run), "--max-frames", "900")
    assert options["env"] == "cartpole" and options["max_frames"] == 900 and not options["bf16"]
    assert options["seed"] == runs.SEGMENT_SEED  # seed 0's first resumed segment plays new games
    with pytest.raises(Made):
        run_main("dqn_baseline", "--resume", str(stopped_run))
    assert options["max_frames"] == 300  # the budget the run was last given


def test_a_second_resume_plays_with_the_runs_seed_offset_twice(
    stopped_run, tmp_path, run_main, monkeypatch, stop_handler
):
    folder = tmp_path / "run"
    shutil.copytree(stopped_run, folder)
    assert run_main("dqn_baseline", "--resume", str(folder), "--max-frames", "400") == 0
    checkpoint = torch.load(folder / runs.CHECKPOINT, weights_only=True)
    # The checkpoint keeps the run's seed, not the segment's.
    assert checkpoint["segments"] == 2 and checkpoint["options"]["seed"] == 0
    options = options_at_start(monkeypatch)
    with pytest.raises(Made):
        run_main("dqn_baseline", "--resume", str(folder), "--max-frames", "500")
    assert options["segment"] == 2 and options["seed"] == 2 * runs.SEGMENT_SEED


# ---------------------------------------------------------------- what a learner edits
def learners_copy(tmp_path, script, old, new):
    """A learner's copy of script, in tmp_path, with its one line old made new."""
    source = open(os.path.join(REPO, f"{script}.py")).read()
    assert source.count(old) == 1
    path = tmp_path / f"{script}.py"
    path.write_text(source.replace(old, new))
    return path


def hyperparameter_tables(folder):
    """(frames, rows) of each hyperparameter table in the run's events."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return [
        (event.step, event.tensor_proto.string_val[0].decode().splitlines())
        for event in events.Tensors("hyperparameters/text_summary")
    ]


def test_a_run_writes_its_hyperparameters_in_its_events_and_its_checkpoint(stopped_run):
    ((frames, rows),) = hyperparameter_tables(stopped_run)
    assert frames == 0 and rows[:2] == ["|name|value|", "|-|-|"]
    assert (
        "|gamma|0.99|" in rows and "|learning_rate|0.001|" in rows and "|target_sync|200|" in rows
    )
    checkpoint = torch.load(stopped_run / runs.CHECKPOINT, weights_only=True)
    assert checkpoint["hyperparams"] == dict(
        runpy.run_path(os.path.join(REPO, "dqn_baseline.py"))["CARTPOLE"]
    )


@pytest.mark.parametrize(
    "script, old, new, named",
    [
        (
            "dqn_baseline",
            "    target_sync=200,",
            "    target_sync=300,",
            "target_sync 300 (the run's 200)",
        ),
        (
            "a3c_grad",
            "    entropy_beta=0.01,",
            "    entropy_beta=0.02,",
            "entropy_beta 0.02 (the run's 0.01)",
        ),
    ],
)
def test_a_resume_after_a_hyperparameter_edit_stops_with_one_line_naming_it(
    script, old, new, named, stopped_run, stopped_a3c_run, tmp_path, in_process, capsys
):
    folder = stopped_run if script == "dqn_baseline" else stopped_a3c_run
    before = listing(folder)
    assert in_process(learners_copy(tmp_path, script, old, new), "--resume", str(folder)) == 2
    (line,) = our_lines(capsys.readouterr().err)
    assert line == (
        f"{script}.py: error: --resume: the script's hyperparameters differ from the run's in "
        f"{folder}: {named}; --new-hyperparams goes on with the script's"
    )
    assert listing(folder) == before


def test_new_hyperparams_goes_on_with_the_scripts_values_adams_learning_rate_too(
    stopped_run, tmp_path, run_main, stop_handler
):
    folder = tmp_path / "run"
    shutil.copytree(stopped_run, folder)
    edited = learners_copy(
        tmp_path, "dqn_baseline", "    learning_rate=1e-3,", "    learning_rate=2e-3,"
    )
    eps = "    adam_eps=1.5e-4,"
    edited.write_text(edited.read_text().replace(eps, "    adam_eps=1e-3,"))
    assert (
        run_main(edited, "--resume", str(folder), "--new-hyperparams", "--max-frames", "1100") == 0
    )
    checkpoint = torch.load(folder / runs.CHECKPOINT, weights_only=True)
    assert checkpoint["hyperparams"]["learning_rate"] == 2e-3
    # Adam's state (its moments, after training steps) with the script's learning rate.
    groups = checkpoint["optimizer"]["param_groups"]
    assert [(group["lr"], group["eps"]) for group in groups] == [(2e-3, 1e-3)]
    assert checkpoint["optimizer"]["state"] and checkpoint["counts"]["train_steps"] > 0
    (first, first_rows), (second, second_rows) = hyperparameter_tables(folder)
    assert (first, second) == (0, 300)
    assert "|learning_rate|0.001|" in first_rows and "|learning_rate|0.002|" in second_rows


def test_a_count_added_to_the_scripts_counters_resumes_with_no_other_line(
    tmp_path, run_main, stop_handler, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    edited = learners_copy(
        tmp_path,
        "dqn_baseline",
        "    counts = runs.Counters(train_steps=0)",
        "    counts = runs.Counters(train_steps=0, loop_steps=0)",
    )
    loop = "        for exps in exp_source:\n"
    edited.write_text(
        edited.read_text().replace(loop, loop + "            counts.loop_steps += 1\n")
    )
    assert run_main(edited, "--env", "cartpole", "--max-frames", "300") == 0
    (folder,) = (tmp_path / "runs").iterdir()
    first = torch.load(folder / runs.CHECKPOINT, weights_only=True)["counts"]["loop_steps"]
    assert run_main(edited, "--resume", str(folder), "--max-frames", "500") == 0
    second = torch.load(folder / runs.CHECKPOINT, weights_only=True)["counts"]["loop_steps"]
    # A step of the loop plays a frame, or only resets the env after an episode's end.
    assert 300 <= first < 400 and second - first >= 200 and second >= 500
    assert our_lines(capsys.readouterr().err) == []


def test_new_hyperparams_with_another_replay_size_stops_with_one_line(
    stopped_run, tmp_path, run_main, capsys
):
    edited = learners_copy(
        tmp_path, "dqn_baseline", "    replay_size=10_000,", "    replay_size=20_000,"
    )
    before = listing(stopped_run)
    assert run_main(edited, "--resume", str(stopped_run), "--new-hyperparams") == 2
    (line,) = our_lines(capsys.readouterr().err)
    assert line == (
        "dqn_baseline.py: error: --resume: the checkpoint's buffer does not fit this script's "
        "(10000 transitions, where the script has 20000)"
    )
    assert listing(stopped_run) == before


def test_new_hyperparams_without_resume_stops_with_one_line(in_process, capsys):
    assert in_process("dqn_baseline", "--new-hyperparams") == 2
    (line,) = our_lines(capsys.readouterr().err)
    assert line == "dqn_baseline.py: error: --new-hyperparams goes with --resume"


@pytest.mark.parametrize("damage", ["no counts", "counts of other names", "a net of another shape"])
def test_a_checkpoint_that_lacks_an_entry_or_holds_another_shape_stops_with_one_line(
    damage, stopped_run, tmp_path, run_main, capsys
):
    checkpoint = torch.load(stopped_run / runs.CHECKPOINT, weights_only=True)
    if damage == "no counts":  # as an edit of checkpoint_contents makes it
        del checkpoint["counts"]
        expected = "the checkpoint holds no counts: go on with the code that wrote it"
    elif damage == "counts of other names":
        checkpoint["counts"] = {"steps": 0}
        expected = (
            "the checkpoint's counts does not fit this script's "
            "(counts steps, where the script has train_steps)"
        )
    else:
        checkpoint["net"]["out.weight"] = torch.zeros(3, 128)
        expected = (
            "the checkpoint's net does not fit this script's (Error(s) in loading state_dict for "
            "DQN: size mismatch for out.weight: copying a param with shape torch.Size([3, 128])"
        )
    torch.save(checkpoint, tmp_path / runs.CHECKPOINT)
    before = listing(tmp_path)
    assert run_main("dqn_baseline", "--resume", str(tmp_path)) == 2
    (line,) = our_lines(capsys.readouterr().err)
    assert line.startswith(f"dqn_baseline.py: error: --resume: {expected}")
    assert listing(tmp_path) == before


def test_a_number_in_checkpoint_contents_is_refused_before_the_loop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = runs.RewardTracker(fake_args(), nn.Linear(4, 3), fake_env())
    with pytest.raises(TypeError, match=r"\['train_steps'\] has no state_dict: use runs.Counters"):
        runs.Run(fake_args(), PARAMS, tracker, dict(tracker=tracker, train_steps=0))


# ---------------------------------------------------------------- a kill mid-write


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_leaves_the_last_one_and_resume_goes_on_from_it(tmp_path):
    env = hooked_env(tmp_path, hook("slow_checkpoint_write"))
    code, _, err = run_script(
        "dqn_baseline", "--env", "cartpole", "--max-frames", "2000", cwd=tmp_path, env=env
    )
    assert code == 0, err
    (folder,) = (tmp_path / "runs").iterdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO, "dqn_baseline.py"),
            "--resume",
            str(folder),
            "--max-frames",
            "4000",
        ],
        cwd=tmp_path,
        env=dict(env, RL_SLOW_CHECKPOINT="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("writing"):
            break
    proc.kill()  # SIGKILL, mid-write
    proc.wait()
    assert (folder / (runs.CHECKPOINT + ".tmp")).exists()
    assert torch.load(folder / runs.CHECKPOINT, weights_only=True)["tracker"]["frames"] == 2000
    code, out, err = run_script(
        "dqn_baseline", "--resume", str(folder), "--max-frames", "3000", cwd=tmp_path, env=env
    )
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["frames"] >= 3000 and result["episodes"] > 0
    assert not (folder / (runs.CHECKPOINT + ".tmp")).exists()


# ------------------------------------------------------------ each script: stopped, resumed, solved
def scalars(folder):
    """{tag: [(step, value)]} as TensorBoard reads the folder: with what a purge drops, dropped."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


STOP_AT = {
    "dqn_baseline": 6_000,
    "dqn_fast": 6_000,
    "dqn_mp": 6_000,
    "dqn_compile": 6_000,
    "a3c_data": 60_000,
    "a3c_grad": 60_000,
    "a3c_dist": 60_000,
}


def assert_same(saved, restored, where):
    """Two state_dicts (nested dicts and lists of tensors and plain values) hold equal values."""
    if isinstance(saved, dict):
        assert saved.keys() == restored.keys(), where
        for key in saved:
            assert_same(saved[key], restored[key], f"{where}/{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(restored), where
        for i, (a, b) in enumerate(zip(saved, restored)):
            assert_same(a, b, f"{where}/{i}")
    elif isinstance(saved, torch.Tensor):
        assert torch.equal(saved.cpu(), restored.cpu()), where
    else:
        assert saved == restored, where


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_stopped_by_sigterm_resumes_where_it_stopped_and_solves(script, tmp_path):
    """Also each script's fp32 CartPole learning: both segments solve within the learning budget."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, f"{script}.py"), "--env", "cartpole", "--seed", "1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # progress lines: "frames: done ..."
        if int(line.split(":")[0]) >= STOP_AT[script]:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    # There are no library's warnings.
    assert proc.returncode == 143 and our_lines(err) == err.splitlines(), err
    stopped = json.loads(out.strip().splitlines()[-1])
    (folder,) = (tmp_path / "runs").iterdir()
    checkpoint = torch.load(folder / runs.CHECKPOINT, weights_only=True)
    assert (
        checkpoint["tracker"]["frames"] == stopped["frames"]
        and len(checkpoint["tracker"]["rewards"]) == stopped["episodes"]
    )
    assert checkpoint["tracker"]["seconds"] == pytest.approx(stopped["seconds"], abs=0.1)
    # The count the script plays on from: its own (dqn_mp's, the A3C scripts') or exp_source's.
    frames = checkpoint["exp_source"] if "exp_source" in checkpoint else checkpoint["counts"]
    assert frames["frames"] == stopped["frames"]
    before = scalars(folder)

    env = dict(
        hooked_env(tmp_path, hook("record_restored")),
        RL_TEST_RESTORED=str(tmp_path / "restored.pt"),
    )
    code, out, err = run_script(
        script, "--resume", str(folder), "--max-frames", str(BUDGET[script]), cwd=tmp_path, env=env
    )
    assert code == 0 and our_lines(err) == err.splitlines(), err
    # The restored contents are as the script has them when its loop begins.
    restored = torch.load(tmp_path / "restored.pt", weights_only=True)
    # weights, optimizer, buffer, experience source, the tracker's record, the script's counters
    assert_same({name: checkpoint[name] for name in restored}, restored, "restored")
    assert set(checkpoint) - set(restored) == {
        "format",
        "script",
        "segments",
        "options",
        "hyperparams",
    }
    result = json.loads(out.strip().splitlines()[-1])
    assert result["solved"] and result["mean_reward"] >= common.STOP_REWARDS["cartpole"], result
    assert result["frames"] > stopped["frames"] and result["episodes"] > stopped["episodes"]
    assert result["seconds"] > stopped["seconds"]
    after = scalars(folder)
    for tag, points in after.items():
        steps = [step for step, _ in points]
        assert steps == sorted(steps), tag  # no curve doubles back
    minutes = [value for _, value in after["episodes/minutes"]]
    assert minutes == sorted(minutes) and minutes[-1] <= result["seconds"] / 60 + 0.01
    assert len(after["episodes/reward"]) == result["episodes"] >= len(before["episodes/reward"])


def torchrun(ranks, *args, cwd):
    """a3c_dist.py under torchrun, as a user starts it (with OMP_NUM_THREADS as torchrun sets it,
    given: torchrun's own notice that it sets it is not printed)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            os.path.join(REPO, "a3c_dist.py"),
            *args,
        ],
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a3c_dist_stopped_by_sigterm_resumes_from_rank_0s_checkpoint_with_its_ranks_only(tmp_path):
    """Also a3c_dist's CartPole learning in fp32 (test_scripts: with --bf16 across two agents)."""
    proc = torchrun(3, "--env", "cartpole", "--seed", "1", cwd=tmp_path)
    for line in proc.stdout:
        if int(line.split(":")[0]) >= STOP_AT["a3c_dist"]:
            break
    proc.send_signal(signal.SIGTERM)  # to torchrun, which sends it on to every rank
    out, err = proc.communicate(timeout=60)
    stopped = json.loads(out.strip().splitlines()[-1])
    (folder,) = (tmp_path / "runs").iterdir()
    assert (
        torch.load(folder / runs.CHECKPOINT, weights_only=True)["tracker"]["frames"]
        == stopped["frames"]
    )

    proc = torchrun(2, "--resume", str(folder), cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and f"--resume: the run in {folder} has 3 ranks, not 2" in err
    proc = torchrun(
        3, "--resume", str(folder), "--max-frames", str(BUDGET["a3c_dist"]), cwd=tmp_path
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and our_lines(err) == err.splitlines(), err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["solved"] and result["mean_reward"] >= common.STOP_REWARDS["cartpole"], result
    assert result["frames"] > stopped["frames"] and result["episodes"] > stopped["episodes"]
