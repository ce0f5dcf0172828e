"""What each script's loop does with its own counters, in seconds, in this process where it can: the
target net syncs at whole-run training steps across a resume, every DQN script acts at the epsilon
of the frames played (a resumed segment's first step too), logs the chapter's metrics and its
network's health (telling once of a dead layer) and gives up torch's threads but one while another
process shares the cores, a resumed A3C run counts its frames on from the checkpoint's, a resumed
run neither holds nor maps its checkpoint file, and a periodic checkpoint that cannot be written
costs one line."""

import errno
import itertools
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import a3c_data
import a3c_dist as a3c_dist_script
import a3c_grad
import common
import dqn_compile
import runs
from conftest import DQN_SCRIPTS, REPO, free_port, hook, hooked_env, our_lines, summary

ENVS = {"dqn_baseline": 1, "dqn_fast": 3, "dqn_mp": 3, "dqn_compile": 3}  # frames a training step
# Every DQN script's CartPole hyperparameters: training from frame 1,000, a target sync every 200
# training steps (tests/test_script_parts.py checks they are the same).
CARTPOLE = types.SimpleNamespace(**dqn_compile.CARTPOLE)
CLIP_GRAD = {
    name: module.CARTPOLE["clip_grad"]
    for name, module in [
        ("a3c_data", a3c_data),
        ("a3c_grad", a3c_grad),
        ("a3c_dist", a3c_dist_script),
    ]
}


@pytest.fixture
def in_tmp(monkeypatch, tmp_path):
    """Runs made here go to tmp_path/runs; dqn_compile runs eagerly (its compiler takes 20 s on 2
    cores; what these tests check is its loop, which the compiler does not change). The threads that
    a script's main process gives torch are given back."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


@pytest.fixture
def training(monkeypatch):
    """What the training steps of this process did: .step, Adam's whole-run step count (restored
    with it) after the latest step; .syncs, that count at each target net sync."""
    record = types.SimpleNamespace(step=None, syncs=[])
    adam_step, load = torch.optim.Adam.step, nn.Module.load_state_dict

    def counting_step(self, *args, **kwargs):
        result = adam_step(self, *args, **kwargs)
        record.step = int(self.state[self.param_groups[0]["params"][0]]["step"])
        return result

    def recording_load(self, *args, **kwargs):
        if record.step is not None:  # a sync, not a restore before this segment's first step
            record.syncs.append(record.step)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", counting_step)
    monkeypatch.setattr(nn.Module, "load_state_dict", recording_load)
    return record


def the_run(where):
    (folder,) = (where / "runs").iterdir()
    return folder


# ---------------------------------------------------------------- the target net
@pytest.mark.parametrize("script", DQN_SCRIPTS)
def test_the_target_net_syncs_at_whole_run_training_steps_also_across_a_resume(
    script, in_tmp, training, run_main
):
    def frames(steps):  # about that many training steps (an env's reset step brings no frame)
        return str(CARTPOLE.replay_start + ENVS[script] * steps)

    assert run_main(script, "--env", "cartpole", "--max-frames", frames(250)) == 0
    stopped_at, training.step = training.step, None
    assert 200 < stopped_at < 400  # between two syncs
    assert run_main(script, "--resume", str(the_run(in_tmp)), "--max-frames", frames(450)) == 0
    assert training.step >= 400
    assert training.syncs == list(
        range(CARTPOLE.target_sync, training.step + 1, CARTPOLE.target_sync)
    )


# ---------------------------------------------------------------- epsilon
@pytest.fixture
def acting(monkeypatch):
    """(frames played, epsilon) at each acting call of the experience sources made in this process:
    the epsilon of a DQNAgent, or the tensor that dqn_compile's acting function is given."""
    seen, make_source = [], common.ExperienceSourceFirstLast.__init__

    def recording_init(self, env, agent, *args, **kwargs):
        def act(states):
            epsilon = agent.epsilon if hasattr(agent, "epsilon") else agent.__globals__["epsilon"]
            seen.append((self.frames, float(epsilon)))
            return agent(states)

        make_source(self, env, act, *args, **kwargs)

    monkeypatch.setattr(common.ExperienceSourceFirstLast, "__init__", recording_init)
    return seen


def assert_epsilon_by_frame(seen):
    assert [epsilon for _, epsilon in seen] == pytest.approx(
        [dqn_compile.epsilon_by_frame(CARTPOLE, frames) for frames, _ in seen]
    )


@pytest.mark.parametrize("script", ["dqn_baseline", "dqn_fast", "dqn_compile"])
def test_each_acting_call_uses_epsilon_by_frame_of_frames_played_also_first_in_a_resumed_segment(
    script, in_tmp, acting, run_main
):
    assert run_main(script, "--env", "cartpole", "--max-frames", "1300") == 0
    first_segment = len(acting)
    stopped_at = torch.load(the_run(in_tmp) / runs.CHECKPOINT, weights_only=True)["tracker"][
        "frames"
    ]
    assert acting[0] == (0, CARTPOLE.epsilon_start) and stopped_at >= 1300
    assert run_main(script, "--resume", str(the_run(in_tmp)), "--max-frames", "2000") == 0
    # The resumed segment's first call is at the frames the run stopped at.
    assert acting[first_segment][0] == stopped_at and acting[-1][0] >= 1990
    assert_epsilon_by_frame(acting)


class Sent(Exception):
    """Raised by the stand-in for dqn_mp's pipe once the play process has played enough."""


@pytest.mark.parametrize("frames", [0, 1300])
def test_dqn_mps_play_process_acts_at_epsilon_by_frame_from_the_frames_it_is_given(
    frames, in_tmp, acting
):
    import dqn_mp

    args = types.SimpleNamespace(env="cartpole", envs=3, seed=0, cuda=False)
    net = dqn_mp.DQN((4,), 2)

    def send(message):
        if message[1] >= frames + 700:
            raise Sent

    with pytest.raises(Sent):
        dqn_mp.play_func(CARTPOLE, args, net, frames, send=send)
    assert acting[0] == (frames, pytest.approx(dqn_compile.epsilon_by_frame(CARTPOLE, frames)))
    assert acting[-1][0] >= frames + 690
    assert_epsilon_by_frame(acting)


# ---------------------------------------------------------------- what a DQN run logs
# The chapter's tags: reward, avg_reward, steps, loss, avg_loss, ...
CHAPTER_TAGS = [
    "episodes/reward",
    "episodes/avg_reward",
    "episodes/steps",
    "train/loss",
    "train/avg_loss",
    "train/epsilon",
    "train/avg_fps",
]


@pytest.mark.parametrize("script", DQN_SCRIPTS)
def test_a_dqn_run_logs_the_chapters_metrics_and_its_health_avg_loss_the_mean_of_the_losses_logged(
    script, in_tmp, run_main, monkeypatch
):
    clock, seconds = time.perf_counter, itertools.count()
    # A second passes between readings, so avg_fps is logged.
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + next(seconds))
    # To 1,700 frames each script trains over 200 steps: its health is measured at the 200th.
    assert (
        run_main(script, "--env", "cartpole", "--max-frames", "1700", "--checkpoint-minutes", "0")
        == 0
    )
    scalars = EventAccumulator(str(the_run(in_tmp)), size_guidance={"scalars": 0})
    scalars.Reload()
    tags = set(scalars.Tags()["scalars"])
    assert set(CHAPTER_TAGS) <= tags
    assert {"health/relu1/active", "health/relu2/dead_units", "health/q_spread"} <= tags
    losses, avg_losses = (
        [e.value for e in scalars.Scalars(tag)] for tag in ("train/loss", "train/avg_loss")
    )
    assert len(losses) >= 3 and avg_losses == pytest.approx(
        [np.mean(losses[: i + 1]) for i in range(len(losses))]
    )


# To 2,000 frames, five health measures with one env a step, one with three.
@pytest.mark.parametrize("script", DQN_SCRIPTS)
def test_a_dqn_whose_first_layer_fires_on_no_state_says_so_once(
    script, in_tmp, run_main, monkeypatch, capsys
):
    watch = common.NetworkHealth.__init__

    def watch_with_the_first_layer_dead(self, net, buffer):
        first = next(module for module in net.modules() if isinstance(module, nn.Linear))
        with torch.no_grad():
            first.bias.fill_(-100.0)
        watch(self, net, buffer)

    monkeypatch.setattr(common.NetworkHealth, "__init__", watch_with_the_first_layer_dead)
    code = run_main(
        script, "--env", "cartpole", "--max-frames", "2000", "--checkpoint-minutes", "0"
    )
    err = capsys.readouterr().err
    assert code == 0, err
    (warning,) = our_lines(err)
    assert warning.startswith(f"{script}.py: warning: the network's relu1 had under 0.03% of")
    assert "--seed" in warning
    scalars = EventAccumulator(str(the_run(in_tmp)), size_guidance={"scalars": 0})
    scalars.Reload()
    assert {event.value for event in scalars.Scalars("health/relu1/active")} == {0.0}
    assert scalars.Scalars("health/relu1/dead_units")[-1].value == 1.0


# ---------------------------------------------------------------- torch's threads
@pytest.mark.parametrize("script", DQN_SCRIPTS)
def test_a_dqn_loop_whose_main_thread_waits_for_a_core_goes_on_with_one_thread(
    script, in_tmp, run_main, monkeypatch, capsys
):
    clock, seconds = time.perf_counter, itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + next(seconds))  # a second a reading
    # The main thread waits for a core three quarters of the time it wants one.
    monkeypatch.setattr(runs, "core_times", lambda: (time.perf_counter(), 3 * time.perf_counter()))
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(runs, "set_torch_threads", lambda args: torch.set_num_threads(2))  # Pong's
    args = ["--env", "cartpole", "--max-frames", "1100", "--checkpoint-minutes", "0"]
    assert run_main(script, *args) == 0
    assert torch.get_num_threads() == 1
    (line,) = our_lines(capsys.readouterr().err)
    assert line.startswith(f"{script}.py: warning: another process shares these cores")


# ---------------------------------------------------------------- A3C's gradient clip


@pytest.mark.parametrize("script", ["a3c_data", "a3c_grad", "a3c_dist"])
def test_each_a3c_step_applies_the_gradient_clipped_to_clip_grad(script, tmp_path):
    env = dict(hooked_env(tmp_path, hook("record_clips")), RL_TEST_CLIP=str(tmp_path / "clips"))
    args = ["--env", "cartpole", "--max-frames", "1000", "--checkpoint-minutes", "0"]
    if script == "a3c_dist":
        assert a3c_dist(*args, cwd=tmp_path, env=env) == 0
    else:
        assert (
            subprocess.run(
                [sys.executable, os.path.join(REPO, f"{script}.py"), *args, "--processes", "1"],
                cwd=tmp_path,
                env=env,
                timeout=120,
            ).returncode
            == 0
        )
    lines = [line.split() for line in (tmp_path / "clips").read_text().splitlines()]
    clips = [
        (float(max_norm), float(norm))
        for kind, max_norm, norm in (words for words in lines if words[0] == "clip")
    ]
    steps = [float(norm) for kind, norm in (words for words in lines if words[0] == "step")]
    clip_grad = CLIP_GRAD[script]
    assert len(steps) == len(clips) > 5 and {max_norm for max_norm, _ in clips} == {clip_grad}
    assert max(norm for _, norm in clips) > clip_grad  # steps whose gradient the clip shortened
    assert max(steps) <= clip_grad * (1 + 1e-5)


# ---------------------------------------------------------------- A3C's frames across a resume
def episode_frames(folder):
    """The frame count of every episode the run logged, in the order its event files were written:
    read raw, since TensorBoard's reader would drop the points of a curve that doubles back."""
    steps = []
    for name in sorted(os.listdir(folder)):  # events.out.tfevents.<time>...: one a segment
        if name.startswith("events."):
            steps += [
                event.step
                for event in EventFileLoader(str(folder / name)).Load()
                if any(value.tag == "episodes/reward" for value in event.summary.value)
            ]
    return steps


def a3c_dist(*args, cwd, env=None):
    """a3c_dist.py as the one rank that torchrun would start, without torchrun's agent."""
    env = dict(
        env or os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="1",
        RANK="0",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "a3c_dist.py"), *args], cwd=cwd, env=env, timeout=120
    ).returncode


# a3c_grad's case in the fast set; a3c_data's and a3c_dist's resume blocks are the same two lines
@pytest.mark.parametrize(
    "script",
    [
        pytest.param("a3c_data", marks=pytest.mark.slow),
        "a3c_grad",
        pytest.param("a3c_dist", marks=pytest.mark.slow),
    ],
)
def test_a_resumed_a3c_run_counts_its_frames_on_from_the_checkpoints(script, in_tmp, run_main):
    def run(*args):
        args = ["--envs", "2", *args] + (
            ["--processes", "1"] if script != "a3c_dist" and "--resume" not in args else []
        )
        return a3c_dist(*args, cwd=in_tmp) if script == "a3c_dist" else run_main(script, *args)

    assert run("--env", "cartpole", "--max-frames", "500") == 0
    folder = the_run(in_tmp)
    stopped_at = torch.load(folder / runs.CHECKPOINT, weights_only=True)["counts"]["frames"]
    assert run("--resume", str(folder), "--max-frames", "1000") == 0
    frames = episode_frames(folder)
    assert frames == sorted(frames) and frames[0] < stopped_at < frames[-1]
    assert torch.load(folder / runs.CHECKPOINT, weights_only=True)["counts"]["frames"] >= 1000


# ---------------------------------------------------------------- the checkpoint
@pytest.fixture
def stopped_run(in_tmp, run_main):
    """A dqn_baseline run on CartPole stopped mid-training: Adam's state is in its checkpoint."""
    assert run_main("dqn_baseline", "--env", "cartpole", "--max-frames", "1010") == 0
    return the_run(in_tmp)


def test_a_resumed_run_holds_no_tensor_of_its_checkpoint_file_nor_maps_it_once_replaced(
    stopped_run, run_main, monkeypatch
):
    file_storages, optimizers = set(), []
    load, load_state = torch.load, torch.optim.Adam.load_state_dict

    def recording_load(*args, **kwargs):
        loaded = load(*args, **kwargs)
        # Read now: the resume clears the checkpoint once its objects hold their states.
        file_storages.update(t.untyped_storage().data_ptr() for t in tensors(loaded))
        return loaded

    def recording_load_state(self, state):
        optimizers.append(self)
        return load_state(self, state)

    monkeypatch.setattr(torch, "load", recording_load)
    monkeypatch.setattr(torch.optim.Adam, "load_state_dict", recording_load_state)
    # The segment ends with a checkpoint written over the one it resumed from.
    assert run_main("dqn_baseline", "--resume", str(stopped_run), "--max-frames", "1150") == 0
    (optimizer,) = optimizers  # kept alive here, with whatever tensors it holds
    state = tensors(optimizer.state_dict()["state"])
    assert file_storages and state
    assert not any(t.untyped_storage().data_ptr() in file_storages for t in state)
    if os.path.exists("/proc/self/maps"):  # Linux: a replaced file still mapped is "(deleted)"
        with open("/proc/self/maps") as maps:
            assert not [line for line in maps if os.path.realpath(stopped_run) in line]


def tensors(obj):
    """Every tensor in obj, a tensor or dicts, lists and tuples of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = (
        obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    )
    return [t for value in values for t in tensors(value)]


def test_an_unwritable_periodic_checkpoint_ends_the_run_with_one_line_its_summary_and_code_2(
    stopped_run, run_main, monkeypatch, capsys
):
    checkpoint, best = (stopped_run / runs.CHECKPOINT).read_bytes(), (stopped_run / "best.pt")
    best_before, tries = best.read_bytes(), []
    save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):  # a checkpoint's write fails as on a full disk
        if os.path.basename(str(getattr(f, "name", f))).startswith(runs.CHECKPOINT):
            tries.append(obj["tracker"]["frames"])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_save)
    capsys.readouterr()
    code = run_main(
        "dqn_baseline",
        "--resume",
        str(stopped_run),
        "--max-frames",
        "10000",
        "--checkpoint-minutes",
        "0.0005",
    )
    out, err = capsys.readouterr()
    # The first periodic try ends the run, at its frames: no checkpoint is tried at the stop.
    assert code == 2 and len(tries) == 1 and summary(out)["frames"] == tries[0] < 10000
    assert our_lines(err) == [
        f"dqn_baseline.py: error: cannot write {stopped_run / runs.CHECKPOINT} "
        f"({os.strerror(errno.ENOSPC)})"
    ]
    # What was written before stays, and loads.
    assert (stopped_run / runs.CHECKPOINT).read_bytes() == checkpoint
    assert best.read_bytes() == best_before and torch.load(best, weights_only=True)["state_dict"]
    assert not (stopped_run / (runs.CHECKPOINT + ".tmp")).exists()
