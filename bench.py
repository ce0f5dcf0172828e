#!/usr/bin/env python3
"""Measure the ceilings of this machine, then every script for the same number of training frames,
and print a markdown table: train fps, ratio to dqn_baseline, fraction of the ceiling, peak memory.
With --bf16, every script runs twice, in fp32 and with --bf16, one after the other, and the table
gives both and their ratio."""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types

import ale_py
import gymnasium as gym
import numpy as np
import torch

import a3c_data
import common
import dqn_fast

SCRIPTS = ["dqn_baseline", "dqn_fast", "dqn_mp", "dqn_compile", "a3c_data", "a3c_grad", "a3c_dist"]
HERE = os.path.dirname(os.path.abspath(__file__))


def timed_rate(step, items_per_step, seconds):
    """Items per second of step(), after a warm-up, over about the given seconds."""
    for _ in range(3):
        step()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return count * items_per_step / (time.perf_counter() - start)


def env_ceiling(env_name, n_envs, seconds):
    """Agent steps/s of the fast vector env alone, random actions."""
    env = common.make_fast_env(env_name, n_envs)
    env.reset(seed=0)
    actions = np.zeros(n_envs, dtype=np.int64)

    def step():
        actions[:] = np.random.randint(env.single_action_space.n, size=n_envs)
        env.step(actions)
    rate = timed_rate(step, n_envs, seconds)
    env.close()
    return rate


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
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate)
    states = real_states(env_name, params.batch_size)
    batch = (states, np.random.randint(n_actions, size=params.batch_size),
             np.random.rand(params.batch_size).astype(np.float32),
             np.zeros(params.batch_size, dtype=bool), states)

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
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def commit():
    """The git commit of these scripts, with "+changes" where tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()
    try:
        head, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except OSError:   # no git here
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


def run_script(script, args, warmup, bf16=False):
    """Run one script for warm-up + --frames frames; its JSON summary plus peak tree memory."""
    launcher = [sys.executable]
    if script == "a3c_dist":  # as many ranks as the other A3C scripts have workers
        ranks = args.processes or a3c_data.HYPERPARAMS[args.env]["processes"]
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = launcher + [os.path.join(HERE, f"{script}.py"), "--env", args.env, "--max-frames",
                      str(warmup + args.frames), "-n", "bench"] + (["--cuda"] if args.cuda else [])
    cmd += args.script_args.get(script, []) + (["--bf16"] if bf16 else [])
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: a long run cannot fill it and stall
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.5)
        out.seek(0)
        lines = out.read().strip().splitlines()
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench.py: error: {script} exited with code {proc.returncode}")
    summary = json.loads(lines[-1])
    summary["peak_rss"] = peak
    return summary


def main():
    """Measure the ceilings, run the scripts, print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env", choices=sorted(common.ENV_IDS), default="pong")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--frames", type=common.positive_int, default=3000,
                        help="training frames per script, after its warm-up (default: 3000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="time per ceiling (default: 10)")
    parser.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=SCRIPTS)
    parser.add_argument("--envs", type=common.positive_int, help="passed to the DQN scripts and A3C")
    parser.add_argument("--processes", type=common.positive_int, help="passed to the A3C scripts")
    parser.add_argument("--bf16", action="store_true", help="every script in fp32 and with --bf16, with the ratio")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda given, but no CUDA device is available")
    device = torch.device("cuda" if args.cuda else "cpu")
    args.script_args = {s: [] for s in SCRIPTS}
    for script in SCRIPTS[1:]:
        args.script_args[script] += ["--envs", str(args.envs)] if args.envs else []
    for script in ["a3c_data", "a3c_grad"]:
        args.script_args[script] += ["--processes", str(args.processes)] if args.processes else []

    env = common.make_fast_env(args.env, 1)
    space, n_actions = env.single_observation_space, env.single_action_space.n
    env.close()
    ceilings = {
        "env": env_ceiling(args.env, 8, args.seconds),
        "DQN net": dqn_ceiling(args.env, space, n_actions, device, args.seconds),
        "A2C net": a2c_ceiling(args.env, space, n_actions, device, args.seconds),
    }
    if args.bf16:
        ceilings["DQN net bf16"] = dqn_ceiling(args.env, space, n_actions, device, args.seconds, bf16=True)
        ceilings["A2C net bf16"] = a2c_ceiling(args.env, space, n_actions, device, args.seconds, bf16=True)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    if args.cuda:
        machine += f", {torch.cuda.get_device_name()}"
    if args.bf16:
        machine += f"; bf16 {'native' if common.bf16_native(device) else 'EMULATED (slower than fp32)'}"
    command = " ".join(["python bench.py"] + sys.argv[1:])
    print(f"Machine: {machine}; torch {torch.__version__}, gymnasium {gym.__version__}, "
          f"ale-py {ale_py.__version__}; commit {commit()}; {time.strftime('%Y-%m-%d')}; command: {command}")
    print(f"Ceilings: env (C++ vector env, 8 envs, random actions) {ceilings['env']:.0f} frames/s; "
          f"DQN net (batch 32 training step) {ceilings['DQN net']:.0f} frames/s; "
          f"A2C net (batch 128 training step) {ceilings['A2C net']:.0f} samples/s")
    if args.bf16:
        print(f"Ceilings with bf16: DQN net {ceilings['DQN net bf16']:.0f} frames/s, "
              f"A2C net {ceilings['A2C net bf16']:.0f} samples/s")
    print()

    rows, baseline = [], None
    for script in args.scripts:
        path = os.path.join(HERE, f"{script}.py")
        if not os.path.exists(path):
            continue
        warmup = dqn_fast.HYPERPARAMS[args.env]["replay_start"] if script.startswith("dqn") else 0
        summary = run_script(script, args, warmup)
        print(f"  {script}: {json.dumps(summary)}", file=sys.stderr, flush=True)
        if args.bf16:
            mixed = run_script(script, args, warmup, bf16=True)
            print(f"  {script} --bf16: {json.dumps(mixed)}", file=sys.stderr, flush=True)
            rows.append((script, summary, mixed))
            continue
        bound = "DQN net" if script.startswith("dqn") else "A2C net"
        bound = min([bound, "env"], key=ceilings.get)
        if script == "dqn_baseline":
            baseline = summary["train_fps"]
        rows.append((script, summary, bound))

    if args.bf16:
        print("| script | train fps, fp32 | train fps, bf16 | bf16 vs fp32 | peak RSS, fp32 / bf16 |")
        print("|---|---:|---:|---:|---:|")
        for script, summary, mixed in rows:
            print(f"| {script} | {summary['train_fps']:.0f} | {mixed['train_fps']:.0f} "
                  f"| {mixed['train_fps'] / summary['train_fps']:.2f}x "
                  f"| {summary['peak_rss'] / 2**30:.2f} / {mixed['peak_rss'] / 2**30:.2f} GiB |")
        return
    print("| script | train fps | vs dqn_baseline | of ceiling (which) | peak RSS |")
    print("|---|---:|---:|---:|---:|")
    for script, summary, bound in rows:
        ratio = f"{summary['train_fps'] / baseline:.2f}x" if baseline else "-"
        fraction = summary["train_fps"] / ceilings[bound]
        print(f"| {script} | {summary['train_fps']:.0f} | {ratio} | {fraction:.0%} ({bound}) "
              f"| {summary['peak_rss'] / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
