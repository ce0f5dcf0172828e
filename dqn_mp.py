#!/usr/bin/env python3
"""DQN on Pong, faster still: a child process plays, the main process trains, joined by a pipe.
What crosses between them, and what waits for what: docs/HOW.md."""

import copy
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import processes
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


class DQNAgent:
    """Epsilon-greedy actions for a batch of states by the net's Q-values; the loop sets epsilon."""

    def __init__(self, net, epsilon, device):
        self.net, self.epsilon, self.device = net, epsilon, device

    @torch.no_grad()  # acting needs no graph
    def __call__(self, states):
        q_vals = self.net(torch.as_tensor(states, device=self.device))
        actions = q_vals.argmax(dim=1).cpu().numpy()
        explore = np.random.random(len(actions)) < self.epsilon
        actions[explore] = np.random.randint(q_vals.shape[1], size=explore.sum())
        return actions


def calc_loss_dqn(batch, net, tgt_net, gamma, device):
    """MSE between Q(s, a) and the one-step target r + gamma * max Q_target(s')."""
    states, actions, rewards, dones, last_states = common.unpack_batch_dqn(batch, device)
    q_vals = net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # no graph for the target: it is a constant
        next_q = tgt_net(last_states).max(dim=1)[0]
    next_q = next_q.masked_fill(dones, 0.0)  # 0 after a terminal state (masked_fill: no GPU sync)
    return F.mse_loss(q_vals, rewards + gamma * next_q)


def play_func(params, args, weights, frames, *, send):
    """Child process: from frame count frames on, play with the main process's net, and send the
    main process every step's experience."""
    torch.set_num_threads(1)  # the cores belong to the main process and the envs
    np.random.seed(args.seed)  # epsilon-greedy draws from numpy's generator
    device = torch.device("cuda" if args.cuda else "cpu")
    net = weights.copy_to(device) if args.cuda else weights
    env = common.make_fast_env(args.env, params.envs)
    agent = DQNAgent(net, epsilon_by_frame(params, frames), device)
    exp_source = common.ExperienceSourceFirstLast(env, agent, params.gamma, seed=args.seed)
    exp_source.frames = frames
    for exps in exp_source:
        agent.epsilon = epsilon_by_frame(params, exp_source.frames)
        # returns once the main process has taken it: play runs at most one step ahead of training
        send((exps, exp_source.frames, exp_source.pop_episodes()))
        if args.cuda:
            weights.refresh(net)  # every step that follows a publish: play lags one training step


if __name__ == "__main__":
    parser = runs.argument_parser(__doc__)
    parser.add_argument(
        "--envs", type=runs.positive_int, help=f"envs stepped as one (default: {PONG['envs']})"
    )
    args, params, checkpoint = runs.setup(parser, HYPERPARAMS)
    runs.set_torch_threads(args)
    device = torch.device("cuda" if args.cuda else "cpu")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    env = common.make_fast_env(args.env, 1)  # here only for its spaces: the child plays its own
    net = DQN(env.single_observation_space.shape, env.single_action_space.n, args.bf16).to(device)
    tgt_net = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    buffer = common.ReplayBuffer(params.replay_size, env.single_observation_space, seed=args.seed)
    tracker = runs.RewardTracker(args, net, env)
    health = common.NetworkHealth(net, buffer)  # are the ReLUs still firing
    # Over the whole run: the play process's frames, which each message brings (a resumed run's play
    # process goes on from them), and the training steps: the target net syncs every target_sync.
    counts = runs.Counters(frames=0, train_steps=0)
    checkpoint_contents = dict(  # what a checkpoint holds, and --resume restores
        net=net,
        tgt_net=tgt_net,
        optimizer=optimizer,
        buffer=buffer,
        tracker=tracker,
        counts=counts,
    )

    if checkpoint:  # go on where the stopped run was
        runs.restore(args, checkpoint, checkpoint_contents)
    # the play process acts with this net itself on the CPU, as the optimizer steps change it; on a
    # GPU with copies that the main process publishes: no CUDA tensor crosses a process boundary
    weights = processes.SharedWeights(net) if args.cuda else net
    processes.share_memory(parser, weights, page_locked=args.cuda)  # before any child starts
    # The play process starts from a resumed run's frames, and so at its epsilon.
    children = {"play process": (params, args, weights, counts.frames)}

    with (
        runs.Run(args, params, tracker, checkpoint_contents) as run,
        processes.ChildProcesses(play_func, children) as messages,
    ):
        for exps, frames, episodes in messages:
            counts.frames = frames
            for exp in exps:
                buffer.append(exp)
            tracker.update(counts.frames, episodes)
            run.save_checkpoint_if_due()
            if run.should_stop():
                break
            if len(buffer) < params.replay_start:
                continue
            optimizer.zero_grad()
            # A step of N envs brings N frames: 32 * N samples keep 32 samples per frame.
            batch = buffer.sample(params.batch_size * params.envs)
            loss = calc_loss_dqn(batch, net, tgt_net, params.gamma, device)
            loss.backward()
            optimizer.step()
            counts.train_steps += 1
            # This epsilon is only logged; the play process sets its own.
            tracker.record_step(loss=loss, epsilon=epsilon_by_frame(params, counts.frames))
            run.share_busy_cores()  # one torch thread while another process shares the cores
            if counts.train_steps % params.target_sync == 0:
                tgt_net.load_state_dict(net.state_dict())
                tracker.record_health(health.measure())  # a forward pass of 256 states
            if args.cuda:
                weights.publish(net)
    sys.exit(run.exit_code)
