#!/usr/bin/env python3
"""Measure the ceilings of this machine, then every script for the same number of training frames,
and print a markdown table: train fps (from the run's events: from the end of its first training
step, in which dqn_compile compiles, to its last record), ratio to dqn_baseline, fraction of the
ceiling, peak memory.
With --bf16, every script runs twice, in fp32 and with --bf16, one after the other, and the table
gives both and their ratio. With --twice, every script runs alone, then two copies of it at once,
as two runs that share the cores do: the table gives each copy's train fps against one alone's.
With --profile, every script runs twice, alone and under py-spy, and a second table and a PNG
show, for each of its processes, the share of time spent in each category of work (CATEGORIES,
RULES)."""

import argparse
import collections
import concurrent.futures
import glob
import json
import os
import platform
import queue
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import types

import ale_py
import gymnasium as gym
import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import a3c_data
import common
import dqn_fast
import runs

SCRIPTS = ["dqn_baseline", "dqn_fast", "dqn_mp", "dqn_compile", "a3c_data", "a3c_grad", "a3c_dist"]
HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- where the time goes (--profile)
CATEGORIES = ["emulator", "acting", "training", "replay", "transport", "waiting", "other"]
COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#bab0ac"]
# A sample of a process's main thread goes to the category of its innermost frame that a rule
# names, else to "other". A rule: (category, a part of the frame's file or None for any file, the
# frame's functions as py-spy names them, Class.method, or None for any function).
RULES = [
    ("emulator", "ale_py/", None),  # the Atari emulators, one env or the C++ vector env
    ("emulator", "gymnasium/", None),  # wrappers, SyncVectorEnv, CartPole
    ("emulator", "common.py", {"FireAndNoopsOnReset.reset"}),
    # This is the forward pass that picks actions.
    ("acting", None, {"select_actions", "DQNAgent.__call__"}),
    # This is dqn_compile's agent: the compiled acting and the wait for its actions.
    ("acting", "dqn_compile.py", {"<lambda>"}),
    (
        "training",
        None,
        {
            "calc_loss_dqn",
            "calc_loss_a2c",
            "unpack_batch_dqn",
            "unpack_batch_a2c",
            "train_step",
            "mean_grads",
        },
    ),
    # This is the training step's graph, replayed.
    ("training", "dqn_compile.py", {"CUDAGraphStep.__call__"}),
    # Only Tensor.backward counts, not all of torch/autograd/: no_grad is there.
    ("training", "torch/_tensor.py", {"Tensor.backward"}),
    ("training", "torch/optim/", None),  # the optimizer step
    ("training", "torch/nn/utils/clip_grad.py", None),
    ("replay", "common.py", {"ReplayBuffer.append", "ReplayBuffer.sample"}),
    ("replay", "dqn_compile.py", {"DeviceReplayBuffer.extend"}),
    # pipes: blocked until another process writes (a message, or that one was taken) is waiting;
    # pickling, writing and unpickling a message is transport (on Windows, the last two names wait)
    (
        "waiting",
        "multiprocessing/connection.py",
        {"wait", "Connection._recv", "_exhaustive_wait", "PipeConnection._recv_bytes"},
    ),
    ("transport", "multiprocessing/connection.py", None),
    ("transport", "torch/distributed/", None),  # collectives
    (
        "transport",
        "processes.py",
        {
            "ChildProcesses.__iter__",
            "SharedWeights.publish",
            "SharedWeights.refresh",
            "SharedWeights.copy_to",
        },
    ),
    # This is the gradient's all_reduce and the reports' all_gather_object.
    ("transport", "a3c_dist.py", {"exchange"}),
]
START_UP = "importlib._bootstrap"  # a sample inside an import is start-up, left out
# Not the job's: a module named in a helper's command line or in its 3 outermost frames, after
# `python -c`, `python -m` or torchrun's launcher (the job calls into one only deeper, to start it).
HELPER = re.compile(
    r"multiprocessing[./]resource_tracker|torch[./]distributed[./]run|compile_worker"
)
CHILD_NAMES = {
    "dqn_mp": "play process",
    "a3c_data": "worker",
    "a3c_grad": "worker",
    "a3c_dist": "rank",
}
FRAME = re.compile(r"(?P<function>.*) \((?P<file>.*):\d+\)$")
PROCESS = re.compile(r'process (?P<pid>\d+):"(?P<cmd>[^"]*)";')  # a command line may hold a ";"
THREAD = re.compile(r"thread \((?P<tid>\d+)\)")


def fail(message):
    """One line on stderr and exit code 2: what the user must change is outside bench.py."""
    print(f"bench.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def category(frames):
    """The category of a stack, given as (function, file) pairs from the outermost frame in."""
    for function, file in reversed(frames):
        for name, part, functions in RULES:
            if (part is None or part in file) and (functions is None or function in functions):
                return name
    return "other"


def read_raw(lines):
    """py-spy's raw output (one stack a line: processes, thread, frames, then the sample count) as
    {pid: (parent pid, Counter of categories)}, main threads only, start-up left out, and helpers
    left out: known by their command line or, as py-spy may read it as empty, by their frames."""
    processes, helpers = {}, set()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        chain, start = [], 0
        # The stack names the process, its parent before it, and so on.
        while match := PROCESS.match(stack, start):
            chain.append(match)
            start = match.end()
        thread, *parts = stack[start:].split(";")
        thread = THREAD.match(thread)
        if not chain or thread is None:
            continue
        pid = int(chain[-1]["pid"])
        parent = int(chain[-2]["pid"]) if len(chain) > 1 else None
        counts = processes.setdefault(pid, (parent, collections.Counter()))[1]
        frames = [(m["function"], m["file"]) for m in map(FRAME.match, parts) if m]
        if HELPER.search(" ".join([chain[-1]["cmd"]] + [file for _, file in frames[:3]])):
            helpers.add(pid)
        if int(thread["tid"]) != pid or any(START_UP in file for _, file in frames):
            continue  # not the main thread (on Linux its id is the pid), or an import
        counts[category(frames)] += int(count)
    return {pid: entry for pid, entry in processes.items() if pid not in helpers}


def label_processes(processes, child_name="child"):
    """{label: Counter}: the job's processes: "main process", and its children child_name 0, 1, ...
    in start order (child_name alone if there is one); under torchrun, whose agent is a helper, the
    ranks, "rank 0", "rank 1", ... in start order."""
    job = dict(sorted(processes.items()))
    labelled, children = {}, []
    for parent, counts in job.values():
        # This is the process py-spy started; under torchrun it is the agent, left out as a helper.
        if parent is None:
            labelled["main process"] = counts
        else:
            children.append(counts)
    if len(children) == 1 and child_name != "rank":
        return dict(labelled, **{child_name: children[0]})
    return dict(labelled, **{f"{child_name} {i}": counts for i, counts in enumerate(children)})


def find_py_spy():
    """py-spy's path: on PATH, or where pip puts the scripts of this Python (a virtual environment's
    python run without activating it, a --user install), or None."""
    folders = [sysconfig.get_path("scripts"), sysconfig.get_path("scripts", f"{os.name}_user")]
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.pathsep.join(folders))


def profile(cmd, out_file, cwd, rate=50, child_name="child"):
    """Run cmd under py-spy, sampling every thread of it and its children, idle or not; returns
    {label: Counter of categories}. If py-spy cannot trace, exit 2 with one line."""
    spy = find_py_spy()
    if spy is None:
        fail("--profile needs py-spy: pip install -r requirements.txt")
    record = [
        spy,
        "record",
        "--subprocesses",
        "--idle",
        "--threads",
        "--format",
        "raw",
        "--rate",
        str(rate),
        "--output",
        out_file,
        "--",
    ]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(
            record + cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=cwd
        )
        err.seek(0)
        message = err.read()
    if proc.returncode != 0 or not os.path.exists(out_file):
        if "ptrace" in message.lower() or "permission" in message.lower():
            fail(
                "py-spy may not trace processes here (ptrace); in Docker, run the container with "
                "--cap-add SYS_PTRACE; on macOS, run bench.py --profile as root"
            )
        last = (
            message.strip().splitlines()[-1] if message.strip() else f"exit code {proc.returncode}"
        )
        fail(f"{' '.join(cmd[:2])} under py-spy failed: {last}")
    with open(out_file) as f:
        return label_processes(read_raw(f), child_name)


def shares_table(profiles):
    """A markdown table of each category's share of main-thread samples, per script and process."""
    lines = [
        "| script | process | " + " | ".join(CATEGORIES) + " | samples |",
        "|---|---|" + "---:|" * (len(CATEGORIES) + 1),
    ]
    for script, processes in profiles.items():
        for label, counts in processes.items():
            total = sum(counts.values()) or 1
            shares = " | ".join(f"{counts[name] / total:.1%}" for name in CATEGORIES)
            lines.append(f"| {script} | {label} | {shares} | {sum(counts.values())} |")
    return "\n".join(lines)


def draw_profiles(profiles, path, title):
    """A PNG: a group of stacked bars per script, one bar per process, a colour per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (script, label, counts)
        for script, processes in profiles.items()
        for label, counts in processes.items()
    ]
    firsts = [i == 0 or script != bars[i - 1][0] for i, (script, _, _) in enumerate(bars)]
    # A gap separates one script's bars from the next's.
    positions = [i + 0.6 * (sum(firsts[: i + 1]) - 1) for i in range(len(bars))]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(bars) + 2), 4.5))
    bottoms = [0.0] * len(bars)
    for name, colour in zip(CATEGORIES, COLOURS):
        heights = [100 * counts[name] / (sum(counts.values()) or 1) for _, _, counts in bars]
        ax.bar(positions, heights, 0.8, bottom=bottoms, color=colour, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(
        positions,
        [
            f"{script}: {label}" if first else label
            for first, (script, label, _) in zip(firsts, bars)
        ],
        rotation=90,
        fontsize=7,
    )
    ax.set_ylabel("share of the process's time (%)")
    ax.set_ylim(0, 100)
    # The title wraps as wide as the figure.
    ax.set_title(textwrap.fill(title, int(12 * fig.get_figwidth())), fontsize=7)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timed_rate(step, items_per_step, seconds):
    """Items per second of step(), after a warm-up, over about the given seconds."""
    for _ in range(3):
        step()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return count * items_per_step / (time.perf_counter() - start)


def env_ceiling(env_name, n_envs, seconds, threads=0, barrier=None):
    """Agent steps/s of the fast vector env alone, random actions; with a barrier, timed from when
    every process that waits on it is ready."""
    env = common.make_fast_env(env_name, n_envs, threads)
    env.reset(seed=0)
    actions = np.zeros(n_envs, dtype=np.int64)

    def step():
        actions[:] = np.random.randint(env.single_action_space.n, size=n_envs)
        env.step(actions)

    if barrier is not None:
        barrier.wait()
    rate = timed_rate(step, n_envs, seconds)
    env.close()
    return rate


def workers_rates(env_name, processes, n_envs, seconds, threads):
    """Agent steps/s of each of `processes` processes stepping at once, each n_envs envs on
    `threads` emulator threads with random actions."""
    ctx = torch.multiprocessing.get_context("spawn")
    barrier, rates = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(
            target=put_env_rate,
            args=(rates, env_name, n_envs, seconds, threads, barrier),
            daemon=True,
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        got = [rates.get(timeout=seconds + 300) for _ in procs]
    except queue.Empty:
        fail("a process of the workers' ceiling sent no rate within 5 minutes")
    for proc in procs:
        proc.join()
    return got


def put_env_rate(rates, env_name, n_envs, seconds, threads, barrier):
    """A process of workers_rates: its env's rate."""
    rates.put(env_ceiling(env_name, n_envs, seconds, threads, barrier))


def real_states(env_name, batch):
    """A batch of observations from the env under random actions."""
    env = common.make_fast_env(env_name, 1)
    states = [env.reset(seed=0)[0][0]]
    while len(states) < batch:
        states.append(env.step(np.array([env.single_action_space.sample()]))[0][0])
    env.close()
    return np.stack(states)


def dqn_ceiling(env_name, space, n_actions, device, seconds, bf16=False):
    """Frames/s the DQN training step alone allows: samples/s at batch 32, divided by 32."""
    params = types.SimpleNamespace(**dqn_fast.HYPERPARAMS[env_name])
    net = dqn_fast.DQN(space.shape, n_actions, bf16).to(device)
    tgt_net = dqn_fast.DQN(space.shape, n_actions, bf16).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    states = real_states(env_name, params.batch_size)
    batch = (
        states,
        np.random.randint(n_actions, size=params.batch_size),
        np.random.rand(params.batch_size).astype(np.float32),
        np.zeros(params.batch_size, dtype=bool),
        states,
    )

    def step():
        optimizer.zero_grad()
        dqn_fast.calc_loss_dqn(batch, net, tgt_net, params.gamma, device).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return timed_rate(step, params.batch_size, seconds) / params.batch_size


def a2c_ceiling(env_name, space, n_actions, device, seconds, bf16=False):
    """Samples/s of the A2C training step alone, at the main process's batch size (128 for Pong)."""
    params = types.SimpleNamespace(**a3c_data.HYPERPARAMS[env_name])
    net = a3c_data.A2C(space.shape, n_actions, bf16).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    states = torch.as_tensor(real_states(env_name, params.batch_size), device=device)
    actions = torch.randint(n_actions, (params.batch_size,), device=device)
    ref_vals = torch.randn(params.batch_size, device=device)

    def step():
        optimizer.zero_grad()
        a3c_data.calc_loss_a2c(net, states, actions, ref_vals, params.entropy_beta)[0].backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), params.clip_grad)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return timed_rate(step, params.batch_size, seconds)


def cpu_model():
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def commit():
    """The git commit of these scripts, with "+changes" where tracked files differ from it."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True
        ).stdout.strip()

    try:
        head, changes = (
            git("rev-parse", "--short", "HEAD"),
            git("status", "--porcelain", "--untracked-files=no"),
        )
    except OSError:  # no git here
        return "unknown"
    return head + ("+changes" if changes else "") if head else "unknown"


def tree_rss(pid):
    """Resident bytes of a process and all its descendants (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
        children = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    except (OSError, StopIteration):
        return 0
    return rss + sum(tree_rss(child) for child in children)


def script_command(script, args, warmup, bf16=False):
    """The command line that runs one script for warm-up + --frames frames."""
    launcher = [sys.executable]
    if script == "a3c_dist":  # as many ranks as the other A3C scripts have workers
        ranks = args.processes or a3c_data.HYPERPARAMS[args.env]["processes"]
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = (
        launcher
        + [
            os.path.join(HERE, f"{script}.py"),
            "--env",
            args.env,
            "--max-frames",
            str(warmup + args.frames),
            "-n",
            "bench",
            # No checkpoint is written: its write is no part of the speed.
            "--checkpoint-minutes",
            "0",
        ]
        + (["--cuda"] if args.cuda else [])
    )
    return cmd + args.script_args.get(script, []) + (["--bf16"] if bf16 else [])


def run_script(script, args, warmup, bf16=False):
    """Run one script for warm-up + --frames frames, in a folder of its own; its JSON summary, its
    train fps and its peak tree memory."""
    cmd = script_command(script, args, warmup, bf16)
    # files, not pipes: a long run cannot fill them and stall
    with (
        tempfile.TemporaryDirectory() as folder,
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
    ):
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=folder)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.5)
        out.seek(0)
        err.seek(0)
        lines, said = out.read().strip().splitlines(), err.read().strip().splitlines()
        if proc.returncode != 0 or not lines:
            fail(f"{script} exited with code {proc.returncode}" + (f": {said[-1]}" if said else ""))
        summary = json.loads(lines[-1])
        summary["train_fps"] = train_fps(folder)
        # A line such as a run's word that it gave up threads tells what the figure measured.
        summary["warnings"] = [line for line in said if ": warning: " in line]
    summary["peak_rss"] = peak
    return summary


def train_fps(folder):
    """Frames a second of the one run made in folder, from its events: from its first train/loss
    (logged at the end of the first training step, in which dqn_compile compiles) to its last."""
    (run_folder,) = glob.glob(os.path.join(folder, "runs", "*"))
    events = EventAccumulator(run_folder, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    first = events.Scalars("train/loss")[0]
    scalars = [event for tag in events.Tags()["scalars"] for event in events.Scalars(tag)]
    last = max(scalars, key=lambda event: event.wall_time)
    return (last.step - first.step) / (last.wall_time - first.wall_time)


def parse_args():
    """The command line, checked; script_args: each script's own options (--envs, --processes)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env", choices=sorted(common.ENV_IDS), default="pong")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument(
        "--frames",
        type=runs.positive_int,
        default=3000,
        help="training frames per script, after its warm-up (default: 3000)",
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="time per ceiling (default: 10)"
    )
    parser.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=SCRIPTS)
    parser.add_argument("--envs", type=runs.positive_int, help="passed to the DQN scripts and A3C")
    parser.add_argument("--processes", type=runs.positive_int, help="passed to the A3C scripts")
    parser.add_argument(
        "--bf16", action="store_true", help="every script in fp32 and with --bf16, with the ratio"
    )
    parser.add_argument(
        "--twice", action="store_true", help="every script alone, then two copies of it at once"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="every script also under py-spy: where each process's time goes (table and PNG)",
    )
    parser.add_argument(
        "--png", default="profile.png", help="where --profile draws (default: profile.png)"
    )
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda given, but no CUDA device is available")
    if args.profile + args.bf16 + args.twice > 1:
        parser.error("--profile, --bf16 and --twice are three benches: run one at a time")
    args.script_args = {s: [] for s in SCRIPTS}
    for script in SCRIPTS[1:]:
        args.script_args[script] += ["--envs", str(args.envs)] if args.envs else []
    for script in ["a3c_data", "a3c_grad"]:
        args.script_args[script] += ["--processes", str(args.processes)] if args.processes else []
    args.scripts = [s for s in args.scripts if os.path.exists(os.path.join(HERE, f"{s}.py"))]
    return args


def measure_ceilings(args, device):
    """Frames (samples) a second of the env alone and of each network's training step alone."""
    env = common.make_fast_env(args.env, 1)
    space, n_actions = env.single_observation_space, env.single_action_space.n
    env.close()
    ceilings = {
        "env": env_ceiling(args.env, 8, args.seconds),
        f"env, {args.dqn_envs} envs": env_ceiling(args.env, args.dqn_envs, args.seconds),
        "DQN net": dqn_ceiling(args.env, space, n_actions, device, args.seconds),
        "A2C net": a2c_ceiling(args.env, space, n_actions, device, args.seconds),
    }
    if any(script.startswith("a3c") for script in args.scripts):
        # What emulators alone allow the workers, each on its share of the cores: their rates' sum.
        ceilings[args.workers] = sum(
            workers_rates(
                args.env,
                args.a3c_processes,
                args.a3c_envs,
                args.seconds,
                common.cores_per_process(args.a3c_processes),
            )
        )
        # and what every core allows: a process a core, each stepping 8 envs on one thread
        ceilings[args.all_cores] = sum(
            workers_rates(args.env, common.cores_per_process(1), 8, args.seconds, 1)
        )
    if args.bf16:
        ceilings["DQN net bf16"] = dqn_ceiling(
            args.env, space, n_actions, device, args.seconds, bf16=True
        )
        ceilings["A2C net bf16"] = a2c_ceiling(
            args.env, space, n_actions, device, args.seconds, bf16=True
        )
    return ceilings


def print_machine_and_ceilings(args, ceilings):
    """The lines above the table: the machine, versions, commit, date, command, ceilings."""
    print(
        f"Machine: {args.machine}; torch {torch.__version__}, gymnasium {gym.__version__}, "
        f"ale-py {ale_py.__version__}; commit {commit()}; {time.strftime('%Y-%m-%d')}; "
        f"command: {args.command}"
    )
    print(
        f"Ceilings: env (C++ vector env, 8 envs, random actions) {ceilings['env']:.0f} frames/s, "
        f"with {args.dqn_envs} envs {ceilings[f'env, {args.dqn_envs} envs']:.0f}; "
        f"DQN net (batch 32 training step) {ceilings['DQN net']:.0f} frames/s; "
        f"A2C net (batch 128 training step) {ceilings['A2C net']:.0f} samples/s"
        + (
            f"; {args.workers} (random actions, at once) {ceilings[args.workers]:.0f} frames/s; "
            f"{args.all_cores} (a process a core, 8 envs each on one thread, random actions, "
            "at once) "
            f"{ceilings[args.all_cores]:.0f} frames/s"
            if args.workers in ceilings
            else ""
        )
    )
    if args.bf16:
        print(
            f"Ceilings with bf16: DQN net {ceilings['DQN net bf16']:.0f} frames/s, "
            f"A2C net {ceilings['A2C net bf16']:.0f} samples/s"
        )
    print()


def warmup_frames(args, script):
    """Frames a script plays before its first training step: a DQN's replay warm-up."""
    return dqn_fast.HYPERPARAMS[args.env]["replay_start"] if script.startswith("dqn") else 0


def bench_bf16(args):
    """Each script in fp32, then with --bf16: the table of both and their ratio."""
    rows = []
    for script in args.scripts:
        fp32 = run_script(script, args, warmup_frames(args, script))
        print(f"  {script}: {json.dumps(fp32)}", file=sys.stderr, flush=True)
        mixed = run_script(script, args, warmup_frames(args, script), bf16=True)
        print(f"  {script} --bf16: {json.dumps(mixed)}", file=sys.stderr, flush=True)
        rows.append((script, fp32, mixed))
    print("| script | train fps, fp32 | train fps, bf16 | bf16 vs fp32 | peak RSS, fp32 / bf16 |")
    print("|---|---:|---:|---:|---:|")
    for script, fp32, mixed in rows:
        print(
            f"| {script} | {fp32['train_fps']:.0f} | {mixed['train_fps']:.0f} "
            f"| {mixed['train_fps'] / fp32['train_fps']:.2f}x "
            f"| {fp32['peak_rss'] / 2**30:.2f} / {mixed['peak_rss'] / 2**30:.2f} GiB |"
        )


def bench_twice(args):
    """Each script alone, then two copies of it started together: each copy's train fps against
    one alone's."""
    rows = []
    for script in args.scripts:
        alone = run_script(script, args, warmup_frames(args, script))
        print(f"  {script}: {json.dumps(alone)}", file=sys.stderr, flush=True)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            copies = [
                pool.submit(run_script, script, args, warmup_frames(args, script)) for _ in "ab"
            ]
            both = [copy.result() for copy in copies]
        for summary in both:
            print(f"  {script}, two at once: {json.dumps(summary)}", file=sys.stderr, flush=True)
        rows.append((script, alone["train_fps"], [summary["train_fps"] for summary in both]))
    print("| script | train fps alone | train fps of each, two at once | each vs alone |")
    print("|---|---:|---:|---:|")
    for script, alone, each in rows:
        print(
            f"| {script} | {alone:.0f} | {each[0]:.0f}, {each[1]:.0f} "
            f"| {each[0] / alone:.2f}x, {each[1] / alone:.2f}x |"
        )


def bench_speed(args, ceilings):
    """Each script's train fps against dqn_baseline's and its ceiling, and, with --profile, under
    py-spy: the table, and where each process's time goes."""
    rows, baseline, profiles = [], None, {}
    for script in args.scripts:
        summary = run_script(script, args, warmup_frames(args, script))
        print(f"  {script}: {json.dumps(summary)}", file=sys.stderr, flush=True)
        bounds = (
            ["DQN net", f"env, {args.dqn_envs} envs"]
            if script.startswith("dqn")
            else ["A2C net", args.all_cores]
        )
        if script == "dqn_baseline":
            baseline = summary["train_fps"]
        if args.profile:
            with tempfile.TemporaryDirectory() as folder:
                profiles[script] = profile(
                    script_command(script, args, warmup_frames(args, script)),
                    os.path.join(folder, "raw"),
                    folder,
                    child_name=CHILD_NAMES.get(script, "child"),
                )
                summary["profiled_fps"] = train_fps(folder)
        rows.append((script, summary, min(bounds, key=ceilings.get)))
    print(
        "| script | train fps | vs dqn_baseline | of ceiling (which) | peak RSS |"
        + (" train fps under py-spy |" if args.profile else "")
    )
    print("|---|---:|---:|---:|---:|" + ("---:|" if args.profile else ""))
    for script, summary, bound in rows:
        ratio = f"{summary['train_fps'] / baseline:.2f}x" if baseline else "-"
        fraction = summary["train_fps"] / ceilings[bound]
        print(
            f"| {script} | {summary['train_fps']:.0f} | {ratio} | {fraction:.0%} ({bound}) "
            f"| {summary['peak_rss'] / 2**30:.2f} GiB |"
            + (f" {summary['profiled_fps']:.0f} |" if args.profile else "")
        )
    if args.profile:
        print_profiles(args, profiles)


def print_profiles(args, profiles):
    """Where each process's time goes: the table, and the PNG at --png."""
    print(
        "\nWhere each process's main thread spends its time (py-spy, idle time counted; start-up "
        "imports, the resource tracker and the torchrun agent left out"
        + ("; DQN's replay warm-up is in" if any(s.startswith("dqn") for s in profiles) else "")
        + "):\n"
    )
    print(shares_table(profiles))
    # The title shows the command, not this machine's folders.
    named = args.command.replace(args.png, os.path.basename(args.png))
    draw_profiles(
        profiles, args.png, f"{args.machine}; torch {torch.__version__}; commit {commit()}; {named}"
    )
    print(f"\n{args.png}: the same, drawn")


def main():
    """Measure the ceilings, then the scripts: their speed (and profiles), fp32 against bf16, or
    one alone against two at once."""
    args = parse_args()
    device = torch.device("cuda" if args.cuda else "cpu")
    args.dqn_envs = args.envs or 3  # as many envs as the DQN scripts step as one
    # As many worker processes as the A3C scripts start.
    args.a3c_processes = args.processes or a3c_data.HYPERPARAMS[args.env]["processes"]
    args.a3c_envs = args.envs or a3c_data.HYPERPARAMS[args.env]["envs"]
    threads = common.cores_per_process(args.a3c_processes)  # a worker's emulator threads
    args.workers = (
        f"env, {args.a3c_processes} workers x {args.a3c_envs} envs on {threads} "
        f"thread{'s' * (threads > 1)} each"
    )
    args.all_cores = f"env, all {common.cores_per_process(1)} cores"
    args.command = " ".join(["python bench.py"] + sys.argv[1:])
    args.machine = f"{cpu_model()}, {os.cpu_count()} cores" + (
        f", {torch.cuda.get_device_name()}" if args.cuda else ""
    )
    if args.bf16:
        native = runs.bf16_native(device.type == "cuda")
        args.machine += f"; bf16 {'native' if native else 'EMULATED (slower than fp32)'}"
    ceilings = measure_ceilings(args, device)
    print_machine_and_ceilings(args, ceilings)
    if args.bf16:
        bench_bf16(args)
    elif args.twice:
        bench_twice(args)
    else:
        bench_speed(args, ceilings)


if __name__ == "__main__":
    main()
