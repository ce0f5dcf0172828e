"""play.py and plot.py on the runs that the scripts leave behind: a short CartPole run, a CartPole
run trained until solved and a tiny Pong run (those two in the slow set)."""

import glob
import json
import os
import signal
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import a3c_data
import common
import dqn_baseline
import play
import plot
from conftest import REPO, our_lines

slow = pytest.mark.slow
# One worker makes the runs that the module's tests share.
pytestmark = pytest.mark.xdist_group("play_plot")


def run(script, *args, cwd):
    """Run one of the project's scripts to its end (a3c_dist under torchrun, 2 ranks); returns (exit
    code, stdout, stderr)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] * (
        script == "a3c_dist"
    )
    proc = subprocess.run(
        [sys.executable, *launcher, os.path.join(REPO, f"{script}.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def in_process(run_main, monkeypatch, tmp_path, capsys):
    """run_main in tmp_path; returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)

    def run(script, *args):
        code = run_main(script, *args)
        return (code, *capsys.readouterr())

    return run


def trained_run(tmp_path_factory, script, *args):
    """The run folder a script leaves behind."""
    cwd = tmp_path_factory.mktemp(script)
    code, _, err = run(script, *args, cwd=cwd)
    assert code == 0, err
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """DQN on CartPole for 2,000 frames: a hundred episodes or so, far from solved."""
    return trained_run(tmp_path_factory, "dqn_fast", "--env", "cartpole", "--max-frames", "2000")


@pytest.fixture(scope="module")
def cartpole_run(bf16_solve):
    """DQN trained on CartPole until solved (dqn_compile with --bf16, about 22k frames from seed 1):
    the run of test_scripts' learning test, made once a session."""
    code, out, err, cwd = bf16_solve("dqn_compile")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["solved"], err
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def pong_run(tmp_path_factory):
    """A3C on Pong for a few hundred frames: not one episode has ended."""
    return trained_run(
        tmp_path_factory, "a3c_data", "--max-frames", "500", "--processes", "1", "--envs", "2"
    )


def scores_and_result(out):
    """The scores that play.py printed, one per episode, and its JSON line."""
    lines = out.strip().splitlines()
    scores = [float(line.split(": ")[1]) for line in lines[:-1]]
    assert lines[:-1] == [f"episode {i + 1}: {score:g}" for i, score in enumerate(scores)]
    return scores, json.loads(lines[-1])


def assert_one_line_error(code, out, err, message):
    assert code == 2 and out == "", err
    (line,) = our_lines(err)
    assert message in line, err


# ---------------------------------------------------------------- checkpoints
def test_best_pt_carries_what_rebuilds_the_net(short_run):
    checkpoint = torch.load(short_run / "best.pt", weights_only=True)
    assert {k: checkpoint[k] for k in ("script", "env", "obs_shape", "n_actions")} == {
        "script": "dqn_fast",
        "env": "cartpole",
        "obs_shape": (4,),
        "n_actions": 2,
    }
    assert (
        checkpoint["frames"] > 0
        and checkpoint["state_dict"].keys() == dqn_baseline.DQN((4,), 2).state_dict().keys()
    )


@slow
def test_best_pt_of_a_solved_run_holds_its_solving_mean(cartpole_run):
    checkpoint = torch.load(cartpole_run / "best.pt", weights_only=True)
    assert checkpoint["mean_reward"] >= 195 and checkpoint["frames"] > 0


# ---------------------------------------------------------------- play.py
def test_play_cartpole_and_record_a_gif_at_the_game_pace(short_run, tmp_path):
    code, out, err = run(
        "play", str(short_run), "--episodes", "3", "--record", "game.gif", cwd=tmp_path
    )
    assert code == 0, err
    scores, result = scores_and_result(out)
    assert len(scores) == result["episodes"] == 3
    assert result["mean"] == pytest.approx(sum(scores) / 3)
    assert (result["min"], result["max"]) == (min(scores), max(scores))
    durations, size = gif_durations(tmp_path / "game.gif")
    # the first episode, a frame of 20 ms (CartPole renders 50 a second) for each of its steps (a
    # step scores 1); Pillow stores a frame that repeats the one before as a longer one
    assert sum(durations) == 20 * scores[0] and size == (600, 400)
    assert len(durations) > 1 and all(ms % 20 == 0 for ms in durations)


def test_play_shows_the_game_in_a_window_where_a_display_exists(short_run, in_process, monkeypatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")  # SDL's display that draws nowhere
    monkeypatch.setenv("SDL_AUDIODRIVER", "dummy")
    render_modes, make_python_env = [], common.make_python_env

    def recording_make(env, **kwargs):
        render_modes.append(kwargs.get("render_mode"))
        return make_python_env(env, **kwargs)

    monkeypatch.setattr(common, "make_python_env", recording_make)
    code, out, err = in_process("play", str(short_run), "--episodes", "2", "--show")
    assert code == 0, err
    assert render_modes == ["human"] and len(scores_and_result(out)[0]) == 2


@pytest.mark.skipif(
    sys.platform in ("darwin", "win32"), reason="macOS and Windows always have a display"
)
def test_play_show_without_a_display_ends_with_one_line_and_exit_code_2(
    short_run, in_process, monkeypatch
):
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"):
        monkeypatch.delenv(name, raising=False)
    assert_one_line_error(*in_process("play", str(short_run), "--show"), "needs a display")


@slow
def test_play_scores_the_trained_dqn_greedily(cartpole_run, tmp_path):
    code, out, err = run("play", str(cartpole_run), "--episodes", "5", cwd=tmp_path)
    assert code == 0, err
    scores, result = scores_and_result(out)
    assert len(scores) == result["episodes"] == 5
    # Pushing one way topples the pole in about 10 steps; trained nets (seeds 1-5) lasted 130-500.
    assert result["mean"] >= 50
    # the same seed plays the same episodes
    assert run("play", str(cartpole_run / "best.pt"), "--episodes", "5", cwd=tmp_path)[1] == out


@slow
@pytest.mark.parametrize("script", ["dqn_mp", "a3c_grad", "a3c_dist"])
def test_play_plays_the_best_pt_of_every_kind_of_script(script, tmp_path_factory, tmp_path):
    # a play process, gradient workers, torchrun ranks: each leaves a best.pt that play.py rebuilds
    run_dir = trained_run(tmp_path_factory, script, "--env", "cartpole", "--max-frames", "3000")
    code, out, err = run("play", str(run_dir), "--episodes", "2", cwd=tmp_path)
    assert code == 0, err
    scores, result = scores_and_result(out)
    assert result["episodes"] == len(scores) == 2 and min(scores) >= 1


class Endless(gym.Env):
    """A game giving 1 a step, never ending by itself; past 100 steps in all it fails the test."""

    observation_space, action_space = gym.spaces.Box(0, 1, (2,)), gym.spaces.Discrete(2)
    steps = 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        Endless.steps += 1
        assert Endless.steps <= 100, "a truncated game went on"
        return np.zeros(2, np.float32), 1.0, False, False, {}


def test_play_ends_a_game_at_its_truncation(monkeypatch):
    monkeypatch.setattr(Endless, "steps", 0)
    env = gym.vector.SyncVectorEnv([lambda: gym.wrappers.TimeLimit(Endless(), max_episode_steps=7)])
    assert play.play(env, lambda states: np.zeros(1, np.int64), episodes=3, seed=0) == [
        7.0,
        7.0,
        7.0,
    ]


def test_play_stopped_by_ctrl_c_exits_with_code_130(short_run, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "play.py"), str(short_run), "--episodes", "100000"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("episode 1: ")  # playing
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and our_lines(err) == [], err


@slow
def test_play_acts_greedily_with_the_trained_weights(cartpole_run):
    checkpoint = play.load_checkpoint(str(cartpole_run))
    agent = play.build_agent(checkpoint, torch.device("cpu"))
    net = dqn_baseline.DQN((4,), 2, bf16=True)
    # dqn_compile's best.pt holds the plain net's names.
    net.load_state_dict(checkpoint["state_dict"])
    states = np.random.default_rng(0).normal(size=(1000, 4)).astype(np.float32)
    with torch.no_grad():
        greedy = net(torch.as_tensor(states)).argmax(dim=1).numpy()
    assert 0 < greedy.mean() < 1  # the trained net takes both actions: a constant agent fails here
    assert (agent(states) == greedy).all()


@pytest.mark.parametrize(
    "folder",
    sorted(
        os.path.basename(os.path.dirname(path))
        for path in glob.glob(os.path.join(REPO, "docs", "runs", "*", "best.pt"))
    ),
)
def test_each_committed_best_pt_plays_pong_with_todays_network(folder):
    # The README's play.py commands: each committed agent, rebuilt by today's script,
    # plays a few hundred steps.
    checkpoint = play.load_checkpoint(os.path.join(REPO, "docs", "runs", folder))
    # This raises ValueError where the weights no longer fit.
    agent = play.build_agent(checkpoint, torch.device("cpu"))
    env = common.make_python_env(checkpoint["env"])
    states, _ = env.reset(seed=0)
    torch.manual_seed(0)
    actions = []
    for _ in range(300):
        actions.append(int(agent(states)[0]))
        states, *_ = env.step([actions[-1]])
    # A trained agent moves its paddle both ways.
    assert checkpoint["env"] == "pong" and len(set(actions)) > 1
    env.close()


@pytest.mark.parametrize("script", ["dqn_baseline", "dqn_fast", "dqn_mp", "dqn_compile"])
def test_play_acts_greedily_with_the_network_of_each_dqn_script(script):
    torch.manual_seed(0)
    net = dqn_baseline.DQN((4,), 2)
    checkpoint = {
        "script": script,
        "env": "cartpole",
        "obs_shape": (4,),
        "n_actions": 2,
        "bf16": False,
        "state_dict": net.state_dict(),
    }
    states = np.random.default_rng(0).normal(size=(1000, 4)).astype(np.float32)
    with torch.no_grad():
        greedy = net(torch.as_tensor(states)).argmax(dim=1).numpy()
    assert 0 < greedy.mean() < 1  # both actions occur: a constant agent fails here
    assert (play.build_agent(checkpoint, torch.device("cpu"))(states) == greedy).all()


@slow
def test_play_rebuilds_a_bf16_run_at_its_precision(tmp_path_factory, tmp_path, monkeypatch):
    run_dir = trained_run(
        tmp_path_factory,
        "a3c_data",
        "--env",
        "cartpole",
        "--max-frames",
        "2000",
        "--processes",
        "1",
        "--bf16",
    )
    checkpoint = play.load_checkpoint(str(run_dir))
    assert checkpoint["bf16"] is True
    precisions, forward = [], a3c_data.A2C.forward
    monkeypatch.setattr(
        a3c_data.A2C, "forward", lambda net, x: precisions.append(net.bf16) or forward(net, x)
    )
    agent = play.build_agent(checkpoint, torch.device("cpu"))
    assert agent(np.zeros((3, 4), dtype=np.float32)).shape == (3,) and precisions == [True]
    code, out, err = run("play", str(run_dir), "--episodes", "2", cwd=tmp_path)
    assert code == 0, err
    assert scores_and_result(out)[1]["episodes"] == 2


@slow
def test_play_a3c_on_pong_and_record_a_gif(pong_run, tmp_path):
    code, out, err = run(
        "play", str(pong_run), "--episodes", "2", "--record", "game.gif", cwd=tmp_path
    )
    assert code == 0, err
    scores, result = scores_and_result(out)
    # a game ends when a side reaches 21: the score is 21 less the loser's points, won or lost
    assert result["episodes"] == 2 and all(
        score == int(score) and 1 <= abs(score) <= 21 for score in scores
    )
    durations, size = gif_durations(tmp_path / "game.gif")
    assert len(durations) > 100 and size == (160, 210)  # a whole game, as the screen shows it
    assert all(ms % 70 == 0 for ms in durations)  # 4 frames of a 60 Hz console: 67 ms


def gif_durations(path):
    """The milliseconds of each frame of a GIF, and its size."""
    with Image.open(path) as gif:
        durations = []
        for index in range(gif.n_frames):
            gif.seek(index)
            durations.append(gif.info["duration"])
        return durations, gif.size


def write_checkpoint(path, **changes):
    """A checkpoint as RewardTracker writes it, with some keys changed or (None) removed."""
    checkpoint = {
        "script": "dqn_baseline",
        "env": "cartpole",
        "obs_shape": (4,),
        "n_actions": 2,
        "frames": 0,
        "mean_reward": None,
        "state_dict": {"w": torch.zeros(1)},
    }
    checkpoint.update(changes)
    torch.save({k: v for k, v in checkpoint.items() if v is not None}, path)


PLAY_BAD_INPUT = [
    (lambda d: None, ["missing.pt"], "no such checkpoint"),
    (lambda d: None, ["."], "no such checkpoint"),  # a folder without best.pt
    (lambda d: (d / "best.pt").write_text("not a checkpoint"), ["best.pt"], "is not a checkpoint"),
    (
        lambda d: torch.save({"w": torch.zeros(1)}, d / "best.pt"),
        ["best.pt"],  # a bare state_dict
        "lacks script, env, obs_shape, n_actions, state_dict",
    ),
    (lambda d: write_checkpoint(d / "best.pt", script=None), ["best.pt"], "lacks script"),
    (lambda d: write_checkpoint(d / "best.pt", script="dqn_nowhere"), ["best.pt"], "unknown here"),
    (
        lambda d: write_checkpoint(d / "best.pt"),
        ["best.pt", "--record", "no/such/dir/game.gif"],
        "cannot write",
    ),
    (lambda d: write_checkpoint(d / "best.pt"), ["best.pt", "--episodes", "0"], "positive integer"),
    (
        lambda d: write_checkpoint(d / "best.pt"),
        ["best.pt", "--show", "--record", "game.gif"],
        "not allowed with",
    ),
    (
        lambda d: write_checkpoint(d / "best.pt"),
        ["best.pt"],
        "do not fit the network of dqn_baseline.py",
    ),
]
PLAY_BAD_INPUT += (
    []
    if torch.cuda.is_available()
    else [(lambda d: write_checkpoint(d / "best.pt"), ["best.pt", "--cuda"], "no CUDA device")]
)


@pytest.mark.parametrize("make, args, message", PLAY_BAD_INPUT)
def test_play_bad_input_ends_with_one_line_and_exit_code_2(
    make, args, message, tmp_path, in_process
):
    make(tmp_path)
    assert_one_line_error(*in_process("play", *args), message)


def test_play_and_plot_bad_input_from_the_shell_exit_with_code_2(tmp_path):
    assert_one_line_error(*run("play", "missing.pt", cwd=tmp_path), "no such checkpoint")
    assert_one_line_error(*run("plot", "missing", cwd=tmp_path), "no such run folder")


# ---------------------------------------------------------------- plot.py
@pytest.mark.parametrize("x", ["frames", "minutes"])
def test_plot_writes_a_png(short_run, x, tmp_path, in_process):
    code, _, err = in_process("plot", str(short_run), "--x", x, "-o", "curve.png")
    assert code == 0, err
    with Image.open(tmp_path / "curve.png") as png:
        assert png.format == "PNG" and png.size == (800, 450)
        pixels = np.asarray(png.convert("RGB")).reshape(-1, 3).astype(int)
    # the curve drawn: pixels of matplotlib's first line colour (#1f77b4), not only axes and text
    assert (np.abs(pixels - [31, 119, 180]).sum(axis=1) < 30).sum() > 100


def test_plot_curve_is_the_logged_mean_against_frames_or_minutes(short_run):
    folder, frames, means = plot.load_curve(str(short_run), "frames")
    logged = EventAccumulator(str(short_run), size_guidance={"scalars": 0})
    logged.Reload()
    assert [(e.step, e.value) for e in logged.Scalars("episodes/avg_reward")] == list(
        zip(frames, means)
    )
    _, minutes, same_means = plot.load_curve(str(short_run), "minutes")
    assert folder == short_run.name and same_means == means
    assert len(means) > 50  # one point per finished episode
    assert frames == sorted(frames) and 0 < frames[0] < frames[-1] <= 2000
    assert minutes == sorted(minutes) and 0 <= minutes[0] < minutes[-1]


@pytest.mark.parametrize("logged", [True, False])
def test_plot_minutes_are_the_logged_run_minutes_where_a_run_has_them(logged, tmp_path):
    # a resumed run's minutes go on from its checkpoint however long it was stopped; older runs
    # logged none, and their minutes are wall time from the first event
    with SummaryWriter(str(tmp_path)) as writer:
        for step, (mean, minutes) in enumerate([(-21.0, 5.0), (-20.0, 6.0), (-19.0, 7.5)], start=1):
            writer.add_scalar("episodes/avg_reward", mean, step * 1000)
            if logged:
                writer.add_scalar("episodes/minutes", minutes, step * 1000)
    _, xs, ys = plot.load_curve(str(tmp_path), "minutes")
    assert ys == [-21.0, -20.0, -19.0]
    if logged:
        assert xs == [5.0, 6.0, 7.5]
    else:
        assert xs == sorted(xs) and 0 <= xs[0] and xs[-1] < 1  # written within a minute


@pytest.mark.parametrize(
    "marks", [["500k", "0.6M", "2M"], ["2M", "0.6M", "500k"]], ids=["in-order", "any-order"]
)
def test_plot_table_gives_the_first_game_at_or_past_each_mark_and_the_last(
    marks, tmp_path, in_process
):
    # The run's games end at 0.4M, 0.5M, 0.9M and 1.234M.
    with SummaryWriter(str(tmp_path / "run")) as writer:
        for frames, mean, minutes in [
            (400_000, -21.0, 10.0),
            (500_000, -20.5, 12.5),
            (900_000, -3.2, 20.0),
            (1_234_000, 18.004, 31.06),
        ]:
            writer.add_scalar("episodes/avg_reward", mean, frames)
            writer.add_scalar("episodes/minutes", minutes, frames)
    code, out, err = in_process("plot", str(tmp_path / "run"), "--table", *marks)
    assert (
        code == 0
        and err == ""
        and out
        == """| frames | 0.5M | 0.6M | 1.23M |
|---|---:|---:|---:|
| mean reward of the last 100 games | -20.5 | -3.2 | +18.00 |
| run minutes | 12.5 | 20.0 | 31.1 |
"""
    )  # 2M: past the run's end, left out
    assert not (tmp_path / "reward.png").exists()


@pytest.mark.parametrize("logged", ["rewards", "means only", "a merged point"])
def test_plot_solved_at_gives_the_frames_of_our_rule_and_of_the_books(logged, tmp_path, in_process):
    # 100 games alternating 17 and 18, then 100 of 21, game k ending at k * 10,000 frames. Ours: the
    # mean of 100 after n games of 21 is 18.03 at n = 15 (17.5 + (21 * 15 - 262) / 100), 17.99 at
    # 14: game 115. The book's smoothed reward starts at 17 (game 1) and nears 17.5: 17.43 at game
    # 100 (17.5 - 0.5 * 0.98 ** 99, within 0.01), then 21 - 3.57 * 0.98 ** n after n games of 21:
    # 18.02 at n = 9, 17.96 at 8: game 109.
    rewards = [17.0, 18.0] * 50 + [21.0] * 100
    folder = tmp_path / "runs" / "dqn_fast-pong-test"
    with SummaryWriter(str(folder)) as writer:
        for k, reward in enumerate(rewards, start=1):
            if logged == "a merged point" and k == 50:
                continue  # two games at one frame count: one point kept
            if logged == "rewards":
                writer.add_scalar("episodes/reward", reward, 10_000 * k)
            mean = np.mean(rewards[max(0, k - 100) : k])
            writer.add_scalar("episodes/avg_reward", mean, 10_000 * k)
    code, out, err = in_process("plot", str(folder), "--solved-at")
    assert code == 0 and err == ""
    book = "not derivable | not derivable" if logged == "a merged point" else "0.01M | 1.09M"
    games = 199 if logged == "a merged point" else 200
    assert out.splitlines()[2] == f"| dqn_fast-pong-test | {games} | 1.15M | {book} |"


@slow
def test_plot_curve_of_a_solved_run_ends_at_the_stop_reward(cartpole_run):
    _, _, means = plot.load_curve(str(cartpole_run), "frames")
    assert means[-1] >= 195 > means[0]


def test_plot_labels_are_script_env_and_name_with_the_time_only_where_needed():
    folders = [
        "a3c_grad-pong-solve-20261123-031218",
        "a3c_grad-pong-solve-20261123-015517",
        "a3c_data-pong-20261124-101010",
    ]
    assert plot.labels(folders) == folders[:2] + ["a3c_data-pong"]


def test_plot_gives_no_two_curves_the_same_colour_and_line_style():
    # the colour cycle has ten colours; docs/pong_reward.png draws more runs than that
    styles = [(style["color"], style["linestyle"]) for style in plot.styles(40)]
    assert len(set(styles)) == 40
    assert styles[:10] == [(color, "-") for color, _ in styles[:10]] and styles[10][1] == "--"


def events_without_episodes(folder):
    """A run folder whose events hold training scalars but no finished episode."""
    with SummaryWriter(str(folder)) as writer:
        writer.add_scalar("train/loss", 0.5, 100)
    return folder


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda d: None, ["missing"], "no such run folder: missing"),
        (lambda d: None, ["."], "holds no TensorBoard events"),
        (lambda d: events_without_episodes(d / "run"), ["run"], "no finished episode yet"),
        (lambda d: None, [".", "--table", "1Q"], "invalid mark value: '1Q'"),
    ],
)
def test_plot_bad_input_ends_with_one_line_and_exit_code_2(
    make, args, message, tmp_path, in_process
):
    make(tmp_path)
    assert_one_line_error(*in_process("plot", *args), message)
    assert not (tmp_path / "reward.png").exists()


def test_plot_unwritable_output_ends_with_one_line(short_run, in_process):
    assert_one_line_error(
        *in_process("plot", str(short_run), "-o", "no/such/dir/curve.png"),
        "cannot write no/such/dir/curve.png",
    )
