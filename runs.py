"""A run's plumbing, which a script could do without: its options and their checks, what it records
(TensorBoard, best.pt, progress, the JSON summary), its checkpoint, its stop and its exit code."""
import argparse
import collections
import contextlib
import copy
import errno
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import types

import numpy as np
import torch
import torch.distributed
from torch.utils.tensorboard import SummaryWriter

import common

CHECKPOINT = "checkpoint.pt"   # the whole run, in its folder: what --resume goes on from
CHECKPOINT_FORMAT = 2          # what a checkpoint holds and how; a checkpoint of another format does not resume
SEGMENT_SEED = 10_000          # a resumed run's k-th segment seeds its envs and children with seed + k * this
LOG_EVERY = 100                # training steps between logged training scalars: reading a GPU tensor waits for it
stop_signal = None             # SIGINT or SIGTERM, once one has asked the run to stop


def request_stop(signum, frame):
    """SIGINT and SIGTERM handler: ask the run to stop, at its next check between steps."""
    global stop_signal
    stop_signal = stop_signal or signum


class ProcessLost(Exception):
    """A process of the run is gone (a child, another rank): the run ends with its line and exit code 1."""


# ---------------------------------------------------------------- files
class WriteFailed(Exception):
    """A file of the run could not be written; the message says which, why, what it needed and what is free."""


def save_whole(obj, path):
    """torch.save obj to path through a temporary in the same folder, flushed to the disk, then
    renamed over path: a kill at any moment leaves the old file or the new one, never part of one.
    A write that fails, or would plainly not fit, removes its temporary and raises WriteFailed."""
    temporary, needed, folder = path + ".tmp", nbytes(obj), os.path.dirname(path) or "."
    free = free_bytes(folder)
    if free is not None and free < needed:   # not a disk filled to the last byte, to fail
        raise WriteFailed(f"cannot write {path} ({os.strerror(errno.ENOSPC)}): it needs about {size(needed)}, "
                          f"{size(free)} free")
    try:
        with open(temporary, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):   # none was made if open failed
            os.remove(temporary)
        if os_error(error):   # torch's zip writer raises a RuntimeError of its own over the OSError
            raise WriteFailed(f"cannot write {path} ({why(error)}): it needs about {size(needed)}, "
                              f"{size(free_bytes(folder))} free") from None
        raise


def os_error(error):
    """The OSError that error is, or that raised it (its cause or context), else None."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def why(error):
    """The reason in words: that of the OSError behind it (No space left on device), else its first line."""
    cause = os_error(error)
    return cause.strerror if cause is not None and cause.strerror else str(error).strip().splitlines()[0]


def nbytes(obj):
    """Bytes of the tensors in obj, a tensor or dicts, lists and tuples of them."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return sum(nbytes(value) for value in values)


def free_bytes(folder):
    """Bytes free on the disk that holds folder; None where that cannot be read."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def size(count):
    """Bytes in words: 3.5 GB, 12.3 MB, 420.1 kB; ? where unknown."""
    if count is None:
        return "?"
    if count >= 1e9:
        return f"{count / 1e9:.1f} GB"
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{count / 1e3:.1f} kB"


class EventWriter:
    """TensorBoard's SummaryWriter, but a write that fails (a full disk) ends the logging with one
    line, not the run. Its writer thread raises the failure at the next call; warn() says it."""

    def __init__(self, log_dir, purge_step, args):
        self.log_dir, self.args = log_dir, args
        self.writer = SummaryWriter(log_dir, purge_step=purge_step)
        if threading.excepthook is not quiet_writer_thread:
            quiet_writer_thread.excepthook, threading.excepthook = threading.excepthook, quiet_writer_thread

    def add_scalar(self, tag, value, step):
        self._call("add_scalar", tag, value, step)

    def flush(self):
        self._call("flush")

    def close(self):
        self._call("close")

    def _call(self, method, *args):
        if self.writer is None:
            return
        try:
            getattr(self.writer, method)(*args)
        except OSError as error:
            self.writer = None
            warn(self.args, f"cannot write the TensorBoard events in {self.log_dir} ({why(error)}), "
                      f"{size(free_bytes(self.log_dir))} free: the run goes on, unlogged")


def quiet_writer_thread(args):
    """threading.excepthook that leaves a failed write of TensorBoard's writer thread to EventWriter's
    one line, with no traceback of its own; anything else goes to the hook it replaced."""
    if not (type(args.thread).__module__.startswith("tensorboard") and isinstance(args.exc_value, OSError)):
        quiet_writer_thread.excepthook(args)


# ---------------------------------------------------------------- what a run records
class RewardTracker:
    """What a run records against frames: episodes and training scalars in TensorBoard, progress lines,
    the mean of the last 100 episodes (solved at the env's bar), best.pt on a new best mean."""

    def __init__(self, args, net, env):
        self.args, self.clock, self.writer, self.last_print = args, Clock(), None, None   # Run opens the writer
        self.log_dir = args.resume or os.path.join(
            "runs", "-".join(filter(None, [args.script, args.env, args.name, time.strftime("%Y%m%d-%H%M%S")])))
        self.best_model = BestModel(args, net, env, os.path.join(self.log_dir, "best.pt"))
        self.rewards, self.losses = collections.deque(maxlen=100), collections.deque(maxlen=100)
        self.frames = self.episodes = self.steps = 0
        self.solved = False

    def state_dict(self):
        return dict(self.clock.state_dict(self.frames), frames=self.frames, episodes=self.episodes, steps=self.steps,
                    rewards=[float(r) for r in self.rewards], losses=list(self.losses),
                    best_mean=self.best_model.mean, solved=self.solved)

    def load_state_dict(self, state):
        self.frames, self.episodes, self.steps = state["frames"], state["episodes"], state["steps"]
        self.rewards.extend(state["rewards"])
        self.losses.extend(state["losses"])
        self.best_model.mean, self.solved = state["best_mean"], state["solved"]
        self.clock.load_state_dict(state)

    def update(self, frames, episodes):
        """Record the frame count and the finished (reward, steps) episodes; print progress now and then."""
        self.frames, self.clock.last_update = frames, time.perf_counter()
        for reward, steps in episodes:
            self.episodes += 1
            self.rewards.append(reward)
            mean = float(np.mean(self.rewards))
            for name, value in (("reward", reward), ("avg_reward", mean), ("steps", steps),
                                ("minutes", self.clock.run_seconds() / 60)):   # run time, over segments
                self.writer.add_scalar(f"episodes/{name}", value, frames)
            if len(self.rewards) == self.rewards.maxlen:   # judge only a full window of 100 episodes
                if self.best_model.mean is None or mean > self.best_model.mean:
                    self.best_model.save(self.writer, frames, mean)
                self.solved = self.solved or mean >= common.STOP_REWARDS[self.args.env]
            if self.clock.last_update - self.last_print[1] >= 1.0 or self.solved:
                fps = (frames - self.last_print[0]) / (self.clock.last_update - self.last_print[1])
                self.writer.add_scalar("train/avg_fps", fps, frames)
                print(f"{frames}: done {self.episodes} games, mean reward {mean:.3f}, speed {fps:.1f} f/s", flush=True)
                self.last_print = (frames, self.clock.last_update)
            if self.solved:  # the run ends here: later episodes must not move the mean it solved at
                break

    def record_step(self, **scalars):
        """Record a training step just taken; at the first and every LOG_EVERY steps after it, log its
        scalars (floats or one-element tensors, read then); a loss also feeds train/avg_loss."""
        self.steps += 1
        self.clock.trained(self.frames)
        if (self.steps - 1) % LOG_EVERY:
            return
        scalars = {name: float(value.detach() if torch.is_tensor(value) else value) for name, value in scalars.items()}
        if "loss" in scalars:
            self.losses.append(scalars["loss"])
            scalars["avg_loss"] = float(np.mean(self.losses))
        for name, value in scalars.items():
            self.writer.add_scalar(f"train/{name}", value, self.frames)


class Clock:
    """Run time over every segment, and training time: from the end of each segment's first training
    step (dqn_compile's compile is timed apart)."""

    def __init__(self):
        self.past = {"seconds": 0.0, "train_frames": 0, "train_seconds": 0.0}   # the segments before this one
        self.start = self.stopped = self.last_update = self.train_start = self.first_step_seconds = None

    def state_dict(self, frames):
        train_frames, train_seconds = self.train_totals(frames)
        return {"seconds": self.run_seconds(), "train_frames": train_frames, "train_seconds": train_seconds}

    def load_state_dict(self, state):
        self.past = {name: state[name] for name in self.past}

    def begin(self):
        self.start = self.last_update = time.perf_counter()
        return self.start

    def stop(self):
        self.stopped = time.perf_counter()

    def trained(self, frames):
        if self.train_start is None:   # the first training step of this segment
            now = time.perf_counter()
            self.first_step_seconds, self.train_start = now - self.last_update, (frames, now)

    def run_seconds(self):
        return self.past["seconds"] + ((self.stopped or time.perf_counter()) - self.start if self.start else 0.0)

    def train_totals(self, frames):
        train_frames, seconds = self.past["train_frames"], self.past["train_seconds"]
        if self.train_start is not None:
            train_frames += frames - self.train_start[0]
            seconds += (self.stopped or time.perf_counter()) - self.train_start[1]
        return train_frames, seconds


class BestModel:
    """best.pt: what rebuilds the net (for play.py), the run's progress, and the weights as CPU tensors."""

    def __init__(self, args, net, env, path):
        self.args, self.net, self.path, self.mean, self.unwritten = args, net, path, None, False
        self.info = {"script": args.script, "env": args.env, "obs_shape": tuple(env.single_observation_space.shape),
                     "n_actions": int(env.single_action_space.n), "bf16": args.bf16}

    def save(self, writer, frames, mean):
        """Write it with mean, its mean as judged; a write that fails, one line until one succeeds."""
        self.mean = mean
        state = {name: tensor.cpu() for name, tensor in self.net.state_dict().items()}
        writer.flush()   # the events first: a best.pt that fills the disk fails alone
        try:
            save_whole(dict(self.info, frames=frames, mean_reward=mean, state_dict=state), self.path)
            self.unwritten = False
        except WriteFailed as error:
            if not self.unwritten:
                warn(self.args, f"{error}: best.pt stays as it was, the run goes on")
            self.unwritten = True


class SilentTracker:
    """RewardTracker's stand-in on a torchrun rank other than 0, which records nothing."""

    def update(self, frames, episodes):
        pass

    def record_step(self, **scalars):
        pass


def warn(args, message):
    print(f"{args.script}.py: warning: {message}", file=sys.stderr, flush=True)


def summary(tracker, mean):
    """The run in numbers, over every segment, for the last line of output."""
    seconds, (train_frames, train_seconds) = tracker.clock.run_seconds(), tracker.clock.train_totals(tracker.frames)
    first_step = tracker.clock.first_step_seconds
    return {"script": tracker.args.script, "env": tracker.args.env, "frames": tracker.frames,
            "train_frames": train_frames, "episodes": tracker.episodes, "seconds": round(seconds, 1),
            "fps": round(tracker.frames / seconds, 1),
            "train_fps": round(train_frames / train_seconds, 1) if train_seconds else 0.0,
            "first_step_seconds": None if first_step is None else round(first_step, 1),
            "mean_reward": mean, "solved": tracker.solved}


# ---------------------------------------------------------------- its checkpoint
class Checkpoints:
    """The run's checkpoint, every --checkpoint-minutes of run time and at the stop: what contents() lists,
    the options and the random generators, in tensors and plain types (it loads with weights_only)."""

    def __init__(self, args, tracker, contents):
        """contents: a function, so that each write reads the script's counters as they are then."""
        self.args, self.tracker, self.contents = args, tracker, contents
        self.path, self.interval = os.path.join(tracker.log_dir, CHECKPOINT), args.checkpoint_minutes * 60
        self.last = tracker.clock.run_seconds()   # the run time of the last write: past segments' at the start

    def check_room(self):
        """One line where the disk has plainly too little room: a new checkpoint is written beside the old."""
        needed, folder = full_size(self.contents()), self.tracker.log_dir
        free = (free_bytes(folder) or 0) + (os.path.getsize(self.path) if os.path.isfile(self.path) else 0)
        if free < 2 * needed:
            warn(self.args, f"{folder} has {size(free)} free, and this run's checkpoint takes up to {size(needed)}, "
                            "twice that while a new one replaces it: run from a folder on a larger disk, or give "
                            "--checkpoint-minutes 0 (no checkpoints, none at the stop either: no --resume)")

    def write_if_due(self):
        if self.interval and self.tracker.clock.run_seconds() - self.last >= self.interval:
            try:
                self.write()
            except WriteFailed as error:   # the run can go on: the next try comes at the next interval
                warn(self.args, f"{error}: the checkpoint before it stays, the run goes on and tries again "
                                f"after {self.interval:g} s")

    def write_at_stop(self):
        """The last checkpoint; False, after one line, where it fails: a solve stays a solve, any other
        stop could not keep its state."""
        try:
            self.write()
            return True
        except WriteFailed as error:
            print(f"{self.args.script}.py: error: {error}: the checkpoint before it stays", file=sys.stderr, flush=True)
            return False

    def write(self):
        started, self.last = time.perf_counter(), self.tracker.clock.run_seconds()
        self.tracker.writer.flush()   # the events logged so far reach the disk first
        options = dict(vars(self.args), seed=(self.args.seed - self.args.segment * SEGMENT_SEED) % 2 ** 30)  # the run's
        checkpoint = {"format": CHECKPOINT_FORMAT, "script": self.args.script, "segments": self.args.segment + 1,
                      "options": {name: value for name, value in options.items() if name not in ("resume", "segment")},
                      "rng": rng_states(torch.device("cuda" if self.args.cuda else "cpu"))}
        contents = self.contents()
        if checkpoint.keys() & contents.keys():   # a script's bug: its list may not name these
            raise ValueError(f"checkpoint_contents() names {sorted(checkpoint.keys() & contents.keys())}")
        for name, value in contents.items():
            checkpoint[name] = value.state_dict() if hasattr(value, "state_dict") else value
        save_whole(checkpoint, self.path)
        print(f"{self.tracker.frames}: checkpoint written, {os.path.getsize(self.path) / 1e6:.1f} MB in "
              f"{time.perf_counter() - started:.1f} s", flush=True)


def full_size(contents):
    """Bytes that a checkpoint of contents takes at its largest: a buffer's whole arrays (only their
    filled part is saved), Adam's two moments of every parameter, the tensors of any other state."""
    total = 0
    for value in contents.values():
        if isinstance(value, torch.optim.Optimizer):
            total += 2 * sum(param.nbytes for group in value.param_groups for param in group["params"])
        elif hasattr(value, "state_dict"):
            arrays = [array for array in vars(value).values() if isinstance(array, (np.ndarray, torch.Tensor))]
            total += sum(array.nbytes for array in arrays) if arrays else nbytes(value.state_dict())
    return total


def restore(folder, contents, device):
    """Restore the objects that contents lists, and the random generators, from the checkpoint in
    folder; returns the counters it holds, for the script to take back. Nothing keeps the file mapped."""
    checkpoint = torch.load(os.path.join(folder, CHECKPOINT), map_location="cpu", mmap=True, weights_only=True)
    missing = [name for name in contents if name not in checkpoint]
    if missing:   # the script's list has changed since the checkpoint was written
        print(f"{os.path.basename(sys.argv[0])}: error: --resume: the checkpoint in {folder} holds no "
              f"{', '.join(missing)}: go on with the code that wrote it", file=sys.stderr, flush=True)
        sys.exit(2)
    for name, value in contents.items():
        if isinstance(value, torch.optim.Optimizer):   # it keeps the tensors it is given: copies, not the file's
            value.load_state_dict(copy.deepcopy(checkpoint[name]))
        elif hasattr(value, "state_dict"):
            value.load_state_dict(checkpoint[name])
    set_rng_states(checkpoint["rng"], device)
    return {name: checkpoint[name] for name, value in contents.items() if not hasattr(value, "state_dict")}


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
    numpy = states["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


# ---------------------------------------------------------------- its stop
class Run:
    """The with-block around a script's loop, which asks it between steps whether to stop. Every stop ends
    at its exit, where the last checkpoint, best.pt if none yet, and the summary are written."""

    def __init__(self, args, tracker, checkpoint_contents, rank=0):
        """checkpoint_contents: the script's function that lists what a checkpoint holds; rank: torchrun's."""
        self.args, self.tracker, self.rank, self.exit_code = args, tracker, rank, 0
        self.checkpoints = Checkpoints(args, tracker, checkpoint_contents) if rank == 0 else None

    def __enter__(self):
        """The run begins: its folder and TensorBoard writer are made, its clock starts."""
        tracker = self.tracker
        if self.rank:
            return self
        if self.args.resume:
            print(f"going on with {tracker.log_dir} from frame {tracker.frames}: segment {self.args.segment + 1}, "
                  f"on the {'GPU' if self.args.cuda else 'CPU'}", flush=True)   # --cuda is each segment's own
        try:   # on resume, readers drop what the stopped run logged after its checkpoint: no curve doubles back
            tracker.writer = EventWriter(tracker.log_dir, tracker.frames + 1 if self.args.resume else None, self.args)
        except OSError as error:   # a disk that filled since the check at start-up
            print(f"{self.args.script}.py: error: cannot make {tracker.log_dir} ({why(error)})", file=sys.stderr)
            sys.exit(2)
        if self.args.checkpoint_minutes:
            self.checkpoints.check_room()
        tracker.last_print = (tracker.frames, tracker.clock.begin())
        return self

    def should_stop(self):
        """Between steps (a checkpoint that is due is written here): True once the run is solved, at
        --max-frames, or asked to stop by a signal. Under torchrun only rank 0 decides."""
        if self.rank:
            return False
        if stop_signal is None:
            self.checkpoints.write_if_due()
        at_max = self.args.max_frames is not None and self.tracker.frames >= self.args.max_frames
        return stop_signal is not None or self.tracker.solved or at_max

    def __exit__(self, exc_type, exc, tb):
        """Exit codes: 0, 130 and 143 for Ctrl-C and SIGTERM (later ones ignored: torchrun sends two), 1 for a
        lost process, 2 for a last checkpoint that failed (not a solve); any other error is a bug."""
        if exc_type is not None and exc_type is not ProcessLost:
            return False
        if exc_type is ProcessLost and stop_signal is None:   # a child that a signal ended is part of that stop
            print(f"{self.args.script}.py: error: {f'rank {self.rank} ' if self.rank else ''}{exc}", file=sys.stderr,
                  flush=True)
            self.exit_code = 1
        self.exit_code = 128 + stop_signal if stop_signal is not None else self.exit_code
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        if self.rank:
            return True
        self.tracker.clock.stop()   # the writes below are not run time
        if self.args.checkpoint_minutes and not self.checkpoints.write_at_stop():
            self.exit_code = 2 if not self.tracker.solved and self.exit_code != 1 else self.exit_code
        mean = float(np.mean(self.tracker.rewards)) if self.tracker.rewards else None
        if self.tracker.best_model.mean is None:   # no full window yet: the latest model is the best we know
            self.tracker.best_model.save(self.tracker.writer, self.tracker.frames, mean)
        self.tracker.writer.close()
        print(json.dumps(summary(self.tracker, mean)), flush=True)
        return True


# ---------------------------------------------------------------- command line
class ArgumentParser(argparse.ArgumentParser):
    """Bad input ends with one line and exit code 2, not a usage dump. --help shows the first
    paragraph of the description (a script's docstring): what it does, not how its processes talk."""

    def __init__(self, description, **kwargs):
        super().__init__(description=description.split("\n\n")[0], **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def number(kind, low, high, expected):
    """argparse type: a number of that kind (int, float) from low to high, else 'expected ..., got ...'."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:   # NaN too
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = number(int, 1, sys.maxsize, "a positive integer")
# workers add offsets to the seed, and the C++ env takes int32 seeds
seed_int = number(int, 0, 2 ** 30 - 1, f"an integer from 0 to {2 ** 30 - 1}")
minutes = number(float, 0, 10 ** 6, "a number of minutes, 0 for none")   # 0.5 is 30 s


def argument_parser(description):
    """The options every script takes; scripts add their own."""
    parser = ArgumentParser(description)
    parser.add_argument("--env", choices=sorted(common.ENV_IDS), default="pong", help="env (default: pong)")
    parser.add_argument("--cuda", action="store_true", help="run the network of every process on the GPU")
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed (default: 0)")
    parser.add_argument("-n", "--name", default="", help="suffix of the run name in runs/")
    parser.add_argument("--max-frames", type=positive_int, help="stop after this many frames")
    parser.add_argument("--bf16", action="store_true",
                        help="mixed precision: the network's hidden layers compute in bfloat16")
    parser.add_argument("--resume", metavar="RUN_FOLDER",
                        help="go on with the stopped run in RUN_FOLDER, from its checkpoint, with its options")
    parser.add_argument("--checkpoint-minutes", type=minutes,
                        default=10, help="minutes of run time between checkpoints, 0 for none (default: 10)")
    return parser


def bf16_native(device):
    """Whether the device computes in bfloat16 natively; elsewhere torch emulates it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(name, False) for name in ("avx512_bf16", "amx_bf16", "bf16"))  # bf16: arm64


def setup(parser, hyperparams):
    """Parse and check the command line (with --resume, against the checkpoint's options) and make SIGINT
    and SIGTERM ask the run to stop; returns args and the env's hyperparameters, as attributes."""
    args = parser.parse_args()
    args.script, args.segment = os.path.splitext(os.path.basename(sys.argv[0]))[0], 0
    if args.resume and os.environ.get("RANK", "0") == "0":   # under torchrun rank 0 reads it, and sends it on
        args = resumed_options(parser, args)
    if os.environ.get("RANK", "0") == "0":   # the one process that writes the run's folder
        check_writable(parser, args.resume or "runs")
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
    return args, hyperparameters(args, hyperparams)


def hyperparameters(args, hyperparams):
    """The env's hyperparameters from the script's table, as attributes. One that an option of its name
    (--envs, --processes) gives takes the option's value; args keeps the value the run uses."""
    params = types.SimpleNamespace(**hyperparams[args.env])
    for name in vars(params).keys() & vars(args).keys():
        value = getattr(args, name)
        setattr(args, name, getattr(params, name) if value is None else value)
        setattr(params, name, getattr(args, name))
    return params


def check_writable(parser, folder):
    """Stop with one line where the run cannot write in its folder (or make it): a file in its place,
    a read-only disk."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        parser.error(f"{folder} is a file: the run writes in a folder of that name")
    where = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as error:
        parser.error(f"cannot write in {where} ({why(error)})")


def compile_or_exit(parser, fn, mode, probe_args):
    """torch.compile(fn, mode=mode), compiled by a first call on probe_args: where it cannot compile (no C++
    compiler, a Python this torch cannot compile for) the run stops now, with one line naming dqn_fast.py."""
    torch._logging.set_logs(dynamo=logging.ERROR)   # the compiler's notices of its own choices stay unprinted
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        compiled = torch.compile(fn, mode=mode)   # raises at once on a Python that torch cannot compile
        compiled(*probe_args)
    except Exception as e:  # whatever the compiler raised: its first line says why
        parser.error(f"torch.compile fails here ({str(e).strip().splitlines()[0]}); dqn_fast.py runs without it")
    return compiled


def rank0_options(parser, args, hyperparams):
    """Under torchrun, rank 0's options and its env's hyperparameters on every rank: only rank 0 reads a
    resumed run's checkpoint (other machines cannot see its folder), which must have as many ranks."""
    options = [vars(args)]
    torch.distributed.broadcast_object_list(options, src=0)
    args, world_size = argparse.Namespace(**options[0]), torch.distributed.get_world_size()
    if getattr(args, "world_size", world_size) != world_size:
        parser.error(f"--resume: the run in {args.resume} has {args.world_size} ranks, not {world_size}")
    args.world_size = world_size
    return args, hyperparameters(args, hyperparams)


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
    if checkpoint.get("format", 1) != CHECKPOINT_FORMAT:
        parser.error(f"--resume: {path} is of checkpoint format {checkpoint.get('format', 1)}, and this {script}.py "
                     f"reads format {CHECKPOINT_FORMAT}: go on with the code that wrote it")
    return checkpoint


def resumed_options(parser, args):
    """The run's options, from its checkpoint. Options given on the command line must agree with it,
    but --max-frames (the whole run's budget) and --cuda (the device is the segment's own); the
    envs and children of the k-th segment play with seed + k * SEGMENT_SEED, new games."""
    checkpoint = read_checkpoint(parser, args.resume, args.script)
    run_options = checkpoint["options"]
    segment_options = {"resume", "max_frames", "cuda", "checkpoint_minutes"}   # each segment may give its own
    missing = object()   # parsing into a namespace that holds it leaves it wherever an option was not given
    typed = parser.parse_args(namespace=argparse.Namespace(**{name: missing for name in vars(args)}))
    for name, value in vars(typed).items():
        if value is not missing and name not in segment_options and name in run_options and value != run_options[name]:
            parser.error(f"--{name.replace('_', '-')} {value} contradicts the run in {args.resume}, "
                         f"which has {run_options[name]}")
    parser.set_defaults(**{name: value for name, value in run_options.items()
                           if name not in segment_options or name == "max_frames"})
    resumed = parser.parse_args()
    resumed.script, resumed.segment = args.script, checkpoint["segments"]
    resumed.seed = (resumed.seed + resumed.segment * SEGMENT_SEED) % 2 ** 30
    return resumed
