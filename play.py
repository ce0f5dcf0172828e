#!/usr/bin/env python3
"""Watch a trained agent: rebuild the network of a run's best.pt with the script that trained it,
play episodes on a fresh env (DQN agents greedily, A3C agents sampling from their policy), print
each score and, last, one JSON line (episodes, mean, min, max); --show plays it in a window,
--record writes a GIF.

A3C agents sample their actions as they did in training: the scores are those of the policy that
was trained and measured, not of its most likely action, a different policy that training never
played."""

import importlib
import json
import os
import sys

import gymnasium as gym
import numpy as np
import torch
from PIL import Image

import common
import runs

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKPOINT_KEYS = ("script", "env", "obs_shape", "n_actions", "state_dict")


def load_checkpoint(path):
    """The checkpoint in path (best.pt, or a run folder holding it); ValueError saying why not."""
    if os.path.isdir(path):
        path = os.path.join(path, "best.pt")
    if not os.path.isfile(path):
        raise ValueError(f"no such checkpoint: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a file that is not a checkpoint
        raise ValueError(f"{path} is not a checkpoint: {type(error).__name__}") from None
    missing = [
        key for key in CHECKPOINT_KEYS if not isinstance(checkpoint, dict) or key not in checkpoint
    ]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not a best.pt saved by these scripts")
    if (
        not os.path.isfile(os.path.join(HERE, f"{checkpoint['script']}.py"))
        or checkpoint["env"] not in common.ENV_IDS
    ):
        raise ValueError(
            f"{path} was saved by {checkpoint['script']} on {checkpoint['env']}, unknown here"
        )
    return checkpoint


def build_agent(checkpoint, device):
    """The trained network, rebuilt by its script, and a function from states to actions."""
    script = importlib.import_module(checkpoint["script"])
    is_dqn = hasattr(script, "DQN")
    net = (script.DQN if is_dqn else script.A2C)(
        checkpoint["obs_shape"],
        checkpoint["n_actions"],
        # The net is built at its training precision.
        checkpoint.get("bf16", False),
    )
    try:
        net.load_state_dict(checkpoint["state_dict"])
    except RuntimeError:
        # It was saved by an older version of the script, whose layers were named otherwise.
        raise ValueError(
            f"its weights do not fit the network of {checkpoint['script']}.py as it is now"
        ) from None
    net.to(device).eval()
    if is_dqn:
        return lambda states: greedy_actions(net, states, device)
    return lambda states: script.select_actions(net, states, device)  # sampled from the policy


@torch.no_grad()
def greedy_actions(net, states, device):
    """The action of highest Q-value in each state: how every DQN script's network plays."""
    return net(torch.as_tensor(states, device=device)).argmax(dim=1).cpu().numpy()


def play(env, agent, episodes, seed, frames=None):
    """Scores of the given number of episodes; frames, if a list, gets the first's RGB frames."""
    scores, score = [], 0.0
    states, _ = env.reset(seed=seed)
    while len(scores) < episodes:
        if frames is not None and not scores:
            frames.append(env.render()[0])
        states, rewards, terminated, truncated, _ = env.step(agent(states))
        score += float(rewards[0])
        if terminated[0] or truncated[0]:
            scores.append(score)
            print(f"episode {len(scores)}: {score:g}", flush=True)
            score = 0.0
            states, _ = env.reset()  # now, not on the vector env's next step
    return scores


def frame_ms(env_name, env):
    """How long the game shows one agent step, in milliseconds, rounded to the hundredths of a
    second that GIF counts: an Atari console draws 60 frames a second and an agent step is 4 of them
    (67 ms, so 70); other envs give their pace in their metadata (CartPole: 50 a second, 20 ms)."""
    if common.atari_game(env_name):
        return round(100 * common.FRAME_SKIP / 60) * 10
    return round(100 / env.metadata["render_fps"]) * 10


def has_display():
    """Whether a window can open: on macOS and Windows taken to be so, elsewhere where an X or
    Wayland display is set (or SDL, which draws the window, is told which video driver to use)."""
    if sys.platform in ("darwin", "win32"):
        return True
    return any(os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"))


def save_gif(frames, file, ms):
    """An animated GIF of the frames, ms milliseconds each."""
    images = [Image.fromarray(frame) for frame in frames]
    images[0].save(file, format="GIF", save_all=True, append_images=images[1:], duration=ms, loop=0)


if __name__ == "__main__":
    parser = runs.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", metavar="RUN_DIR|CHECKPOINT", help="a run folder, or its best.pt"
    )
    parser.add_argument(
        "--episodes", type=runs.positive_int, default=10, help="episodes to play (default: 10)"
    )
    watch = parser.add_mutually_exclusive_group()
    watch.add_argument("--show", action="store_true", help="play in a window, at the game's pace")
    watch.add_argument(
        "--record", metavar="FILE.gif", help="write the first episode as an animated GIF"
    )
    parser.add_argument(
        "--seed",
        type=runs.seed_int,
        default=10**6,
        help="seed of the env and of sampled actions (default: 1000000, far from "
        "the seeds of training, which start at --seed 0)",
    )
    parser.add_argument("--cuda", action="store_true", help="run the network on the GPU")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda given, but no CUDA device is available")
    if args.show and not has_display():
        parser.error(
            "--show needs a display and this machine has none ($DISPLAY is unset): "
            "--record FILE.gif writes the game to a file instead"
        )
    try:
        checkpoint = load_checkpoint(args.checkpoint)
        render_mode = "human" if args.show else "rgb_array" if args.record else None
        env = common.make_python_env(checkpoint["env"], render_mode=render_mode)
        # An unwritable file fails now, not after playing.
        gif = open(args.record, "wb") if args.record else None
    except (ValueError, gym.error.DependencyNotInstalled) as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"cannot write {args.record}: {error.strerror}")
    torch.set_num_threads(1)  # one state at a time: more threads only wait on each other
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    try:
        agent = build_agent(checkpoint, torch.device("cuda" if args.cuda else "cpu"))
    except ValueError as error:
        parser.error(f"{args.checkpoint}: {error}")
    frames = [] if gif else None
    try:
        scores = play(env, agent, args.episodes, args.seed, frames)
    except KeyboardInterrupt:
        sys.exit(130)
    if gif:
        save_gif(frames, gif, frame_ms(checkpoint["env"], env))
        gif.close()
    print(
        json.dumps(
            {
                "episodes": len(scores),
                "mean": float(np.mean(scores)),
                "min": min(scores),
                "max": max(scores),
            }
        )
    )
