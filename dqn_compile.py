#!/usr/bin/env python3
"""DQN on Pong, compiled: dqn_fast.py with the replay buffer on the device, acting and the training
step compiled by torch.compile (on the GPU replayed as CUDA graphs), and on the GPU the emulators
playing while the GPU trains. What crosses between host and device, and when: docs/HOW.md."""

import copy
import functools
import logging
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import runs

# ---------------------------------------------------------------- hyperparameters
PONG = dict(
    gamma=0.99,
    learning_rate=1e-4,
    adam_eps=1.5e-4,  # Rainbow's for Atari: torch's 1e-8 let Pong's ReLUs die (docs/RESULTS.md)
    batch_size=32,
    replay_size=100_000,
    replay_start=10_000,  # frames played before the first training step
    target_sync=1_000,  # training steps between target net syncs
    epsilon_start=1.0,
    epsilon_final=0.02,
    epsilon_frames=100_000,  # frames over which epsilon falls linearly to its final value
    envs=3,  # envs stepped as one
)
CARTPOLE = dict(
    PONG,
    learning_rate=1e-3,
    replay_size=10_000,
    replay_start=1_000,
    target_sync=200,
    epsilon_frames=5_000,
)  # learns in a minute
HYPERPARAMS = {"pong": PONG, "cartpole": CARTPOLE}


# ---------------------------------------------------------------- network, agent, loss
class DQN(nn.Module):
    """Q-values of every action: the Nature DQN convolutions for frames, a small MLP for vectors."""

    def __init__(self, obs_shape, n_actions, bf16=False):
        super().__init__()
        self.bf16 = bf16  # mixed precision: the hidden layers in bfloat16, the output layer in fp32
        if len(obs_shape) == 3:
            self.body = nn.Sequential(
                nn.Conv2d(obs_shape[0], 32, kernel_size=8, stride=4),
                nn.ReLU(),
                nn.Conv2d(32, 64, kernel_size=4, stride=2),
                nn.ReLU(),
                nn.Conv2d(64, 64, kernel_size=3, stride=1),
                nn.ReLU(),
                nn.Flatten(),
            )
            hidden = 512
        else:
            self.body = nn.Sequential(nn.Linear(obs_shape[0], 128), nn.ReLU())
            hidden = 128
        features = self.body(torch.zeros(1, *obs_shape)).shape[1]
        self.hidden = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, n_actions)

    def forward(self, x):
        """Q-values [batch, n_actions], in fp32, for a batch of observations."""
        x = x.float() / 255 if x.dtype == torch.uint8 else x  # frames stay uint8 until here
        # entered at every call, so autocast's cached bf16 weights never outlive an optimizer step
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.hidden(self.body(x))
        # The output is in fp32: bf16 Q-values near 100 are 0.5 apart, and argmax would tie.
        return self.out(hidden.float())


def epsilon_by_frame(params, frames):
    """Exploration rate: linear from epsilon_start to epsilon_final in epsilon_frames, then flat."""
    fraction = min(frames / params.epsilon_frames, 1.0)
    return params.epsilon_start + fraction * (params.epsilon_final - params.epsilon_start)


@torch.no_grad()  # acting needs no graph
def select_actions(net, states, epsilon):
    """Epsilon-greedy actions for a state batch, drawn on its device: no sync but the caller's."""
    q_vals = net(states)
    explore = torch.rand(len(states), device=states.device) < epsilon
    random_actions = torch.randint(q_vals.shape[1], (len(states),), device=states.device)
    return torch.where(explore, random_actions, q_vals.argmax(dim=1))


def calc_loss_dqn(batch, net, tgt_net, gamma, device):
    """MSE between Q(s, a) and the one-step target r + gamma * max Q_target(s')."""
    states, actions, rewards, dones, last_states = common.unpack_batch_dqn(batch, device)
    q_vals = net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # no graph for the target: it is a constant
        next_q = tgt_net(last_states).max(dim=1)[0]
    next_q = next_q.masked_fill(dones, 0.0)  # 0 after a terminal state (masked_fill: no GPU sync)
    return F.mse_loss(q_vals, rewards + gamma * next_q)


def train_step(buffer, net, tgt_net, optimizer, batch_size, gamma):
    """One optimizer step on the loss of batch_size transitions sampled on the device, as one
    function for torch.compile; returns the loss."""
    optimizer.zero_grad()
    loss = calc_loss_dqn(buffer.sample(batch_size), net, tgt_net, gamma, buffer.device)
    loss.backward()
    optimizer.step()
    return loss.detach()


# ---------------------------------------------------------------- replay buffer on the device
class DeviceReplayBuffer:
    """common.ReplayBuffer's ring of one-step transitions, each frame stored once, as tensors on the
    device, where the training step samples it: the host keeps the FrameIndex, a step's new frames
    and rows cross to the device, no batch does."""

    COLUMNS = ("rows", *common.ReplayBuffer.ARRAYS)

    def __init__(self, capacity, obs_space, device):
        self.capacity, self.device = capacity, device
        self.count = 0  # transitions ever stored: the ring's position, on the host
        self.index = common.FrameIndex(capacity, obs_space)
        dtype = torch.as_tensor(obs_space.sample()).dtype
        self.frames = torch.zeros(
            (self.index.slots, *self.index.frame_shape), dtype=dtype, device=device
        )
        self.rows = torch.zeros(self.index.rows.shape, dtype=torch.int64, device=device)
        self.actions = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.rewards = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.dones = torch.zeros(capacity, dtype=torch.bool, device=device)
        # The compiled step reads a tensor, not an int.
        self.size = torch.zeros((), dtype=torch.int64, device=device)
        for tensor in (self.frames, self.rows, self.actions, self.rewards, self.dones, self.size):
            # A CUDA graph reads each tensor in place: it is never copied in, never recompiled.
            torch._dynamo.mark_static_address(tensor)

    def __len__(self):
        return min(self.count, self.capacity)

    def extend(self, exps):
        """Store a step's experiences, overwriting the oldest: one copy to the device per array."""
        if not exps:
            return
        pos = np.arange(self.count, self.count + len(exps)) % self.capacity
        new = {}  # slot: frame, the last one placed there
        for i, exp in zip(pos, exps):
            new.update(self.index.place(i, exp))
        if new:
            self.frames[self._to_device(np.array(list(new)))] = self._to_device(
                np.stack(list(new.values()))
            )
        columns = (
            self.index.rows[pos],
            np.array([e.action for e in exps], dtype=np.int64),
            np.array([e.reward for e in exps], dtype=np.float32),
            np.array([e.last_state is None for e in exps]),
        )
        idx = self._to_device(pos)
        for name, column in zip(self.COLUMNS, columns):
            getattr(self, name)[idx] = self._to_device(column)
        self.count += len(exps)
        self.size.fill_(len(self))

    def _to_device(self, array):
        """The array on the device, its copy queued: from pageable memory the driver stages it and
        returns, with no wait for the GPU (pinning the array first costs more than the copy)."""
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def state_dict(self):
        """The filled part as CPU tensors, each its own storage (torch.save writes no more): the
        rows, the store of frames up to its highest used slot, the other columns; and the count."""
        n = len(self)
        filled = {
            name: torch.from_numpy(getattr(self, name)[:n].cpu().numpy()) for name in self.COLUMNS
        }
        slots = int(self.index.rows[:n].max(initial=0)) + 1
        frames = torch.from_numpy(self.frames[:slots].cpu().numpy())
        return dict(filled, frames=frames, capacity=self.capacity, count=self.count)

    def load_state_dict(self, state):
        """Copy a state_dict's tensors into this buffer's own, which the compiled step reads."""
        if state["capacity"] != self.capacity:  # the ring's order holds at its own size only
            raise ValueError(
                f"{state['capacity']} transitions, where the script has {self.capacity}"
            )
        self.count = state["count"]
        self.index.load(state["rows"].numpy(), state["frames"])
        self.frames[: len(state["frames"])] = state["frames"].to(self.device)
        for name in self.COLUMNS:
            getattr(self, name)[: len(self)] = state[name].to(self.device)
        self.size.fill_(len(self))

    def sample(self, batch_size):
        """batch_size transitions drawn uniformly, by indices drawn on the device."""
        return self.transitions((torch.rand(batch_size, device=self.device) * self.size).long())

    def transitions(self, idx):
        """(states, actions, rewards, dones, last_states) at these indices, as
        common.ReplayBuffer.sample gives them: a next state is its state's frames but the oldest,
        and its own newest."""
        rows = self.rows[idx]
        states = self.frames[rows[:, :-1]]
        # Compiled, copying 3 of the states' frames beats a second gather of 4 (on the CPU a step in
        # 0.75 of the time).
        last_states = torch.cat([states[:, 1:], self.frames[rows[:, -1:]]], dim=1)
        if not self.index.stacked:
            states, last_states = states[:, 0], last_states[:, 0]
        return states, self.actions[idx], self.rewards[idx], self.dones[idx], last_states


class OverlappedExperienceSource(common.ExperienceSourceFirstLast):
    """common.ExperienceSourceFirstLast whose envs play each step while the caller trains on the
    experiences of the step before: ale-py's vector env steps in its threads from send to recv."""

    def __iter__(self):
        """Forever: send all envs' actions, yield the last step's experiences while the envs play
        (the first list, before any step, is empty), then take in the step."""
        obs, _ = self.env.reset(seed=self.seed)
        exps = []
        while True:
            actions = self.agent(obs)
            self.env.send(actions)
            yield exps
            next_obs, rewards, terminated, truncated, _ = self.env.recv()
            exps = self.experiences(obs, actions, rewards, terminated, truncated, next_obs)
            obs = next_obs


class CUDAGraphStep:
    """fn(*args) replayed as one CUDA graph, as torch's CUDA notes capture a whole network: the
    first WARMUP_CALLS calls run it on a side stream, the next records it, each one after replays
    it: the whole training step in one launch,
    where mode="reduce-overhead" splits it around the backward (docs/HOW.md)."""

    WARMUP_CALLS = 3

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
        self.calls, self.graph, self.out = 0, None, None

    def __call__(self):
        self.calls += 1
        if self.calls <= self.WARMUP_CALLS:  # each one a real step
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.out = self.fn(*self.args)
            torch.cuda.current_stream().wait_stream(side)
            return self.out
        if self.graph is None:  # recording runs nothing: the replay below takes the step
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn(*self.args)
        self.graph.replay()
        return self.out  # the graph's output: each replay overwrites it


def compile_train_step(buffer, net, tgt_net, optimizer, batch_size, gamma):
    """train_step compiled, as a function of no arguments; on the GPU replayed as one CUDA graph."""
    compiled = torch.compile(train_step)
    if buffer.device.type == "cuda":
        return CUDAGraphStep(compiled, buffer, net, tgt_net, optimizer, batch_size, gamma)
    return functools.partial(compiled, buffer, net, tgt_net, optimizer, batch_size, gamma)


def compile_or_exit(parser, fn, mode, probe_args):
    """torch.compile(fn, mode=mode), compiled by a first call on probe_args: where it cannot compile
    (no C++ compiler, a Python this torch cannot compile for)
    the run stops now, with one line naming dqn_fast.py."""
    # The compiler's notices of its own choices stay unprinted.
    torch._logging.set_logs(dynamo=logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        # This raises at once on a Python that torch cannot compile.
        compiled = torch.compile(fn, mode=mode)
        compiled(*probe_args)
    except Exception as e:  # whatever the compiler raised: its first line says why
        parser.error(
            f"torch.compile fails here ({str(e).strip().splitlines()[0]}); "
            "dqn_fast.py runs without it"
        )
    return compiled


def set_capturable(optimizer, device):
    """Adam's settings for CUDA graphs on a GPU, for plain steps on the CPU. Dynamo sets them only
    on an empty state: the step counts that --resume restores are on the CPU (the checkpoint's map
    location), and its settings are the fresh optimizer's."""
    for group in optimizer.param_groups:
        group["capturable"] = device.type == "cuda"
    for state in optimizer.state.values():
        state["step"] = state["step"].to(device if device.type == "cuda" else "cpu")


if __name__ == "__main__":
    parser = runs.argument_parser(__doc__)
    parser.add_argument(
        "--envs", type=runs.positive_int, help=f"envs stepped as one (default: {PONG['envs']})"
    )
    args, params, checkpoint = runs.setup(parser, HYPERPARAMS)
    runs.set_torch_threads(args)
    device = torch.device("cuda" if args.cuda else "cpu")
    if args.cuda:
        # fp32 matmuls run on TF32 tensor cores, as convolutions already do.
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    env = common.make_fast_env(args.env, params.envs)
    net = DQN(env.single_observation_space.shape, env.single_action_space.n, args.bf16).to(device)
    tgt_net = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    # On the GPU, acting's kernels replay as one CUDA graph.
    mode = "reduce-overhead" if args.cuda else None
    epsilon = torch.tensor(epsilon_by_frame(params, 0), device=device)
    # Epsilon is changed in place: the compiled acting reads it where it is.
    torch._dynamo.mark_static_address(epsilon)
    states = torch.as_tensor(env.observation_space.sample(), device=device)  # a batch of N states
    # Acting is compiled by a first call.
    act = compile_or_exit(parser, select_actions, mode, [net, states, epsilon])
    buffer = DeviceReplayBuffer(params.replay_size, env.single_observation_space, device)
    # A step of N envs brings N frames: 32 * N samples keep 32 samples per frame.
    step = compile_train_step(
        buffer, net, tgt_net, optimizer, params.batch_size * params.envs, params.gamma
    )
    # On the GPU, ale-py's envs play the next step in their threads as the GPU trains on this one.
    overlap = args.cuda and hasattr(env, "send")
    source = OverlappedExperienceSource if overlap else common.ExperienceSourceFirstLast
    exp_source = source(
        env,
        lambda states: act(net, torch.as_tensor(states, device=device), epsilon).cpu().numpy(),
        params.gamma,
        seed=args.seed,
    )
    tracker = runs.RewardTracker(args, net, env)
    health = common.NetworkHealth(net, buffer)  # are the ReLUs still firing
    # Over the whole run: the target net syncs every target_sync training steps.
    counts = runs.Counters(train_steps=0)
    checkpoint_contents = dict(  # what a checkpoint holds, and --resume restores
        net=net,
        tgt_net=tgt_net,
        optimizer=optimizer,
        buffer=buffer,
        exp_source=exp_source,  # its count of the frames played
        tracker=tracker,
        counts=counts,
    )

    if checkpoint:  # go on where the stopped run was
        runs.restore(args, checkpoint, checkpoint_contents)
        # The first step acts at the resumed run's epsilon.
        epsilon.fill_(epsilon_by_frame(params, exp_source.frames))
    set_capturable(optimizer, device)  # after a restore, before the first compiled step

    with runs.Run(args, params, tracker, checkpoint_contents) as run:
        for exps in exp_source:
            buffer.extend(exps)
            epsilon.fill_(epsilon_by_frame(params, exp_source.frames))
            tracker.update(exp_source.frames, exp_source.pop_episodes())
            run.save_checkpoint_if_due()
            if run.should_stop():
                break
            if len(buffer) < params.replay_start:
                continue
            loss = step()
            counts.train_steps += 1
            tracker.record_step(loss=loss, epsilon=epsilon)
            run.share_busy_cores()  # one torch thread while another process shares the cores
            if counts.train_steps % params.target_sync == 0:
                tgt_net.load_state_dict(net.state_dict())
                tracker.record_health(health.measure())  # a forward pass of 256 states
    sys.exit(run.exit_code)
