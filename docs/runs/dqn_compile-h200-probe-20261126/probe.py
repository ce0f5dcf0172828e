"""Where a step of dqn_compile.py goes on the GPU: its parts timed apart, variants of the replay
buffer's copy to the device side by side in the whole loop, and the loop under torch.profiler.
From the project's root on a GPU machine: python docs/runs/dqn_compile-h200-probe-20261126/probe.py [N_ENVS]
(the "pin per call" variant is the buffer's own copy at the commit it runs against)."""
import copy
import sys
import time
import types

import numpy as np
import torch

sys.path.insert(0, ".")
import common  # noqa: E402
import dqn_compile as D  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 3
cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
mode = "reduce-overhead" if cuda else None
P = types.SimpleNamespace(**D.PONG)
env = common.make_fast_env("pong", N)
net = D.DQN(env.single_observation_space.shape, env.single_action_space.n, True).to(dev)
tgt = copy.deepcopy(net)
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
eps = torch.tensor(1.0, device=dev)
torch._dynamo.mark_static_address(eps)
act = torch.compile(D.select_actions, mode=mode)
step = torch.compile(D.train_step, mode=mode)
buf = D.DeviceReplayBuffer(P.replay_size, env.single_observation_space, dev)


def agent(s):
    return act(net, torch.as_tensor(s, device=dev), eps).cpu().numpy()


src = common.ExperienceSourceFirstLast(env, agent, 0.99, seed=0, overlap=cuda)
it = iter(src)


def sync():
    if cuda:
        torch.cuda.synchronize()


t = time.perf_counter()
while len(buf) < 12_000:
    buf.extend(next(it))
print(f"fill: {src.frames / (time.perf_counter() - t):.0f} frames/s (acting, envs, extend)", flush=True)
t = time.perf_counter()
for _ in range(5):
    step(buf, net, tgt, opt, 32 * N, 0.99)
sync()
print(f"train step compile + record: {time.perf_counter() - t:.1f} s", flush=True)
saved = [e for e in (next(it) for _ in range(80)) if e][:64]
obs = np.stack([e.state for e in saved[0]])


def timed(name, fn, n=300):
    sync()
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    host = (time.perf_counter() - t) / n
    sync()
    total = (time.perf_counter() - t) / n
    print(f"{name:46s} host {host * 1e3:7.3f} ms/call   to GPU done {total * 1e3:7.3f} ms/call", flush=True)
    return total


pinned = buf._to_device


def pageable(array):
    return torch.from_numpy(array).to(dev, non_blocking=True)


staged = {}


def reused(array):   # timing only: no event guards the reuse
    key = (array.shape, array.dtype)
    if key not in staged:
        staged[key] = torch.from_numpy(array).pin_memory()
    staged[key].numpy()[...] = array
    return staged[key].to(dev, non_blocking=True)


VARIANTS = {"pin per call": pinned, "pageable": pageable, "pinned, reused": reused} if cuda else {"cpu": pinned}
col = np.stack([e.state for e in saved[0]])
idx = torch.arange(N, device=dev)
src_states = buf.states[:N].clone()
timed("np.stack states", lambda i: np.stack([e.state for e in saved[i % 64]]))
if cuda:
    timed("pin_memory states", lambda i: torch.from_numpy(col).pin_memory())
for name, fn in VARIANTS.items():
    timed(f"states to device: {name}", lambda i: fn(col))
timed("index write states", lambda i: buf.states.__setitem__(idx, src_states))
for name, fn in VARIANTS.items():
    buf._to_device = fn
    timed(f"extend: {name}", lambda i: buf.extend(saved[i % 64]))
buf._to_device = pinned
timed("train step", lambda i: step(buf, net, tgt, opt, 32 * N, 0.99))
timed("act, actions to host", lambda i: agent(obs))
env2 = common.make_fast_env("pong", N)
env2.reset(seed=1)
rng = np.random.default_rng(0)
timed(f"env step ({N} envs)", lambda i: env2.step(rng.integers(6, size=N)))


def iteration(i):
    buf.extend(next(it))
    step(buf, net, tgt, opt, 32 * N, 0.99)


for rounds in range(2):
    for name, fn in VARIANTS.items():
        buf._to_device = fn
        f0 = src.frames
        t = time.perf_counter()
        timed(f"whole iteration: {name}", iteration, 1500)
        print(f"    -> {(src.frames - f0) / (time.perf_counter() - t):.0f} frames/s", flush=True)
buf._to_device = pinned
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for i in range(300):
        iteration(i)
    sync()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), flush=True)
