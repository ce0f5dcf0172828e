"""What every training script's run does beside its algorithm: options, records, checkpoint, stop
and exit code."""

import argparse
import collections
import contextlib
import copy
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

import common

CHECKPOINT = "checkpoint.pt"  # the whole run, in its folder: what --resume goes on from
CHECKPOINT_FORMAT = 5  # what a checkpoint holds and how; one of another format does not resume
# A resumed run's k-th segment seeds its envs and children with seed + k * SEGMENT_SEED.
SEGMENT_SEED = 10_000
LOG_EVERY = 100  # training steps between logged training scalars: reading a GPU tensor waits for it
stop_signal = None  # SIGINT or SIGTERM, once one has asked the run to stop


class ProcessLost(Exception):
    """A process of the run is gone (a child, another rank): the run exits 1 with its line."""


class WriteFailed(Exception):
    """A file of the run could not be written: the message names it and says why."""


class ArgumentParser(argparse.ArgumentParser):
    """Bad input ends in one line and exit code 2, not a usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def bounded(kind, low, high, expected):
    """An argparse type: a number of that kind from low to high, else 'expected ..., got ...'."""

    def parse(text):
        with contextlib.suppress(ValueError):
            if low <= kind(text) <= high:  # NaN is not
                return kind(text)
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")

    return parse


positive_int = bounded(int, 1, sys.maxsize, "a positive integer")
# A seed plus the workers' offsets stays an int32.
seed_int = bounded(int, 0, 2**30 - 1, f"an integer from 0 to {2**30 - 1}")


def argument_parser(description):
    """The options every training script takes; scripts add their own. --help shows the first
    paragraph of the script's docstring."""
    parser = ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument(
        "--env", choices=sorted(common.ENV_IDS), default="pong", help="env (default: pong)"
    )
    parser.add_argument(
        "--cuda", action="store_true", help="run the network of every process on the GPU"
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed (default: 0)")
    parser.add_argument("-n", "--name", default="", help="suffix of the run name in runs/")
    parser.add_argument("--max-frames", type=positive_int, help="stop after this many frames")
    parser.add_argument(
        "--bf16", action="store_true", help="mixed precision: the hidden layers in bfloat16"
    )
    parser.add_argument(
        "--resume", metavar="RUN_FOLDER", help="go on with the stopped run in RUN_FOLDER"
    )
    parser.add_argument(
        "--checkpoint-minutes",
        type=bounded(float, 0, 10**6, "a number of minutes, 0 for none"),
        default=10,
        help="minutes of run time between checkpoints, 0 for none (default: 10)",
    )
    return parser


def setup(parser, hyperparams):
    """A run's start, in its steps; returns args and the env's hyperparameters (an option's where
    one is named so)."""
    args = options(parser, hyperparams)
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda given, but no CUDA device is available")
    # The warning comes once a run, from rank 0.
    if args.bf16 and not bf16_native(args.cuda) and not int(os.environ.get("RANK", 0)):
        warn(
            args,
            f"--bf16 is emulated on this {'GPU' if args.cuda else 'CPU'}: "
            "it may run slower than fp32",
        )
    # SIGINT and SIGTERM ask the run to stop: a kill stops as cleanly as Ctrl-C.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    return args, argparse.Namespace(
        **{k: getattr(args, k, v) for k, v in hyperparams[args.env].items()}
    )


def options(parser, hyperparams):
    """The command line over a resumed run's options, else like-named hyperparameters (--envs)."""
    args = parser.parse_args()
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    # Under torchrun, rank 0 reads the checkpoint and a3c_dist sends it on.
    rank = int(os.environ.get("RANK", 0))
    checkpoint = read_checkpoint(parser, args.resume, script) if args.resume and rank == 0 else None
    # The run's options, less those that each segment gives anew.
    run_options = (
        {
            name: value
            for name, value in checkpoint["options"].items()
            if name not in ("resume", "cuda", "checkpoint_minutes")
        }
        if checkpoint
        else {}
    )
    parser.set_defaults(
        **{name: value for name, value in hyperparams[args.env].items() if name in vars(args)}
        | run_options
    )
    args = parser.parse_args()
    for name, value in run_options.items():  # an option typed again must agree with the run's
        # --max-frames, the whole run's budget, may differ: it stays the run's unless given.
        if name != "max_frames" and getattr(args, name) != value:
            parser.error(
                f"--{name.replace('_', '-')} {getattr(args, name)} contradicts the run in "
                f"{args.resume}, which has {value}"
            )
    args.script, args.segment = script, checkpoint["segments"] if checkpoint else 0
    # The k-th segment plays new games.
    args.seed = (args.seed + args.segment * SEGMENT_SEED) % 2**30
    args.folder = args.resume or os.path.join(
        "runs",
        "-".join(filter(None, [script, args.env, args.name, time.strftime("%Y%m%d-%H%M%S")])),
    )
    return args


def bf16_native(cuda):
    """Whether the GPU (cuda) or CPU computes in bfloat16 natively; elsewhere torch emulates it."""
    if cuda:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    capabilities = torch.cpu.get_capabilities()
    # The flag named bf16 is arm64's.
    return any(capabilities.get(name, False) for name in ("avx512_bf16", "amx_bf16", "bf16"))


def request_stop(signum, frame):
    global stop_signal
    stop_signal = stop_signal or signum  # the first signal; the loop takes it at its next question


def warn(args, message):
    print(f"{args.script}.py: warning: {message}", file=sys.stderr, flush=True)


def save_whole(obj, path):
    """torch.save obj to path through a synced temporary renamed over it: a kill leaves the old file
    or the new."""
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # none was made if open failed
            os.remove(path + ".tmp")
        # torch's zip writer raises its own error over the OSError.
        cause = error if isinstance(error, OSError) else error.__context__
        if not isinstance(cause, OSError):  # not the disk's doing: a bug
            raise
        raise WriteFailed(f"cannot write {path} ({cause.strerror})") from None


class EventWriter:
    """TensorBoard's SummaryWriter, but a write that fails (a full disk) ends the logging in one
    line, not the run."""

    def __init__(self, args, purge_step):
        threading.excepthook = self.quiet_writer_thread  # before the writer thread starts
        self.args, self.writer = args, SummaryWriter(args.folder, purge_step=purge_step)

    # add_scalar, flush and close are the SummaryWriter's, until a write fails.
    def __getattr__(self, method):
        return (lambda *args: self.call(method, *args)) if self.writer else (lambda *args: None)

    def call(self, method, *args):
        try:
            getattr(self.writer, method)(*args)
        except OSError as error:
            self.writer = None
            warn(
                self.args,
                f"cannot log to TensorBoard in {self.args.folder} ({error.strerror}): "
                "going on unlogged",
            )

    @staticmethod
    def quiet_writer_thread(hook_args):
        """threading.excepthook: TensorBoard's failed writes are left to call()'s one line."""
        if not (
            isinstance(hook_args.exc_value, OSError)
            and "tensorboard" in type(hook_args.thread).__module__
        ):
            threading.__excepthook__(hook_args)


class RewardTracker:
    """What a run records against frames: TensorBoard scalars, progress lines, the mean of the last
    100 episodes (solved at the env's bar), best.pt at a new best mean,
    and the run's time over every segment."""

    STATE = (
        "frames",
        "episodes",
        "steps",
        "best_mean",
        "solved",
        "seconds",
        "train_frames",
        "train_seconds",
    )

    def __init__(self, args, net, env):
        # Run opens the writer where the segment begins.
        self.args, self.net, self.writer = args, net, None
        # play.py rebuilds the net from this, in best.pt.
        self.model = {
            "script": args.script,
            "env": args.env,
            "obs_shape": tuple(env.single_observation_space.shape),
            "n_actions": int(env.single_action_space.n),
            "bf16": args.bf16,
        }
        self.rewards, self.frames, self.episodes, self.steps = (
            collections.deque(maxlen=100),
            0,
            0,
            0,
        )
        # These are the last 100 losses logged: train/avg_loss is their mean.
        self.losses = collections.deque(maxlen=100)
        self.best_mean, self.solved, self.best_unwritten, self.training = None, False, False, False
        self.warned_dead = False  # a dead layer is told once a segment
        self.seconds, self.train_frames, self.train_seconds = 0.0, 0, 0.0  # over every segment
        self.last_update = self.last_print = self.first_step = None

    def state_dict(self):
        return dict(
            {name: getattr(self, name) for name in self.STATE},
            rewards=list(map(float, self.rewards)),
            losses=list(self.losses),
        )

    def load_state_dict(self, state):
        vars(self).update({name: state[name] for name in self.STATE})
        self.rewards.extend(state["rewards"])
        self.losses.extend(state["losses"])

    def begin(self, writer):  # the segment begins: its events go to writer, its clock starts
        self.writer, self.last_update = writer, time.perf_counter()
        self.last_print = (self.frames, self.last_update)

    def update(self, frames, episodes):
        """Record the frame count and finished (reward, steps) episodes; print progress at times."""
        now = time.perf_counter()
        self.seconds += now - self.last_update
        if self.training:  # training time counts from the end of the segment's first training step
            self.train_frames += frames - self.frames
            self.train_seconds += now - self.last_update
        self.frames, self.last_update = frames, now
        for reward, steps in episodes:
            self.episodes += 1
            self.rewards.append(reward)
            mean = float(np.mean(self.rewards))
            for name, value in (
                ("reward", reward),
                ("avg_reward", mean),
                ("steps", steps),
                ("minutes", self.seconds / 60),
            ):  # run time, over segments
                self.writer.add_scalar(f"episodes/{name}", value, frames)
            if len(self.rewards) == self.rewards.maxlen:  # judge only a full window of 100 episodes
                if self.best_mean is None or mean > self.best_mean:
                    self.save_best(mean)
                self.solved = self.solved or mean >= common.STOP_REWARDS[self.args.env]
            if self.solved:  # the run ends here: later episodes must not move the mean it solved at
                break
        # Progress prints one line an update at most.
        if episodes and (now - self.last_print[1] >= 1.0 or self.solved):
            fps = (frames - self.last_print[0]) / (now - self.last_print[1])
            self.writer.add_scalar("train/avg_fps", fps, frames)
            print(
                f"{frames}: done {self.episodes} games, mean reward {mean:.3f}, "
                f"speed {fps:.1f} f/s",
                flush=True,
            )
            self.last_print = (frames, now)

    def record_step(self, loss, **scalars):
        """Record a training step just taken; log its loss, avg_loss (the mean of the last 100
        losses logged) and scalars at the first step and every LOG_EVERY after it."""
        self.steps += 1
        # The segment's first training step (dqn_compile's compile) is timed apart.
        if not self.training:
            self.first_step, self.training = time.perf_counter() - self.last_update, True
            self.seconds, self.last_update = (
                self.seconds + self.first_step,
                self.last_update + self.first_step,
            )
        if (self.steps - 1) % LOG_EVERY == 0:  # tensors: read now
            self.losses.append(loss.item() if torch.is_tensor(loss) else loss)
            for name, value in dict(
                loss=self.losses[-1], avg_loss=np.mean(self.losses), **scalars
            ).items():
                self.writer.add_scalar(
                    f"train/{name}", value.item() if torch.is_tensor(value) else value, self.frames
                )

    def record_health(self, health):
        """Log common.NetworkHealth's scalars; when a layer is first dead, say so in one line."""
        for name, value in health.items():
            self.writer.add_scalar(f"health/{name}", value, self.frames)
        dead = [
            name.split("/")[0]
            for name, value in health.items()
            if name.endswith("/active") and value < common.DEAD_ACTIVE_SHARE
        ]
        if dead and not self.warned_dead:
            warn(
                self.args,
                f"at {self.frames} frames the network's {' and '.join(dead)} had under "
                f"{common.DEAD_ACTIVE_SHARE:.2%} of its outputs above zero: a dead layer gives "
                "every state nearly the same Q-values, and the run will not learn; stop it and "
                "start again with another --seed (docs/HOW.md, network health)",
            )
            self.warned_dead = True

    def save_best(self, mean):
        """best.pt: what rebuilds the net, the run's progress, the weights; a failed write, one line
        until one works."""
        self.best_mean, state = (
            mean,
            {name: tensor.cpu() for name, tensor in self.net.state_dict().items()},
        )
        self.writer.flush()  # the events first: a best.pt that fills the disk fails alone
        try:
            save_whole(
                dict(self.model, frames=self.frames, mean_reward=mean, state_dict=state),
                os.path.join(self.args.folder, "best.pt"),
            )
            self.best_unwritten = False
        except WriteFailed as error:
            if not self.best_unwritten:
                warn(self.args, f"{error}: best.pt stays as it was, the run goes on")
            self.best_unwritten = True

    def summary(self):
        """The run in numbers, over every segment, for the last line of output."""
        return {
            "script": self.args.script,
            "env": self.args.env,
            "frames": self.frames,
            "train_frames": self.train_frames,
            "episodes": self.episodes,
            "seconds": round(self.seconds, 1),
            "fps": round(self.frames / self.seconds, 1) if self.seconds else 0.0,
            "train_fps": round(self.train_frames / self.train_seconds, 1)
            if self.train_seconds
            else 0.0,
            "first_step_seconds": None if self.first_step is None else round(self.first_step, 1),
            "mean_reward": float(np.mean(self.rewards)) if self.rewards else None,
            "solved": self.solved,
        }


class Run:
    """The with-block around a script's loop: due checkpoints, whether to stop, the stop at exit."""

    def __init__(self, args, tracker, checkpoint_contents, rank=0):
        self.args, self.tracker, self.contents, self.rank, self.exit_code = (
            args,
            tracker,
            checkpoint_contents,
            rank,
            0,
        )
        self.path, self.last_checkpoint = os.path.join(args.folder, CHECKPOINT), tracker.seconds

    def __enter__(self):
        if self.rank:
            return self
        try:  # the run's first write: where it cannot make its folder or write in it, it stops here
            self.tracker.begin(
                EventWriter(self.args, self.tracker.frames + 1 if self.args.resume else None)
            )
        except OSError as error:  # a file in its place, a read-only disk
            print(
                f"{self.args.script}.py: error: cannot write in {self.args.folder} "
                f"({error.strerror})",
                file=sys.stderr,
            )
            sys.exit(2)
        return self

    def save_checkpoint_if_due(self):
        """Every --checkpoint-minutes of run time until a signal asks the run to stop (the stop
        saves the last)."""
        interval = self.args.checkpoint_minutes * 60
        if (
            not (self.rank or stop_signal)
            and interval
            and self.tracker.seconds - self.last_checkpoint >= interval
        ):
            self.save_checkpoint(f", the run goes on and tries again after {interval:g} s")

    def should_stop(self):
        """True once the run is solved, at --max-frames, or asked to stop by a signal (rank 0
        decides for all)."""
        at_max = self.tracker.frames >= (self.args.max_frames or sys.maxsize)
        return not self.rank and (stop_signal is not None or self.tracker.solved or at_max)

    def save_checkpoint(self, goes_on=""):
        """What checkpoint_contents() lists, the options and the random generators; False, after a
        line, if it fails."""
        started, self.last_checkpoint = time.perf_counter(), self.tracker.seconds
        self.tracker.writer.flush()  # the events logged so far reach the disk first
        # This is numpy's legacy generator: its keys, position and cached normal.
        _, keys, *rest = np.random.get_state()
        rng = {
            "torch": torch.get_rng_state(),
            "numpy": [torch.from_numpy(keys.astype(np.int64)), *rest],
        }
        rng.update({"cuda": torch.cuda.get_rng_state()} if self.args.cuda else {})
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            "script": self.args.script,
            "segments": self.args.segment + 1,
            "options": {
                name: value
                for name, value in vars(self.args).items()
                if name not in ("resume", "segment", "folder")
            },
            "rng": rng,
        }
        # The checkpoint keeps the run's seed, not the segment's.
        checkpoint["options"]["seed"] = (self.args.seed - self.args.segment * SEGMENT_SEED) % 2**30
        for name, value in self.contents().items():
            checkpoint[name] = value.state_dict() if hasattr(value, "state_dict") else value
        try:
            save_whole(checkpoint, self.path)
        except WriteFailed as error:
            print(
                f"{self.args.script}.py: {'warning' if goes_on else 'error'}: {error}: "
                f"the checkpoint before it stays{goes_on}",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f"{self.tracker.frames}: checkpoint written, "
            f"{os.path.getsize(self.path) / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
        return True

    def __exit__(self, exc_type, exc, tb):
        """Exit codes: 0, 130/143 (Ctrl-C/SIGTERM), 1 (lost process), 2 (failed last checkpoint)."""
        if exc_type not in (None, ProcessLost):
            return False
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        if stop_signal:  # a child that the signal ended is part of that stop
            self.exit_code = 128 + stop_signal
        elif exc_type:
            print(
                f"{self.args.script}.py: error: {f'rank {self.rank} ' if self.rank else ''}{exc}",
                file=sys.stderr,
            )
            self.exit_code = 1
        if self.rank:
            return True
        if self.args.checkpoint_minutes and not self.save_checkpoint() and not self.tracker.solved:
            # A stop that could not keep its state exits with code 2.
            self.exit_code = self.exit_code if self.exit_code == 1 else 2
        # No full window yet: the latest model is the best we know.
        if self.tracker.best_mean is None:
            self.tracker.save_best(self.tracker.summary()["mean_reward"])
        self.tracker.writer.close()
        print(json.dumps(self.tracker.summary()), flush=True)
        return True


def read_checkpoint(parser, folder, script):
    """The mapped checkpoint in folder; missing, damaged, another script's or format's: one line."""
    path = os.path.join(folder, CHECKPOINT)
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # whatever the unpickler says of a file it cannot read: its kind
        parser.error(
            f"--resume: {path} does not load "
            f"({getattr(error, 'strerror', None) or type(error).__name__})"
        )
    kind = (
        (checkpoint.get("script"), checkpoint.get("format", 1))
        if isinstance(checkpoint, dict)
        else (None, None)
    )
    if kind != (script, CHECKPOINT_FORMAT):  # a checkpoint of older code goes on with that code
        parser.error(
            f"--resume: {path} is a checkpoint of {kind[0] or 'something else'}, "
            f"format {kind[1]}, not of {script}, format {CHECKPOINT_FORMAT}: "
            "go on with the code that wrote it"
        )
    return checkpoint


def restore(folder, contents, device):
    """Restore what contents lists and the random generators; return the counters to the script."""
    checkpoint = torch.load(
        os.path.join(folder, CHECKPOINT), map_location="cpu", mmap=True, weights_only=True
    )
    missing = ", ".join(name for name in contents if name not in checkpoint)
    if missing:  # a script that lists more than the run it goes on with saved
        ArgumentParser().error(
            f"the checkpoint in {folder} holds no {missing}: go on with the code that wrote it"
        )
    for name, value in contents.items():
        # An optimizer keeps the tensors it is given: copies, not the file's.
        if isinstance(value, torch.optim.Optimizer):
            value.load_state_dict(copy.deepcopy(checkpoint[name]))
        elif hasattr(value, "state_dict"):
            value.load_state_dict(checkpoint[name])
    rng, (keys, *rest) = checkpoint["rng"], checkpoint["rng"]["numpy"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), *rest))
    if device.type == "cuda" and "cuda" in rng:  # a segment on the CPU leaves CUDA's as it is
        torch.cuda.set_rng_state(rng["cuda"], device)
    return {
        name: checkpoint[name]
        for name, value in contents.items()
        if not hasattr(value, "state_dict")
    }
