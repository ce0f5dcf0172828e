"""What every training script's run does beside its algorithm: options, records, checkpoint and
stop."""

import argparse
import contextlib
import copy
import json
import os
import signal
import sys
import threading
import time
import types

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

import common

CHECKPOINT = "checkpoint.pt"  # the whole run, in its folder: what --resume goes on from
CHECKPOINT_FORMAT = 7  # what a checkpoint holds and how; one of another format does not resume
# A resumed run's k-th segment seeds its envs and children with seed + k * SEGMENT_SEED.
SEGMENT_SEED = 10_000
# Options that each segment of a run takes anew, not from the run's checkpoint.
SEGMENT_OPTIONS = ("resume", "cuda", "checkpoint_minutes", "new_hyperparams", "segment", "folder")
LOG_EVERY = 100  # training steps between logged training scalars: reading a GPU tensor waits for it
stop_signal = None  # SIGINT or SIGTERM, once one has asked the run to stop


class ProcessLost(Exception):
    """A process of the run is gone (a child, another rank): the run exits 1 with its line."""


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
    """The options every training script takes; --help shows its docstring's first paragraph."""
    parser = ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument(
        "--env", choices=sorted(common.ENV_IDS), default="pong", help="(default: pong)"
    )
    parser.add_argument("--cuda", action="store_true", help="the networks on the GPU")
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed (default: 0)")
    parser.add_argument("-n", "--name", default="", help="suffix of the run name in runs/")
    parser.add_argument("--max-frames", type=positive_int, help="stop after this many frames")
    parser.add_argument("--bf16", action="store_true", help="the hidden layers in bfloat16")
    parser.add_argument("--resume", metavar="RUN_FOLDER", help="go on with the run in RUN_FOLDER")
    parser.add_argument(
        "--new-hyperparams",
        action="store_true",
        help="with --resume: the script's hyperparameters where they differ from the run's",
    )
    minutes = bounded(float, 0, 10**6, "a number of minutes, 0 for none")
    parser.add_argument(
        "--checkpoint-minutes", type=minutes, default=10, help="between checkpoints (default: 10)"
    )
    return parser


def setup(parser, hyperparams):
    """A run's start: its options (a resumed run's, unless typed again), the env's hyperparameters
    (each replaced by the option of its name if given: --envs) and the checkpoint (or None)."""
    parser.set_defaults(script=os.path.splitext(parser.prog)[0])
    args = parser.parse_args()
    checkpoint = read_checkpoint(parser, args.resume, args.script) if args.resume else None
    if checkpoint:
        # The run's options are the defaults, less those that each segment gives anew.
        run_options = dict(checkpoint["options"])
        for name in SEGMENT_OPTIONS:
            del run_options[name]
        parser.set_defaults(**run_options)
        args = parser.parse_args()
        for name, value in run_options.items():
            # An option typed again must agree with the run's, but for --max-frames: a new budget.
            if name != "max_frames" and getattr(args, name) != value:
                option = f"--{name.replace('_', '-')} {getattr(args, name)}"
                parser.error(f"{option} contradicts the run in {args.resume}, which has {value}")
    sys.stdout.reconfigure(line_buffering=True)  # each line reaches a log file as it is printed
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda given, but no CUDA device is available")
    if args.new_hyperparams and not args.resume:
        parser.error("--new-hyperparams goes with --resume")
    args.segment = checkpoint["segments"] if checkpoint else 0
    # The k-th segment plays new games.
    args.seed = (args.seed + args.segment * SEGMENT_SEED) % 2**30
    run_name = "-".join(
        filter(None, [args.script, args.env, args.name, time.strftime("%Y%m%d-%H%M%S")])
    )
    args.folder = args.resume or os.path.join("runs", run_name)
    if args.bf16 and not bf16_native(args.cuda):
        device = "GPU" if args.cuda else "CPU"
        warn(args, f"--bf16 is emulated on this {device}: it may run slower than fp32")
    # SIGINT and SIGTERM ask the run to stop: a kill stops as cleanly as Ctrl-C.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    params = argparse.Namespace(**hyperparams[args.env])
    for name, value in vars(args).items():
        if name in vars(params) and value is not None:
            setattr(params, name, value)
    if checkpoint and not args.new_hyperparams:
        run_params = checkpoint["hyperparams"]
        changed = [
            f"{name} {vars(params).get(name)} (the run's {run_params.get(name)})"
            for name in run_params | vars(params)
            if vars(params).get(name) != run_params.get(name)
        ]
        if changed:
            parser.error(
                f"--resume: the script's hyperparameters differ from the run's in {args.resume}: "
                f"{', '.join(changed)}; --new-hyperparams goes on with the script's"
            )
    return args, params, checkpoint


def read_checkpoint(parser, folder, script):
    """The mapped checkpoint in folder; missing, damaged, another script's or format's: one line."""
    path = os.path.join(folder, CHECKPOINT)
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as failure:  # whatever the unpickler says of a file it cannot read: its kind
        reason = getattr(failure, "strerror", None) or type(failure).__name__
        parser.error(f"--resume: {path} does not load ({reason})")
    if not isinstance(checkpoint, dict):
        checkpoint = {}
    if (checkpoint.get("script"), checkpoint.get("format")) != (script, CHECKPOINT_FORMAT):
        parser.error(
            f"--resume: {path} is not a checkpoint of {script}, format {CHECKPOINT_FORMAT}: "
            "go on with the code that wrote it"
        )
    return checkpoint


def bf16_native(cuda):
    """Whether the GPU (cuda) or CPU computes in bfloat16 natively; elsewhere torch emulates it."""
    if cuda:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    capabilities = torch.cpu.get_capabilities()
    # The flag named bf16 is arm64's.
    return any(capabilities.get(name, False) for name in ("avx512_bf16", "amx_bf16", "bf16"))


def set_torch_threads(args):
    """Torch's threads in this process, unless OMP_NUM_THREADS chose them: one for CartPole's small
    layers, which more threads do not speed up; for Pong's convolutions, the cores this process may
    use (Run.share_busy_cores gives up all but one while another process shares them)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    if common.atari_game(args.env) is None:
        torch.set_num_threads(1)
    else:  # torch counts cores, not the CPUs this process may use
        torch.set_num_threads(min(torch.get_num_threads(), common.cores_per_process(1)))


def core_times():
    """Seconds this process's main thread has run on a core and waited for one (Linux's schedstat;
    elsewhere none)."""
    try:
        with open("/proc/self/schedstat") as f:
            ran, waited = f.read().split()[:2]
    except OSError:
        return 0.0, 0.0
    return int(ran) / 1e9, int(waited) / 1e9


def request_stop(signum, frame):
    global stop_signal
    stop_signal = stop_signal or signum  # the first signal; the loop takes it at its next question


def warn(args, message):
    print(f"{args.script}.py: warning: {message}", file=sys.stderr)


def error(args, message):
    print(f"{args.script}.py: error: {message}", file=sys.stderr)


def save_whole(obj, path):
    """torch.save obj to path through a synced temporary renamed over it: a kill leaves the old
    file or the new; a failed write (a full disk) leaves the old and raises OSError."""
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except Exception as failure:
        with contextlib.suppress(OSError):  # none was made if open failed
            os.remove(path + ".tmp")
        # torch's zip writer raises its own error over the OSError.
        cause = failure if isinstance(failure, OSError) else failure.__context__
        if not isinstance(cause, OSError):  # not the disk's doing: a bug
            raise
        raise OSError(cause.errno, cause.strerror, path) from None


def quiet_event_writer(hook_args):
    """threading.excepthook: a write that failed in TensorBoard's thread is raised again by the next
    add_scalar, which ends the run in one line; the thread's own traceback is not printed."""
    writer_thread = type(hook_args.thread).__module__.startswith("tensorboard")
    if not (writer_thread and isinstance(hook_args.exc_value, OSError)):
        threading.__excepthook__(hook_args)


class Counters(types.SimpleNamespace):
    """A script's counts over the whole run, such as its training steps: in checkpoint_contents,
    they come back on --resume with the rest."""

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        if state.keys() != vars(self).keys():
            raise ValueError(
                f"counts {', '.join(state)}, where the script has {', '.join(vars(self))}"
            )
        vars(self).update(state)


class RewardTracker:
    """What a run records, in TensorBoard and in lines: episodes and the mean of the last 100
    (solved at the env's bar, best.pt at a new best), training steps, health, time over segments."""

    STATE = ("frames", "steps", "seconds", "rewards", "losses", "best_mean", "solved")

    def __init__(self, args, net, env):
        self.args, self.net = args, net
        # play.py rebuilds the net from this, in best.pt.
        self.model = {
            "script": args.script,
            "env": args.env,
            "obs_shape": tuple(env.single_observation_space.shape),
            "n_actions": int(env.single_action_space.n),
            "bf16": args.bf16,
        }
        self.frames, self.steps, self.seconds = 0, 0, 0.0  # over every segment
        self.rewards, self.losses = [], []  # every episode's, every loss logged
        self.best_mean, self.solved = None, False
        self.writer = self.clock = self.last_print = None  # Run starts them with the segment

    def state_dict(self):
        return {name: getattr(self, name) for name in self.STATE}

    def load_state_dict(self, state):
        vars(self).update(state)

    def update(self, frames, episodes):
        """Record the frame count and finished (reward, steps) episodes; print progress at times."""
        now = time.perf_counter()
        self.seconds += now - self.clock
        self.frames, self.clock = frames, now
        for reward, steps in episodes:
            self.rewards.append(float(reward))
            mean = float(np.mean(self.rewards[-100:]))
            self.writer.add_scalar("episodes/reward", reward, frames)
            self.writer.add_scalar("episodes/avg_reward", mean, frames)
            self.writer.add_scalar("episodes/steps", steps, frames)
            self.writer.add_scalar("episodes/minutes", self.seconds / 60, frames)
            if len(self.rewards) >= 100:  # judge only a full window of 100 episodes
                if self.best_mean is None or mean > self.best_mean:
                    self.save_best(mean)
                self.solved = self.solved or mean >= common.STOP_REWARDS[self.args.env]
            if self.solved:  # the run ends here: later episodes must not move the mean it solved at
                break
        # Progress prints one line an update at most.
        if episodes and (now - self.last_print[1] >= 1.0 or self.solved):
            fps = (frames - self.last_print[0]) / (now - self.last_print[1])
            self.writer.add_scalar("train/avg_fps", fps, frames)
            games = len(self.rewards)
            print(f"{frames}: done {games} games, mean reward {mean:.3f}, speed {fps:.1f} f/s")
            self.last_print = (frames, now)

    def record_step(self, loss, **scalars):
        """Record a training step; log its loss, avg_loss and scalars every LOG_EVERY steps."""
        self.steps += 1
        if (self.steps - 1) % LOG_EVERY == 0:  # .item() of a GPU tensor waits for the GPU
            self.losses.append(torch.as_tensor(loss).item())
            scalars.update(loss=self.losses[-1], avg_loss=np.mean(self.losses[-100:]))
            for name, value in scalars.items():
                self.writer.add_scalar(f"train/{name}", torch.as_tensor(value).item(), self.frames)

    def record_health(self, health):
        """Log common.NetworkHealth's scalars."""
        for name, value in health.items():
            self.writer.add_scalar(f"health/{name}", value, self.frames)

    def save_best(self, mean):
        """best.pt: what rebuilds the net, the run's progress and the weights."""
        self.best_mean = mean
        weights = {name: tensor.cpu() for name, tensor in self.net.state_dict().items()}
        save_whole(
            dict(self.model, frames=self.frames, mean_reward=mean, state_dict=weights),
            os.path.join(self.args.folder, "best.pt"),
        )

    def summary(self):
        """The run in numbers, for the last line of output."""
        return {
            "script": self.args.script,
            "env": self.args.env,
            "frames": self.frames,
            "episodes": len(self.rewards),
            "seconds": round(self.seconds, 1),
            "fps": round(self.frames / self.seconds, 1) if self.seconds else 0.0,
            "mean_reward": float(np.mean(self.rewards[-100:])) if self.rewards else None,
            "solved": self.solved,
        }


class Run:
    """The with-block around a script's loop: due checkpoints, whether to stop, and the stop. A Run
    that records nothing (under torchrun, a rank other than 0) writes nothing at its stop: its exit
    code, and its line where it lost a process."""

    def __init__(self, args, params, tracker, checkpoint_contents, records=True):
        self.args, self.params, self.tracker = args, params, tracker
        self.contents, self.records = checkpoint_contents, records
        for name, value in checkpoint_contents.items():
            if not hasattr(value, "state_dict"):  # --resume could not give it back
                raise TypeError(
                    f"checkpoint_contents[{name!r}] has no state_dict: use runs.Counters"
                )
        self.path = os.path.join(args.folder, CHECKPOINT)
        self.last_checkpoint = tracker.seconds

    def __enter__(self):
        if not self.records:
            return self
        threading.excepthook = quiet_event_writer  # before TensorBoard's writer thread starts
        try:  # the run's first write; a resumed run's events past its checkpoint are dropped
            writer = SummaryWriter(self.args.folder, purge_step=self.tracker.frames + 1)
        except OSError as failed:  # a file in its place, a read-only disk: the run stops here
            error(self.args, f"cannot write in {self.args.folder} ({failed.strerror})")
            sys.exit(2)
        # The hyperparameters, as a table beside the curves (TensorBoard's Text tab).
        rows = [f"|{name}|{value}|" for name, value in vars(self.params).items()]
        writer.add_text(
            "hyperparameters", "\n".join(["|name|value|", "|-|-|", *rows]), self.tracker.frames
        )
        self.tracker.writer, self.tracker.clock = writer, time.perf_counter()
        self.tracker.last_print = (self.tracker.frames, self.tracker.clock)
        self.last_reading = (self.tracker.clock, None)  # (wall time, core_times()); none yet
        return self

    def share_busy_cores(self):
        """Called after each training step: every 10 s, where the main thread waited for a core over
        a quarter of the time it wanted one, another process shares the cores, and torch's threads
        would wait on each other's many times over: the run goes on with one thread for the rest of
        its segment, unless OMP_NUM_THREADS chose them or the network is on a GPU. The readings
        start 10 s into the loop and at a training step, after the run's own emulator threads have
        started and its compiler has compiled."""
        if self.args.cuda or "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == 1:
            return
        now = time.perf_counter()
        last_time, last_cores = self.last_reading
        if now - last_time < 10:
            return
        cores = core_times()
        self.last_reading = (now, cores)
        if last_cores is None:
            return
        ran = cores[0] - last_cores[0]
        waited = cores[1] - last_cores[1]
        if waited > (ran + waited) / 4:
            share = waited / (ran + waited)
            warn(
                self.args,
                f"another process shares these cores (the main thread waited for one {share:.0%} "
                f"of the time it wanted one over {now - last_time:.0f} s): torch goes on with 1 "
                f"thread, not {torch.get_num_threads()}; a --resume on a free CPU takes them again",
            )
            torch.set_num_threads(1)

    def save_checkpoint_if_due(self):
        """Every --checkpoint-minutes of run time, until a signal asks the run to stop."""
        interval = self.args.checkpoint_minutes * 60
        if interval and not stop_signal and self.tracker.seconds - self.last_checkpoint >= interval:
            self.save_checkpoint()

    def should_stop(self):
        """True once the run is solved, at --max-frames, or asked to stop by a signal."""
        at_max = self.tracker.frames >= (self.args.max_frames or sys.maxsize)
        return stop_signal is not None or self.tracker.solved or at_max

    def save_checkpoint(self):
        """The states of what checkpoint_contents lists, the options and the hyperparameters."""
        started, self.last_checkpoint = time.perf_counter(), self.tracker.seconds
        run_seed = (self.args.seed - self.args.segment * SEGMENT_SEED) % 2**30  # not the segment's
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            "script": self.args.script,
            "segments": self.args.segment + 1,
            "options": dict(vars(self.args), seed=run_seed),
            "hyperparams": vars(self.params),
        }
        for name, value in self.contents.items():
            checkpoint[name] = value.state_dict()
        self.tracker.writer.flush()  # the events logged so far reach the disk first
        save_whole(checkpoint, self.path)
        size, seconds = os.path.getsize(self.path) / 1e6, time.perf_counter() - started
        print(f"{self.tracker.frames}: checkpoint written, {size:.1f} MB in {seconds:.1f} s")

    def __exit__(self, exc_type, exc, tb):
        """The stop: the last checkpoint, the summary line and the exit code: 0, 130 or 143 (Ctrl-C,
        SIGTERM), 1 (a process lost) or 2 (a write failed; what was written before stays)."""
        failed_write = self.records and isinstance(exc, OSError)
        if exc_type not in (None, ProcessLost) and not failed_write:
            return False  # a bug: its traceback
        # A child that the signal ended is part of that stop.
        self.exit_code = 128 + stop_signal if stop_signal else int(exc_type is ProcessLost)
        try:
            if isinstance(exc, OSError):  # a write failed
                raise exc
            if self.exit_code == 1:  # a process lost, not to a signal that asked the run to stop
                error(self.args, exc)
            if not self.records:
                return True
            if self.args.checkpoint_minutes:
                self.save_checkpoint()
            if self.tracker.best_mean is None:  # no full window yet: the latest model is the best
                self.tracker.save_best(self.tracker.summary()["mean_reward"])
            self.tracker.writer.close()
        except OSError as failed:
            where = failed.filename or f"in {self.args.folder}"
            error(self.args, f"cannot write {where} ({failed.strerror})")
            self.exit_code = 2
        print(json.dumps(self.tracker.summary()))
        return True


def restore(args, checkpoint, contents):
    """Load each object that contents lists with its state in the checkpoint, then let the file go;
    a state that is missing or does not fit ends the run with one line."""
    for name, value in contents.items():
        if name not in checkpoint:
            error(
                args, f"--resume: the checkpoint holds no {name}: go on with the code that wrote it"
            )
            sys.exit(2)
        state = checkpoint[name]
        try:
            if isinstance(value, torch.optim.Optimizer):
                # Copies, not the file's tensors, which an optimizer keeps; the script's settings
                # (lr, eps), not the run's.
                state = copy.deepcopy(state)
                for group, settings in zip(state["param_groups"], value.param_groups):
                    group.update({key: settings[key] for key in settings if key != "params"})
            value.load_state_dict(state)
        except (KeyError, ValueError, RuntimeError, TypeError) as failure:
            reason = " ".join(str(failure).split())
            error(args, f"--resume: the checkpoint's {name} does not fit this script's ({reason})")
            sys.exit(2)
    checkpoint.clear()  # its last tensors: a mapped file cannot be replaced on Windows
