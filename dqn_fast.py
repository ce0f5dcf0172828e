#!/usr/bin/env python3
"""DQN on Pong, faster: no gradient where none is needed, and several envs stepped as one batch
by ale-py's C++ vector env."""
import copy
import sys

import numpy as np
import torch
import torch.nn.functional as F

import common


@torch.no_grad()  # acting needs no graph
def select_actions(net, states, epsilon, device):
    """Epsilon-greedy actions for a batch of states."""
    q_vals = net(torch.as_tensor(states, device=device))
    actions = q_vals.argmax(dim=1).cpu().numpy()
    explore = np.random.random(len(actions)) < epsilon
    actions[explore] = np.random.randint(q_vals.shape[1], size=explore.sum())
    return actions


def calc_loss_dqn(batch, net, tgt_net, gamma, device):
    """MSE between Q(s, a) and the one-step target r + gamma * max Q_target(s')."""
    states, actions, rewards, dones, last_states = common.unpack_batch_dqn(batch, device)
    q_vals = net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # no graph for the target: it is a constant
        next_q = tgt_net(last_states).max(dim=1)[0]
    next_q[dones] = 0.0
    return F.mse_loss(q_vals, rewards + gamma * next_q)


if __name__ == "__main__":
    parser = common.argument_parser(__doc__)
    parser.add_argument("--envs", type=common.positive_int, default=3, help="envs stepped as one (default: 3)")
    args, params, device = common.setup(parser)
    env = common.make_fast_env(params, args.envs)
    net = common.DQN(env.single_observation_space.shape, env.single_action_space.n).to(device)
    tgt_net = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate)
    buffer = common.ReplayBuffer(params.replay_size, env.single_observation_space, seed=args.seed)
    epsilon = params.epsilon(0)
    exp_source = common.ExperienceSourceFirstLast(
        env, lambda states: select_actions(net, states, epsilon, device), params.gamma, seed=args.seed)
    train_steps = 0

    with common.RewardTracker(args, params, net) as tracker:
        for exps in exp_source:
            for exp in exps:
                buffer.append(exp)
            epsilon = params.epsilon(exp_source.frames)
            if tracker.update(exp_source.frames, exp_source.pop_episodes()):
                break
            if len(buffer) < params.replay_start:
                continue
            optimizer.zero_grad()
            # one step of N envs brings N frames: train on 32 * N samples, so samples per frame stay 32
            batch = buffer.sample(params.batch_size * args.envs)
            loss = calc_loss_dqn(batch, net, tgt_net, params.gamma, device)
            loss.backward()
            optimizer.step()
            train_steps += 1
            if train_steps % params.target_sync == 0:
                tgt_net.load_state_dict(net.state_dict())
            tracker.train(loss=loss.item(), epsilon=epsilon)
    sys.exit(tracker.exit_code)
