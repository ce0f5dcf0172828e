"""A run of a script, from its command line to its folder in runs/: the options every script takes
and their checks (a working compiler among them), the stop that SIGINT and SIGTERM ask for, the
reward tracker (TensorBoard, best.pt, the JSON summary, the exit code) and the checkpoint that
--resume goes on from."""
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
import processes

CHECKPOINT = "checkpoint.pt"   # the whole run, in its folder: what --resume goes on from
SEGMENT_SEED = 10_000          # a resumed run's k-th segment seeds its envs and children with seed + k * this
LOG_EVERY = 100                # training steps between logged training scalars: reading a GPU tensor waits for it
stop_signal = None             # SIGINT or SIGTERM, once one has asked the run to stop


def request_stop(signum, frame):
    """SIGINT and SIGTERM handler: ask the run to stop. The tracker stops it at its next update, an
    iteration boundary, so that the checkpoint it writes is consistent: nothing is cut mid-step."""
    global stop_signal
    stop_signal = stop_signal or signum


class WriteFailed(Exception):
    """A file of the run could not be written (a full disk, a read-only one); the message says which,
    why, what it needed and what is free."""


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
    if isinstance(obj, dict):
        return sum(nbytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(value) for value in obj)
    return 0


def full_size(obj):
    """Bytes that obj's state takes in a checkpoint at its largest: a buffer's whole arrays (only their
    filled part is saved), Adam's two moments of every parameter, the tensors of any other state_dict."""
    if isinstance(obj, torch.optim.Optimizer):
        return 2 * sum(param.nbytes for group in obj.param_groups for param in group["params"])
    arrays = [value for value in vars(obj).values() if isinstance(value, (np.ndarray, torch.Tensor))]
    return sum(array.nbytes for array in arrays) if arrays else nbytes(obj.state_dict())


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
    line, not the run. Its writer thread raises the failure at the next call; warn says it."""

    def __init__(self, log_dir, purge_step, warn):
        self.log_dir, self.warn = log_dir, warn
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
            self.warn(f"cannot write the TensorBoard events in {self.log_dir} ({why(error)}), "
                      f"{size(free_bytes(self.log_dir))} free: the run goes on, unlogged")


def quiet_writer_thread(args):
    """threading.excepthook that leaves a failed write of TensorBoard's writer thread to EventWriter's
    one line, with no traceback of its own; anything else goes to the hook it replaced."""
    if not (type(args.thread).__module__.startswith("tensorboard") and isinstance(args.exc_value, OSError)):
        quiet_writer_thread.excepthook(args)


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
        self.stop_reward = common.STOP_REWARDS[args.env]
        self.rewards = collections.deque(maxlen=100)
        self.losses = collections.deque(maxlen=100)
        self.frames = self.episodes = self.train_steps = self.segment = 0
        self.best_mean = self.train_start = self.first_step_seconds = None
        self.earlier = {"seconds": 0.0, "train_frames": 0, "train_seconds": 0.0}   # of the segments before this one
        self.solved, self.exit_code, self.model_unwritten = False, 0, False
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
        if self.args.resume:
            print(f"going on with {self.log_dir} from frame {self.frames}: segment {self.segment + 1}", flush=True)
        # on resume, readers drop what the stopped run logged after its checkpoint: no curve doubles back
        try:
            self.writer = EventWriter(self.log_dir, self.frames + 1 if self.args.resume else None, self.warn)
        except OSError as error:   # a disk that filled since the check at start-up
            print(f"{self.args.script}.py: error: cannot make {self.log_dir} ({why(error)})", file=sys.stderr)
            sys.exit(2)
        if self.args.checkpoint_minutes:
            self.check_room()
        self.start = self.updated = time.perf_counter()
        self.last_print = (self.frames, self.start)
        self.last_checkpoint = self.earlier["seconds"]
        return self

    def warn(self, message):
        print(f"{self.args.script}.py: warning: {message}", file=sys.stderr, flush=True)

    def check_room(self):
        """Say so in one line where the disk has plainly too little room for this run's checkpoints: each
        new one is written beside the one it replaces."""
        checkpoint = sum(full_size(obj) for obj in self.saved.values())
        path = os.path.join(self.log_dir, CHECKPOINT)
        free = (free_bytes(self.log_dir) or 0) + (os.path.getsize(path) if os.path.isfile(path) else 0)
        if free < 2 * checkpoint:
            self.warn(f"{self.log_dir} has {size(free)} free, and this run's checkpoint takes up to "
                      f"{size(checkpoint)}, twice that while a new one replaces it: run from a folder on a "
                      "larger disk, or give --checkpoint-minutes 0 (no checkpoints, none at the stop either: "
                      "no --resume)")

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
            try:
                self.save_checkpoint()
            except WriteFailed as error:   # the run can go on: the next try comes at the next interval
                self.warn(f"{error}: the checkpoint before it stays, the run goes on and tries again "
                          f"after {interval:g} s")
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
        self.writer.flush()   # the events first: a best.pt that fills the disk fails alone
        try:
            save_whole(dict(self.model_info, frames=self.frames, mean_reward=mean, state_dict=state),
                       os.path.join(self.log_dir, "best.pt"))
            self.model_unwritten = False
        except WriteFailed as error:
            if not self.model_unwritten:   # one line until a write of it succeeds
                self.warn(f"{error}: best.pt stays as it was, the run goes on")
            self.model_unwritten = True

    def trained(self, **scalars):
        """Count a training step, just taken. At the first and every LOG_EVERY steps after it (1, 101,
        201, ...), log its scalars (floats or one-element tensors, read then) as train/<name>; a loss
        also feeds train/avg_loss."""
        self.train_steps += 1
        if self.train_start is None:  # the first training step (dqn_compile's compile) is timed apart
            now = time.perf_counter()
            self.first_step_seconds = now - self.updated
            self.train_start = (self.frames, now)
        if (self.train_steps - 1) % LOG_EVERY:
            return
        scalars = {name: float(value.detach() if torch.is_tensor(value) else value) for name, value in scalars.items()}
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
        self.last_checkpoint = checkpoint["seconds"]
        save_whole(checkpoint, path)
        print(f"{self.frames}: checkpoint written, {os.path.getsize(path) / 1e6:.1f} MB in "
              f"{time.perf_counter() - started:.1f} s", flush=True)

    def restore(self, checkpoint):
        """Go on from a checkpoint: the saved objects' states, the counters, the generators."""
        for name, obj in self.saved.items():
            state = checkpoint["state"][name]
            if isinstance(obj, torch.optim.Optimizer):   # it keeps the tensors it is given: copies, not views of the file
                state = copy.deepcopy(state)
            obj.load_state_dict(state)
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
        codes 130 and 143), a lost process (1, with one line). The checkpoint, best.pt and the
        summary are written with further signals ignored (torchrun sends a second SIGTERM)."""
        if exc_type is processes.ProcessLost and stop_signal is None:
            print(f"{self.args.script}.py: error: {exc}", file=sys.stderr, flush=True)
            self.exit_code = 1
        elif exc_type is not None and exc_type is not processes.ProcessLost:
            return False   # a bug: no checkpoint of a state it may have left half-made
        if stop_signal is not None:   # a child that the same signal ended is part of this stop
            self.exit_code = 128 + stop_signal
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        self.stopped = time.perf_counter()   # the run's clock stops: the writes below are not run time
        if self.args.checkpoint_minutes:
            try:
                self.save_checkpoint()
            except WriteFailed as error:   # a solve stays a solve; any other stop could not keep its state
                print(f"{self.args.script}.py: error: {error}: the checkpoint before it stays", file=sys.stderr,
                      flush=True)
                if not self.solved and self.exit_code != 1:   # a lost child stays the reason it ended
                    self.exit_code = 2
        if self.best_mean is None:  # no full window yet: the latest model is the best we know
            self.save_model()
        self.writer.close()
        print(json.dumps(self.summary()), flush=True)
        return True


class SilentTracker:
    """RewardTracker's stand-in on a torchrun rank other than 0: it logs nothing and never decides to
    stop; rank 0's word stops every rank at the same step, a stop asked by a signal included. A lost
    rank (ProcessLost) ends the run here as on rank 0: one line, exit code 1."""

    frames = 0   # rank 0 counts them

    def __init__(self, args, rank):
        self.script, self.rank, self.lost = args.script, rank, False

    @property
    def exit_code(self):
        return 128 + stop_signal if stop_signal is not None else int(self.lost)

    def update(self, frames, episodes):
        return False

    def trained(self, **scalars):
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is processes.ProcessLost:
            if stop_signal is None:
                print(f"{self.script}.py: error: rank {self.rank} {exc}", file=sys.stderr, flush=True)
            self.lost = True
            return True
        return False


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


def minutes(text):
    """argparse type of --checkpoint-minutes: a number of minutes from 0 (none) to a million; 0.5 is 30 s."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 10 ** 6:   # NaN too
        raise argparse.ArgumentTypeError(f"expected a number of minutes, 0 for none, got {text!r}")
    return value


positive_int = bounded_int(1, sys.maxsize, "a positive integer")
# workers add offsets to the seed, and the C++ env takes int32 seeds
seed_int = bounded_int(0, 2 ** 30 - 1, f"an integer from 0 to {2 ** 30 - 1}")


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
    """Parse and check the command line (with --resume, the checkpoint first: its options, checked
    against those given) and make SIGINT and SIGTERM ask the run to stop; returns args and the env's
    hyperparameters (from the script's table, as attributes)."""
    args = parser.parse_args()
    args.script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
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
    return args, types.SimpleNamespace(**hyperparams[args.env])


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
    """torch.compile(fn, mode=mode), after a first call on probe_args (dqn_compile's acting): compilation
    happens there, and on a machine where it cannot (no C++ compiler, a Python that this torch cannot
    compile) the run stops now, with one line that points to dqn_fast.py. The compiler's notices of
    its own choices (the optimizer's profiler marks it skips, where it looked for CUDA) stay unprinted."""
    torch._logging.set_logs(dynamo=logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        compiled = torch.compile(fn, mode=mode)   # raises at once on a Python that torch cannot compile
        compiled(*probe_args)
    except Exception as e:  # whatever the compiler raised: its first line says why
        parser.error(f"torch.compile fails here ({str(e).strip().splitlines()[0]}); dqn_fast.py runs without it")
    return compiled


def rank0_options(parser, args, hyperparams):
    """Under torchrun, rank 0's options on every rank, and the hyperparameters of its env: a resumed
    run's come from its checkpoint, which only rank 0 reads (ranks on other machines cannot see its
    folder), and must have as many ranks."""
    options = [vars(args)]
    torch.distributed.broadcast_object_list(options, src=0)
    args, world_size = argparse.Namespace(**options[0]), torch.distributed.get_world_size()
    if getattr(args, "world_size", world_size) != world_size:
        parser.error(f"--resume: the run in {args.resume} has {args.world_size} ranks, not {world_size}")
    args.world_size = world_size
    return args, types.SimpleNamespace(**hyperparams[args.env])


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
