"""play.py and plot.py on the runs that the scripts leave behind: a CartPole run trained until
solved, and a tiny Pong run."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import dqn_baseline  # noqa: E402
import play  # noqa: E402
import plot  # noqa: E402


def run(script, *args, cwd):
    """Run one of the project's scripts to its end; returns (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, f"{script}.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def trained_run(tmp_path_factory, script, *args):
    """The run folder a script leaves behind."""
    cwd = tmp_path_factory.mktemp(script)
    code, _, err = run(script, *args, cwd=cwd)
    assert code == 0, err
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    """DQN trained on CartPole until solved (about 22k frames with this seed)."""
    return trained_run(tmp_path_factory, "dqn_baseline", "--env", "cartpole", "--seed", "1")


@pytest.fixture(scope="module")
def pong_run(tmp_path_factory):
    """A3C on Pong for a few hundred frames: not one episode has ended."""
    return trained_run(tmp_path_factory, "a3c_data", "--max-frames", "500", "--processes", "1", "--envs", "2")


def scores_and_result(out):
    """The scores that play.py printed, one per episode, and its JSON line."""
    lines = out.strip().splitlines()
    scores = [float(line.split(": ")[1]) for line in lines[:-1]]
    assert lines[:-1] == [f"episode {i + 1}: {score:g}" for i, score in enumerate(scores)]
    return scores, json.loads(lines[-1])


def assert_one_line_error(code, out, err, message):
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


# ---------------------------------------------------------------- checkpoints
def test_best_pt_carries_what_rebuilds_the_net(cartpole_run):
    checkpoint = torch.load(cartpole_run / "best.pt", weights_only=True)
    assert {k: checkpoint[k] for k in ("script", "env", "obs_shape", "n_actions")} == {
        "script": "dqn_baseline", "env": "cartpole", "obs_shape": (4,), "n_actions": 2}
    assert checkpoint["mean_reward"] >= 195 and checkpoint["frames"] > 0


# ---------------------------------------------------------------- play.py
def test_play_scores_the_trained_dqn_greedily(cartpole_run, tmp_path):
    code, out, err = run("play", str(cartpole_run), "--episodes", "5", cwd=tmp_path)
    assert code == 0, err
    scores, result = scores_and_result(out)
    assert len(scores) == result["episodes"] == 5
    assert result["mean"] == pytest.approx(sum(scores) / 5)
    assert (result["min"], result["max"]) == (min(scores), max(scores))
    # pushing one way topples the pole in about 10 steps; trained nets (seeds 1-5) kept it up 130-500
    assert result["mean"] >= 50
    # the same seed plays the same episodes
    assert run("play", str(cartpole_run / "best.pt"), "--episodes", "5", cwd=tmp_path)[1] == out


def test_play_acts_greedily_with_the_trained_weights(cartpole_run):
    checkpoint = play.load_checkpoint(str(cartpole_run))
    agent = play.build_agent(checkpoint, torch.device("cpu"))
    net = dqn_baseline.DQN((4,), 2)
    net.load_state_dict(checkpoint["state_dict"])
    states = np.random.default_rng(0).normal(size=(1000, 4)).astype(np.float32)
    with torch.no_grad():
        greedy = net(torch.as_tensor(states)).argmax(dim=1).numpy()
    assert 0 < greedy.mean() < 1   # the trained net takes both actions: a constant agent fails here
    assert (agent(states) == greedy).all()


def test_play_a3c_on_pong_and_record_a_gif(pong_run, tmp_path):
    code, out, err = run("play", str(pong_run), "--episodes", "2", "--record", "game.gif", cwd=tmp_path)
    assert code == 0, err
    scores, result = scores_and_result(out)
    assert result["episodes"] == 2 and all(-21 <= score <= 21 for score in scores)
    with Image.open(tmp_path / "game.gif") as gif:
        assert gif.n_frames > 100 and gif.size == (160, 210)   # a whole game, as the screen shows it


def write_checkpoint(path, **changes):
    """A checkpoint as RewardTracker writes it, with some keys changed or (None) removed."""
    checkpoint = {"script": "dqn_baseline", "env": "cartpole", "obs_shape": (4,), "n_actions": 2,
                  "frames": 0, "mean_reward": None, "state_dict": {"w": torch.zeros(1)}}
    checkpoint.update(changes)
    torch.save({k: v for k, v in checkpoint.items() if v is not None}, path)


@pytest.mark.parametrize("make, args, message", [
    (lambda d: None, ["missing.pt"], "no such checkpoint"),
    (lambda d: None, ["."], "no such checkpoint"),  # a folder without best.pt
    (lambda d: (d / "best.pt").write_text("not a checkpoint"), ["best.pt"], "is not a checkpoint"),
    (lambda d: torch.save({"w": torch.zeros(1)}, d / "best.pt"), ["best.pt"],  # a bare state_dict
     "lacks script, env, obs_shape, n_actions, state_dict"),
    (lambda d: write_checkpoint(d / "best.pt", script=None), ["best.pt"], "lacks script"),
    (lambda d: write_checkpoint(d / "best.pt", script="dqn_nowhere"), ["best.pt"], "unknown here"),
    (lambda d: write_checkpoint(d / "best.pt"), ["best.pt", "--record", "no/such/dir/game.gif"], "cannot write"),
    (lambda d: write_checkpoint(d / "best.pt"), ["best.pt", "--episodes", "0"], "positive integer"),
])
def test_play_bad_input_ends_with_one_line_and_exit_code_2(make, args, message, tmp_path):
    make(tmp_path)
    assert_one_line_error(*run("play", *args, cwd=tmp_path), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_play_cuda_without_a_gpu_ends_with_one_line(cartpole_run, tmp_path):
    assert_one_line_error(*run("play", str(cartpole_run), "--cuda", cwd=tmp_path), "no CUDA device")


# ---------------------------------------------------------------- plot.py
@pytest.mark.parametrize("x", ["frames", "minutes"])
def test_plot_writes_a_png(cartpole_run, x, tmp_path):
    code, out, err = run("plot", str(cartpole_run), "--x", x, "-o", "curve.png", cwd=tmp_path)
    assert code == 0, err
    with Image.open(tmp_path / "curve.png") as png:
        assert png.format == "PNG" and png.size == (800, 450)


def test_plot_curve_is_the_logged_mean_against_frames_or_minutes(cartpole_run):
    folder, frames, means = plot.load_curve(str(cartpole_run), "frames")
    _, minutes, same_means = plot.load_curve(str(cartpole_run), "minutes")
    assert folder == cartpole_run.name and same_means == means
    assert len(means) > 100 and means[-1] >= 195          # the run ends when solved
    assert frames == sorted(frames) and 0 < frames[0] < frames[-1] <= 100_000
    assert minutes == sorted(minutes) and 0 <= minutes[0] < minutes[-1] < 10


def test_plot_labels_are_script_env_and_name_with_the_time_only_where_needed():
    folders = ["a3c_grad-pong-solve-20261123-031218", "a3c_grad-pong-solve-20261123-015517",
               "a3c_data-pong-20261124-101010"]
    assert plot.labels(folders) == folders[:2] + ["a3c_data-pong"]


@pytest.mark.parametrize("args, message", [
    (["missing"], "no such run folder: missing"),
    (["."], "holds no TensorBoard events"),
])
def test_plot_bad_input_ends_with_one_line_and_exit_code_2(args, message, tmp_path):
    assert_one_line_error(*run("plot", *args, cwd=tmp_path), message)
    assert not (tmp_path / "reward.png").exists()


def test_plot_run_without_episodes_or_unwritable_output_ends_with_one_line(pong_run, cartpole_run, tmp_path):
    assert_one_line_error(*run("plot", str(pong_run), cwd=tmp_path), "no finished episode yet")
    assert_one_line_error(*run("plot", str(cartpole_run), "-o", "no/such/dir/curve.png", cwd=tmp_path),
                          "cannot write no/such/dir/curve.png")
