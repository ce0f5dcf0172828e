"""What every script shares: the env makers and wrappers, the n-step experience source, the replay
buffer, batch unpacking, reward tracking and checkpoints, the command line and the child processes. What a user
changes when copying a script (hyperparameters, network, loss, agent) lives in the script."""
import argparse
import collections
import contextlib
import copy
import json
import math
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import types
import weakref

import ale_py
import gymnasium as gym
import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

gym.register_envs(ale_py)


# ---------------------------------------------------------------- environments
# the envs every script knows: their gymnasium ids, and the mean reward of 100 episodes that solves them
ENV_IDS = {"pong": "PongNoFrameskip-v4", "cartpole": "CartPole-v1"}
STOP_REWARDS = {"pong": 18.0, "cartpole": 195.0}
FRAME_SKIP = 4   # emulator frames per agent step on Atari: one action, repeated 4 times


class FireAndNoopsOnReset(gym.Wrapper):
    """Start an episode as ale-py's vector env does: FIRE for one frame where the game has it, then
    k no-op frames, k drawn from 0 to noop_max - 1 less one for the FIRE (so 0 to 28 for Pong and
    noop_max 30, with 0 twice as likely). gymnasium's AtariPreprocessing would draw 1 to 30."""

    def __init__(self, env, noop_max):
        super().__init__(env)
        self.noop_max = noop_max
        self.fire = "FIRE" in env.unwrapped.get_action_meanings()

    def reset(self, **kwargs):
        """Reset, FIRE, then the no-ops; a game that ends on one of those frames is reset again."""
        obs, info = self.env.reset(**kwargs)
        noops = self.np_random.integers(max(self.noop_max, 1)) - self.fire
        for action in [1] * self.fire + [0] * noops:
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def atari_game(env):
    """The ALE game name of an env ("pong"), or None for other envs."""
    return gym.spec(ENV_IDS[env]).kwargs.get("game")


def make_classic_env(env, n_envs=1, noop_max=30, render_mode=None):
    """Python pipeline: gymnasium wrappers in a SyncVectorEnv (next-step autoreset)."""
    def make_one():
        one = gym.make(ENV_IDS[env], render_mode=render_mode)
        if atari_game(env):
            one = FireAndNoopsOnReset(one, noop_max)
            one = gym.wrappers.AtariPreprocessing(one, noop_max=0, frame_skip=FRAME_SKIP)
            one = gym.wrappers.FrameStackObservation(one, 4, padding_type="zero")
        return one
    return gym.vector.SyncVectorEnv([make_one] * n_envs)


def make_fast_env(env, n_envs=1, threads=0, noop_max=30):
    """Fast pipeline: ale-py's C++ AtariVectorEnv (same preprocessing) for Atari, else SyncVectorEnv."""
    game = atari_game(env)
    if game is None:
        return make_classic_env(env, n_envs)
    return ale_py.vector_env.AtariVectorEnv(
        game, n_envs, num_threads=threads, noop_max=noop_max, frameskip=FRAME_SKIP, stack_num=4,
        repeat_action_probability=0.0, reward_clipping=False)


# ---------------------------------------------------------------- experience
# reward: discounted sum of up to n rewards; last_state: state after them, None if the episode
# terminated; steps: how many rewards were summed (fewer than n at an episode's end)
ExperienceFirstLast = collections.namedtuple(
    "ExperienceFirstLast", ["state", "action", "reward", "last_state", "steps"])


class ExperienceSourceFirstLast:
    """Steps a vector env with a batched agent; each iteration is one step of all envs and
    yields the n-step experiences it completed."""

    def __init__(self, env, agent, gamma, steps_count=1, seed=None, overlap=False):
        """overlap: the envs play each step while the caller works on the experiences of the step
        before (the env needs send and recv, as ale-py's vector env has)."""
        self.env, self.agent = env, agent
        self.gamma, self.steps_count, self.seed, self.overlap = gamma, steps_count, seed, overlap
        self.frames = 0                  # agent steps taken, all envs together
        self.finished = []               # (reward, steps) of episodes ended since pop_episodes()

    def __iter__(self):
        """Forever: step all envs once, yield the list of experiences that step completed (with
        overlap, while the envs play the next step: the first list, before any step, is empty)."""
        n = self.env.num_envs
        obs, _ = self.env.reset(seed=self.seed)
        history = [collections.deque() for _ in range(n)]   # (state, action, reward) per env
        ep_reward, ep_steps = np.zeros(n), np.zeros(n, dtype=np.int64)
        needs_reset = np.zeros(n, dtype=bool)
        exps = []
        while True:
            actions = self.agent(obs)
            if self.overlap:
                self.env.send(actions)
                yield exps   # the caller works on the last step's experiences while the envs play this one
                next_obs, rewards, terminated, truncated, _ = self.env.recv()
            else:
                next_obs, rewards, terminated, truncated, _ = self.env.step(actions)
            exps = []
            for i in range(n):
                if needs_reset[i]:       # next-step autoreset: this step only reset env i
                    needs_reset[i] = False
                    continue
                self.frames += 1
                ep_reward[i] += rewards[i]
                ep_steps[i] += 1
                history[i].append((obs[i], actions[i], rewards[i]))
                if terminated[i] or truncated[i]:
                    # bootstrap from the real last observation on truncation, never on termination
                    last = None if terminated[i] else next_obs[i]
                    while history[i]:
                        exps.append(self._first_last(history[i], last))
                        history[i].popleft()
                    self.finished.append((ep_reward[i], int(ep_steps[i])))
                    ep_reward[i], ep_steps[i] = 0, 0
                    needs_reset[i] = True
                elif len(history[i]) == self.steps_count:
                    exps.append(self._first_last(history[i], next_obs[i]))
                    history[i].popleft()
            obs = next_obs
            if not self.overlap:
                yield exps

    def _first_last(self, history, last_state):
        """Experience from the first state in history to last_state."""
        reward = 0.0
        for _, _, r in reversed(history):
            reward = r + self.gamma * reward
        state, action, _ = history[0]
        return ExperienceFirstLast(state, action, reward, last_state, len(history))

    def pop_episodes(self):
        """(reward, steps) of every episode finished since the last call."""
        finished, self.finished = self.finished, []
        return finished

    def state_dict(self):
        """What a resumed run goes on from: the frame count (the games in progress start anew)."""
        return {"frames": self.frames}

    def load_state_dict(self, state):
        self.frames = state["frames"]


class ReplayBuffer:
    """Ring buffer of one-step transitions in preallocated numpy arrays, sampled uniformly."""
    ARRAYS = ("states", "actions", "rewards", "dones", "last_states")

    def __init__(self, capacity, obs_space, seed=None):
        self.capacity, self.size, self.pos = capacity, 0, 0
        shape, dtype = obs_space.shape, obs_space.dtype
        # a stack of frames shares all but its newest frame with the next state: keep only that one
        self.stacked = len(shape) == 3
        self.states = np.zeros((capacity, *shape), dtype=dtype)
        last_shape = shape[1:] if self.stacked else shape
        self.last_states = np.zeros((capacity, *last_shape), dtype=dtype)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=bool)
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.size

    def append(self, exp):
        """Store one experience, overwriting the oldest when full."""
        assert exp.steps == 1, "the buffer stores one-step transitions"
        i = self.pos
        self.states[i], self.actions[i], self.rewards[i] = exp.state, exp.action, exp.reward
        self.dones[i] = exp.last_state is None
        if exp.last_state is None:
            self.last_states[i] = 0
        else:
            self.last_states[i] = exp.last_state[-1] if self.stacked else exp.last_state
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size):
        """Arrays (states, actions, rewards, dones, last_states) of batch_size random transitions."""
        idx = self.rng.integers(0, self.size, batch_size)
        states = self.states[idx]
        last_states = self.last_states[idx]
        if self.stacked:
            last_states = np.concatenate([states[:, 1:], last_states[:, None]], axis=1)
        return states, self.actions[idx], self.rewards[idx], self.dones[idx], last_states

    def state_dict(self):
        """The filled part as tensors that share the arrays' memory (torch.save writes that part, no
        copy), the ring's position and the sampling generator's state."""
        filled = {name: torch.from_numpy(getattr(self, name)[:self.size]) for name in self.ARRAYS}
        return dict(filled, pos=self.pos, size=self.size, rng=self.rng.bit_generator.state)

    def load_state_dict(self, state):
        """Copy a state_dict's arrays into this buffer's own (from a mapped checkpoint: read as copied)."""
        self.pos, self.size = state["pos"], state["size"]
        for name in self.ARRAYS:
            getattr(self, name)[:self.size] = state[name].numpy()
        self.rng.bit_generator.state = state["rng"]


def unpack_batch_dqn(batch, device):
    """Tensors (states, actions, rewards, dones, last_states) on device from ReplayBuffer.sample."""
    return tuple(torch.as_tensor(array, device=device) for array in batch)


def unpack_batch_a2c(exps, net, device, gamma):
    """States, actions and n-step reference values, as tensors on device; those not terminated are
    bootstrapped with gamma ** steps times the value of their last state, which net computes on the
    device it is on."""
    states = torch.as_tensor(np.stack([e.state for e in exps]), device=device)
    actions = torch.as_tensor(np.array([e.action for e in exps]), device=device)
    ref_vals = np.array([e.reward for e in exps], dtype=np.float32)
    alive = [i for i, e in enumerate(exps) if e.last_state is not None]
    if alive:
        net_device = next(net.parameters()).device
        last_states = torch.as_tensor(np.stack([exps[i].last_state for i in alive]), device=net_device)
        with torch.no_grad():
            last_vals = net(last_states)[1].cpu().numpy()
        steps = np.array([exps[i].steps for i in alive])
        ref_vals[alive] += gamma ** steps * last_vals
    return states, actions, torch.as_tensor(ref_vals, device=device)


# ---------------------------------------------------------------- tracking, logging, checkpoints
CHECKPOINT = "checkpoint.pt"   # the whole run, in its folder: what --resume goes on from
SEGMENT_SEED = 10_000          # a resumed run's k-th segment seeds its envs and children with seed + k * this
stop_signal = None             # SIGINT or SIGTERM, once one has asked the run to stop


def request_stop(signum, frame):
    """SIGINT and SIGTERM handler: ask the run to stop. The tracker stops it at its next update, an
    iteration boundary, so that the checkpoint it writes is consistent: nothing is cut mid-step."""
    global stop_signal
    stop_signal = stop_signal or signum


def save_whole(obj, path):
    """torch.save obj to path through a temporary in the same folder, flushed to the disk, then
    renamed over path: a kill at any moment leaves the old file or the new one, never part of one.
    A write that fails removes its temporary."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):   # none was made if open failed
            os.remove(temporary)
        raise


def rng_states(device):
    """The main process's random generators: torch's, numpy's legacy one, and CUDA's on a GPU."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states = {"torch": torch.get_rng_state(),
              "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                        "has_gauss": has_gauss, "cached_gaussian": cached_gaussian}}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states, device):
    """Restore rng_states(); CUDA's only where this segment runs on a GPU and the saved one did."""
    torch.set_rng_state(states["torch"])
    saved = states["numpy"]
    np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["pos"],
                         saved["has_gauss"], saved["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


class RewardTracker:
    """Owns the run's folder and its TensorBoard writer: records episodes and training scalars
    against frames, prints progress, decides when to stop, keeps the best model, writes the
    checkpoint of the whole run and prints the final JSON summary. saved: {name: object with
    state_dict()} (networks, optimizer, replay buffer, experience source), which the checkpoint holds
    beside the tracker's counters. With --resume they are restored from it as the tracker is made:
    make it before anything copies them (shared weights); the run's folder is made at __enter__."""

    def __init__(self, args, net, env, saved=None):
        self.args, self.net, self.saved = args, net, dict(saved or {})
        self.device = next(net.parameters()).device
        # what play.py needs to rebuild the net, saved beside its weights
        self.model_info = {"script": args.script, "env": args.env,
                           "obs_shape": tuple(env.single_observation_space.shape),
                           "n_actions": int(env.single_action_space.n), "bf16": args.bf16}
        self.stop_reward = STOP_REWARDS[args.env]
        self.rewards = collections.deque(maxlen=100)
        self.losses = collections.deque(maxlen=100)
        self.frames = self.episodes = self.train_steps = self.segment = 0
        self.best_mean = self.train_start = self.first_step_seconds = None
        self.earlier = {"seconds": 0.0, "train_frames": 0, "train_seconds": 0.0}   # of the segments before this one
        self.solved, self.exit_code = False, 0
        self.options = {name: value for name, value in vars(args).items() if name != "resume"}
        if args.resume:
            self.log_dir = args.resume
            self.restore(torch.load(os.path.join(self.log_dir, CHECKPOINT), map_location="cpu", mmap=True,
                                    weights_only=True))
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.log_dir = os.path.join("runs", "-".join(filter(None, [args.script, args.env, args.name, stamp])))
        self.writer = self.start = self.stopped = None   # made where the run begins: __enter__

    def __enter__(self):
        """The run begins: its folder and writer are made, its clock starts."""
        # on resume, readers drop what the stopped run logged after its checkpoint: no curve doubles back
        self.writer = SummaryWriter(self.log_dir, purge_step=self.frames + 1 if self.args.resume else None)
        self.start = self.updated = time.perf_counter()
        self.last_print = (self.frames, self.start)
        self.last_checkpoint = self.earlier["seconds"]
        return self

    def run_seconds(self):
        """Run time: this segment's seconds, to the stop, plus those of the segments before it."""
        return self.earlier["seconds"] + (self.stopped or time.perf_counter()) - self.start

    def update(self, frames, episodes):
        """Record the frame count and finished (reward, steps) episodes; True when it is time to stop:
        solved, --max-frames reached, or a stop asked by a signal. A call comes between iterations: a
        checkpoint falls due here."""
        self.frames, self.updated = frames, time.perf_counter()
        for reward, steps in episodes:
            self.episode(reward, steps)
            if self.solved:  # the run ends here: later episodes must not move the mean it solved at
                break
        interval = self.args.checkpoint_minutes * 60
        if interval and self.run_seconds() - self.last_checkpoint >= interval and stop_signal is None:
            self.save_checkpoint()
        return (stop_signal is not None or self.solved or
                (self.args.max_frames is not None and frames >= self.args.max_frames))

    def episode(self, reward, steps):
        """Log one finished episode, print progress now and then, save the model on a new best mean."""
        self.episodes += 1
        self.rewards.append(reward)
        mean = float(np.mean(self.rewards))
        self.writer.add_scalar("episodes/reward", reward, self.frames)
        self.writer.add_scalar("episodes/avg_reward", mean, self.frames)
        self.writer.add_scalar("episodes/steps", steps, self.frames)
        self.writer.add_scalar("episodes/minutes", self.run_seconds() / 60, self.frames)   # run time, over segments
        full = len(self.rewards) == self.rewards.maxlen   # judge only a full window of 100 episodes
        if full and (self.best_mean is None or mean > self.best_mean):
            self.best_mean = mean
            self.save_model()
        self.solved = self.solved or (full and mean >= self.stop_reward)
        now = time.perf_counter()
        if now - self.last_print[1] >= 1.0 or self.solved:
            fps = (self.frames - self.last_print[0]) / (now - self.last_print[1])
            self.writer.add_scalar("train/avg_fps", fps, self.frames)
            print(f"{self.frames}: done {self.episodes} games, mean reward {mean:.3f}, speed {fps:.1f} f/s",
                  flush=True)
            self.last_print = (self.frames, now)

    def save_model(self):
        """Write best.pt: what rebuilds the net, the run's progress, and the weights as CPU tensors,
        so that any machine can load them."""
        state = {name: tensor.cpu() for name, tensor in self.net.state_dict().items()}
        mean = float(np.mean(self.rewards)) if self.rewards else None
        save_whole(dict(self.model_info, frames=self.frames, mean_reward=mean, state_dict=state),
                   os.path.join(self.log_dir, "best.pt"))

    def train(self, **scalars):
        """Count a training step; log training scalars as train/<name>; a loss also feeds train/avg_loss."""
        self.train_steps += 1
        if self.train_start is None:  # the first training step (dqn_compile's compile) is timed apart
            now = time.perf_counter()
            self.first_step_seconds = now - self.updated
            self.train_start = (self.frames, now)
        for name, value in scalars.items():
            self.writer.add_scalar(f"train/{name}", value, self.frames)
        if "loss" in scalars:
            self.losses.append(scalars["loss"])
            self.writer.add_scalar("train/avg_loss", np.mean(self.losses), self.frames)

    def train_totals(self):
        """Frames and seconds of training, over every segment: from the end of each one's first step."""
        frames, seconds = self.earlier["train_frames"], self.earlier["train_seconds"]
        if self.train_start is not None:
            frames += self.frames - self.train_start[0]
            seconds += (self.stopped or time.perf_counter()) - self.train_start[1]
        return frames, seconds

    def save_checkpoint(self):
        """Write the whole run to its folder: the saved objects' state_dicts, the counters, the options
        and the main process's random generators; tensors and plain types only, so that it loads with
        weights_only. Events logged so far reach the disk first."""
        self.writer.flush()
        started = time.perf_counter()
        train_frames, train_seconds = self.train_totals()
        checkpoint = {
            "script": self.args.script, "options": self.options, "segments": self.segment + 1,
            "frames": self.frames, "episodes": self.episodes, "train_steps": self.train_steps,
            "rewards": [float(r) for r in self.rewards], "losses": list(self.losses), "best_mean": self.best_mean,
            "solved": self.solved, "seconds": self.run_seconds(), "train_frames": train_frames,
            "train_seconds": train_seconds, "rng": rng_states(self.device),
            "state": {name: obj.state_dict() for name, obj in self.saved.items()}}
        path = os.path.join(self.log_dir, CHECKPOINT)
        save_whole(checkpoint, path)
        self.last_checkpoint = checkpoint["seconds"]
        print(f"{self.frames}: checkpoint written, {os.path.getsize(path) / 1e6:.1f} MB in "
              f"{time.perf_counter() - started:.1f} s", flush=True)

    def restore(self, checkpoint):
        """Go on from a checkpoint: the saved objects' states, the counters, the generators."""
        for name, obj in self.saved.items():
            obj.load_state_dict(checkpoint["state"][name])
        self.options, self.segment = checkpoint["options"], checkpoint["segments"]
        self.frames, self.episodes = checkpoint["frames"], checkpoint["episodes"]
        self.train_steps, self.best_mean, self.solved = checkpoint["train_steps"], checkpoint["best_mean"], checkpoint["solved"]
        self.rewards.extend(checkpoint["rewards"])
        self.losses.extend(checkpoint["losses"])
        self.earlier = {name: checkpoint[name] for name in self.earlier}
        set_rng_states(checkpoint["rng"], self.device)

    def summary(self):
        """The run in numbers, over every segment, for the last line of output."""
        seconds = self.run_seconds()
        train_frames, train_seconds = self.train_totals()
        return {"script": self.args.script, "env": self.args.env, "frames": self.frames,
                "train_frames": train_frames, "episodes": self.episodes,
                "seconds": round(seconds, 1), "fps": round(self.frames / seconds, 1),
                "train_fps": round(train_frames / train_seconds, 1) if train_seconds else 0.0,
                "first_step_seconds": None if self.first_step_seconds is None else round(self.first_step_seconds, 1),
                "mean_reward": float(np.mean(self.rewards)) if self.rewards else None,
                "solved": self.solved}

    def __exit__(self, exc_type, exc, tb):
        """Every stop ends here, at an iteration boundary: solved, --max-frames, Ctrl-C and SIGTERM (exit
        codes 130 and 143), a dead child process (1, with one line). The checkpoint, best.pt and the
        summary are written with further signals ignored (torchrun sends a second SIGTERM)."""
        if exc_type is ChildProcessError and stop_signal is None:
            print(f"{self.args.script}.py: error: {exc}", file=sys.stderr, flush=True)
            self.exit_code = 1
        elif exc_type is not None and exc_type is not ChildProcessError:
            return False   # a bug: no checkpoint of a state it may have left half-made
        if stop_signal is not None:   # a child that the same signal ended is part of this stop
            self.exit_code = 128 + stop_signal
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        self.stopped = time.perf_counter()   # the run's clock stops: the writes below are not run time
        if self.args.checkpoint_minutes:
            self.save_checkpoint()
        if self.best_mean is None:  # no full window yet: the latest model is the best we know
            self.save_model()
        self.writer.close()
        print(json.dumps(self.summary()), flush=True)
        return True


class SilentTracker:
    """RewardTracker's stand-in on a torchrun rank other than 0: it logs nothing and never decides to
    stop; rank 0's word stops every rank at the same step, a stop asked by a signal included. A lost
    rank (ChildProcessError) ends its process with one line, at once, with os._exit, because a
    helper thread may still wait in gloo, where a clean teardown would abort."""

    frames = 0   # rank 0 counts them

    def __init__(self, args, rank):
        self.script, self.rank = args.script, rank

    @property
    def exit_code(self):
        return 0 if stop_signal is None else 128 + stop_signal

    def update(self, frames, episodes):
        return False

    def train(self, **scalars):
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is ChildProcessError:
            if stop_signal is None:
                print(f"{self.script}.py: error: rank {self.rank} {exc}", file=sys.stderr, flush=True)
            os._exit(self.exit_code or 1)


# ---------------------------------------------------------------- command line
class ArgumentParser(argparse.ArgumentParser):
    """Bad input ends with one line and exit code 2, not a usage dump. --help shows the first
    paragraph of the description (a script's docstring): what it does, not how its processes talk."""

    def __init__(self, description, **kwargs):
        super().__init__(description=description.split("\n\n")[0], **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def bounded_int(low, high, expected):
    """argparse type: an integer from low to high, else the error 'expected ..., got ...'."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = bounded_int(1, sys.maxsize, "a positive integer")
# workers add offsets to the seed, and the C++ env takes int32 seeds
seed_int = bounded_int(0, 2 ** 30 - 1, f"an integer from 0 to {2 ** 30 - 1}")


def argument_parser(description):
    """The options every script takes; scripts add their own."""
    parser = ArgumentParser(description)
    parser.add_argument("--env", choices=sorted(ENV_IDS), default="pong", help="env (default: pong)")
    parser.add_argument("--cuda", action="store_true", help="run the network of every process on the GPU")
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed (default: 0)")
    parser.add_argument("-n", "--name", default="", help="suffix of the run name in runs/")
    parser.add_argument("--max-frames", type=positive_int, help="stop after this many frames")
    parser.add_argument("--bf16", action="store_true",
                        help="mixed precision: the network's hidden layers compute in bfloat16")
    parser.add_argument("--resume", metavar="RUN_FOLDER",
                        help="go on with the stopped run in RUN_FOLDER, from its checkpoint, with its options")
    parser.add_argument("--checkpoint-minutes", type=bounded_int(0, 10 ** 6, "a number of minutes, 0 for none"),
                        default=10, help="minutes of run time between checkpoints, 0 for none (default: 10)")
    return parser


def bf16_native(device):
    """Whether the device computes in bfloat16 natively; elsewhere torch emulates it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(name, False) for name in ("avx512_bf16", "amx_bf16", "bf16"))  # bf16: arm64


def setup(parser, hyperparams):
    """Parse and check the command line (with --resume, the checkpoint first: its options, checked
    against those given), seed the generators; returns args, the env's hyperparameters (from the
    script's table, as attributes) and the device."""
    args = parser.parse_args()
    args.script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    if args.resume and os.environ.get("RANK", "0") == "0":   # under torchrun rank 0 reads it, and sends it on
        args = resumed_options(parser, args)
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda given, but no CUDA device is available")
    device = torch.device("cuda" if args.cuda else "cpu")
    if args.bf16 and not bf16_native(device) and os.environ.get("RANK", "0") == "0":   # once a run
        print(f"{parser.prog}: warning: --bf16 is emulated on this {'GPU' if args.cuda else 'CPU'}: it may run "
              "slower than fp32", file=sys.stderr, flush=True)
    global stop_signal
    stop_signal = None
    for signum in (signal.SIGINT, signal.SIGTERM):   # a kill stops as cleanly as Ctrl-C
        signal.signal(signum, request_stop)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    params = types.SimpleNamespace(**hyperparams[args.env])
    return args, params, device


def read_checkpoint(parser, folder, script):
    """The checkpoint in a run folder, mapped, not read; a folder with none, a file that does not load
    (truncated, damaged) or another script's run stops here with one line and exit code 2."""
    path = os.path.join(folder, CHECKPOINT)
    if not os.path.isfile(path):
        parser.error(f"--resume: {folder} holds no {CHECKPOINT}")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:   # whatever the unpickler says of a file it cannot read: its kind
        parser.error(f"--resume: {path} does not load: truncated, damaged or not a checkpoint "
                     f"({type(error).__name__})")
    if not isinstance(checkpoint, dict) or checkpoint.get("script") != script:
        kind = checkpoint.get("script") if isinstance(checkpoint, dict) else None
        parser.error(f"--resume: {path} is a checkpoint of {kind or 'something else'}, not of {script}")
    return checkpoint


def resumed_options(parser, args):
    """The run's options, from its checkpoint. Options given on the command line must agree with it,
    but --max-frames (the whole run's budget) and --cuda (the device is the segment's own); the
    envs and children of the k-th segment play with seed + k * SEGMENT_SEED, new games."""
    checkpoint = read_checkpoint(parser, args.resume, args.script)
    saved, anew = checkpoint["options"], {"resume", "max_frames", "cuda", "checkpoint_minutes"}
    unset = object()   # parsing into a namespace that holds it leaves it wherever an option was not given
    given = parser.parse_args(namespace=argparse.Namespace(**{name: unset for name in vars(args)}))
    for name, value in vars(given).items():
        if value is not unset and name not in anew and name in saved and value != saved[name]:
            parser.error(f"--{name.replace('_', '-')} {value} contradicts the run in {args.resume}, "
                         f"which has {saved[name]}")
    parser.set_defaults(**{name: value for name, value in saved.items() if name not in anew or name == "max_frames"})
    resumed = parser.parse_args()
    resumed.script, resumed.segment = args.script, checkpoint["segments"]
    resumed.seed = (resumed.seed + resumed.segment * SEGMENT_SEED) % 2 ** 30
    return resumed


def unblocked(func, *args):
    """func(*args), called in a helper thread and waited for here: a call blocked in C++ (gloo, say)
    would hold back Ctrl-C and SIGTERM, which Python delivers to the main thread, until it returned.
    What it raises is raised here."""
    outcome = {}

    def call():
        try:
            outcome["result"] = func(*args)
        except Exception as error:   # handed to the caller, who knows what it means
            outcome["error"] = error
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


# ---------------------------------------------------------------- child processes
class ChildProcesses:
    """Children started with spawn, each running target(*args, send=send) with a pipe of its own to this
    process. send(message) returns once this process has taken the message: a child runs at most one
    message ahead of its reader on every OS, whatever the pipe's buffer holds. Iterating yields what
    the children send, and raises ChildProcessError as soon as a child is dead, however it died: a
    child killed mid-message gives EOF on its own pipe, never a reader that waits forever.
    Leaving the with-block stops them all: none is left behind."""

    def __init__(self, target, children):
        """children: {name: args} for each child process."""
        ctx = torch.multiprocessing.get_context("spawn")   # CUDA needs spawn; macOS and Windows use it
        self.procs, self.pipes, self.child_ends = [], [], []
        for name, args in children.items():
            pipe, child_end = ctx.Pipe()
            self.procs.append(ctx.Process(target=_child_main, args=(target, args, child_end), name=name,
                                          daemon=True))   # ended at exit even if a later start fails
            self.pipes.append(pipe)
            self.child_ends.append(child_end)

    def __enter__(self):
        """Start the children with Ctrl-C ignored, which they inherit (on POSIX): a terminal sends it
        to the whole process group, and the run must stop through this process alone, also while the
        children import. A Ctrl-C in the milliseconds that start() takes is lost: press it again."""
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for proc, child_end in zip(self.procs, self.child_ends):
                proc.start()
                child_end.close()   # now the child holds its only end: its death gives EOF here
        finally:
            signal.signal(signal.SIGINT, handler)
        return self

    def __iter__(self):
        """What the children send, in the order it arrives, forever."""
        sentinels = {proc.sentinel: proc for proc in self.procs}
        owners = dict(zip(self.pipes, self.procs))
        while True:
            for ready in multiprocessing.connection.wait(self.pipes + list(sentinels), timeout=1.0):
                if ready in sentinels:
                    self._died(sentinels[ready])
                try:
                    message = ready.recv()
                    ready.send(None)          # taken: the child may go on while this process works on it
                except (EOFError, OSError):   # the child is gone, between messages or in the middle of one
                    self._died(owners[ready])
                yield message

    @staticmethod
    def _died(proc):
        """Raise the error that names a dead child and its exit code (and signal)."""
        proc.join(timeout=5)
        code = proc.exitcode
        signame = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
        raise ChildProcessError(f"{proc.name} exited with code {code}{signame}")

    def __exit__(self, *exc):
        """Terminate the children and wait for them; kill those that do not end."""
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self.pipes:
            pipe.close()


def _child_main(target, args, pipe):
    """What a child runs: the script's target, with a send that waits until the message is taken."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # on Windows too, where it is not inherited

    def send(message):
        pipe.send(message)
        pipe.recv()   # the main process's word that it took the message

    try:
        target(*args, send=send)
    except (BrokenPipeError, ConnectionResetError, EOFError):   # the main process is gone
        sys.exit(1)


# ---------------------------------------------------------------- shared memory
def share_memory(parser, *shared):
    """Move each tensor or SharedWeights into shared memory, before any child starts. Where there is
    not room for them all (Docker gives /dev/shm 64 MB), the run stops here with one line that says
    what it needs, what is free and the cure, and exit code 2. Linux counts the room in /dev/shm
    first; on every OS torch's own failure is caught (macOS and Windows share through files, with
    no /dev/shm to count)."""
    needed, free = sum(item.nbytes for item in shared), shm_free()
    if free is not None and needed > free:
        parser.error(shm_short(needed, free))
    try:
        for item in shared:
            item.share_memory_()
    except (RuntimeError, OSError) as error:   # torch's word for no room, or no shared memory at all
        parser.error(shm_short(needed, free, error))


def shm_free():
    """Bytes free in /dev/shm, where Linux keeps shared memory; None where there is none."""
    try:
        stat = os.statvfs("/dev/shm")
    except (AttributeError, OSError):   # Windows has no statvfs, macOS no /dev/shm
        return None
    return stat.f_bavail * stat.f_frsize


def shm_short(needed, free, error=None):
    """The one line for a run that needs `needed` bytes of shared memory and cannot have them."""
    size = 2 ** math.ceil(math.log2(2 * needed / 2 ** 20))   # MiB: twice the need, a power of 2
    have = f"/dev/shm has {free / 1e6:.1f} MB free" if free is not None else "the system could not give it"
    why = f" ({str(error).strip().splitlines()[0]})" if error is not None else ""
    return (f"shared memory is short: this run shares {needed / 1e6:.1f} MB and {have}{why}; "
            f"in Docker, give the container more with docker run --shm-size={size}m")


def page_lock(tensor):
    """Page-lock this process's mapping of a shared CPU tensor, on Linux, so that copies between it
    and the GPU go straight to memory, not through a staging buffer of the driver's. Each process
    maps shared memory at addresses of its own, so each locks its own mapping, once. A refusal
    raises: CUDA would otherwise report it at the next kernel launch, as that kernel's error. The
    lock ends with the tensor: one that outlived its memory would hold the old pages, and the GPU's
    copies into a later tensor at the same addresses would land there, unseen. Elsewhere the copies
    go through pageable memory (Windows' drivers limit page-locked memory)."""
    if sys.platform != "linux" or tensor.is_pinned():
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())


# ---------------------------------------------------------------- weights for the children
class SharedWeights:
    """The main process's weights where its children read them, in shared CPU memory (share_memory
    puts them there). On the CPU the main process's network itself is shared, and publish and
    refresh do nothing: the children act on it while the main process's optimizer steps write it,
    because copying cost 4 to 9% of the frames per second on 2 cores (docs/RESULTS.md). On a GPU (and
    on the CPU with copies=True, as the tests do) the main process publishes its weights into one
    flat shared tensor after each optimizer step, and each child keeps a copy of its own on the run's device, refreshed
    from there: no GPU tensor crosses a process boundary, so this works where CUDA IPC does not
    (Windows).

    A version orders the copies, as a seqlock does: a publish makes it odd, writes, and makes it
    even. A child copies the weights into a staging buffer between two reads of the version, and
    installs the copy in its network only if the version did not move: no child acts with a torn
    copy. The version is a multiprocessing.Value, whose lock is a full memory barrier on every OS
    (a plain shared integer is not ordered on ARM)."""

    def __init__(self, net, copies=None):
        self.device = next(net.parameters()).device
        self.copies = self.device.type != "cpu" if copies is None else copies
        if self.copies:   # the children's template: the architecture without its values
            self.net = copy.deepcopy(net).to("meta")
            self.flat = torch.nn.utils.parameters_to_vector(net.parameters()).detach().cpu()
        else:
            self.net = net
        self.version = None     # made by share_memory_(): 0, for the weights copied above
        self.installed = None   # the version that this process's copy holds

    @property
    def nbytes(self):
        """The bytes that share_memory_() puts in shared memory."""
        return self.flat.nbytes if self.copies else sum(p.nbytes for p in self.net.parameters())

    def share_memory_(self):
        """Move the weights into shared memory; common.share_memory calls it before any child starts."""
        if not self.copies:
            self.net.share_memory()
            return
        self.flat.share_memory_()
        self.version = torch.multiprocessing.get_context("spawn").Value("q", 0)
        if self.device.type == "cuda":
            page_lock(self.flat)

    def publish(self, net):
        """Copy the main process's weights into shared memory (waiting for the copy off the GPU)."""
        if not self.copies:
            return
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(net.parameters())
        self.version.value += 1   # odd: a publish is under way
        self.flat.copy_(flat)
        self.version.value += 1   # even: the weights are whole

    def copy_to(self, device):
        """A child's network on device: its own copy of the published weights, or, on the CPU
        without copies, the main process's network itself."""
        if not self.copies:
            return self.net
        net = copy.deepcopy(self.net).to_empty(device=device)
        self.staging, self.installed = torch.empty_like(self.flat, device=device), None
        if self.staging.is_cuda:
            page_lock(self.flat)
        if not self.refresh(net):
            raise RuntimeError("no whole copy of the published weights within a second")
        return net

    def refresh(self, net):
        """Install the newest published weights in net, a child's copy, if they are newer than what
        it holds; True once it holds them. A copy that a publish overlapped is taken again, for up
        to a second; after that (a main process that died mid-publish leaves the version odd) net keeps
        the weights it has."""
        if not self.copies:
            return True
        for _ in range(1000):
            version = self.version.value
            if version == self.installed:
                return True
            if version % 2 == 0:                      # no publish under way
                self.staging.copy_(self.flat)         # waits for the copy to the GPU
                if self.version.value == version:     # and none began meanwhile: the copy is whole
                    self._install(net)
                    self.installed = version
                    return True
            time.sleep(0.001)
        return False

    @torch.no_grad()
    def _install(self, net):
        """Copy the staging buffer into net's parameters."""
        for param, value in zip(net.parameters(), self.staging.split([p.numel() for p in net.parameters()])):
            param.copy_(value.view_as(param))
