#!/usr/bin/env python3
"""A3C on Pong, gradient parallel, in synchronous steps (A2C's update with A3C's workers): each
worker computes a gradient on its own samples, the main process averages one from each worker
into one optimizer step, and every worker waits for that step before its next gradient.

What crosses the process boundary: the gradients, as numpy arrays through a pipe per worker, which
the main process averages on the run's device; the number of optimizer steps made, in shared
memory; and the weights in shared CPU memory, with which the workers act and compute their loss.
On the CPU the workers use the main process's network itself; with --cuda the main process
publishes the weights there after every optimizer step, and each worker copies them into a network
of its own on the GPU. Either way a worker takes its gradient at the weights of the step it waited
for. No GPU tensor crosses the boundary."""
import multiprocessing
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import common

# ---------------------------------------------------------------- hyperparameters
PONG = dict(
    gamma=0.99,
    # 3e-3, as in a3c_data, not the book's 1e-3; it needs the synchronous steps of grads_func:
    # with gradients that land on newer weights than they were taken at, the value never learns at
    # 3e-3 (docs/RESULTS.md)
    learning_rate=3e-3,
    adam_eps=1e-3,
    entropy_beta=0.01,
    reward_steps=4,           # n of the n-step reference values
    clip_grad=0.1,            # max L2 norm of the gradient
    processes=4,              # worker processes, one gradient from each per optimizer step
    envs=8,                   # envs per worker
    grad_batch=32,            # samples per worker gradient: 4 x 32 = 128 per step, as in a3c_data
)
CARTPOLE = dict(PONG, learning_rate=1e-3)
HYPERPARAMS = {"pong": PONG, "cartpole": CARTPOLE}


# ---------------------------------------------------------------- network, agent, loss
class A2C(nn.Module):
    """Policy logits and state value from one shared body: the Nature DQN convolutions for frames,
    a small MLP for vectors."""

    def __init__(self, obs_shape, n_actions):
        super().__init__()
        if len(obs_shape) == 3:
            self.body = nn.Sequential(
                nn.Conv2d(obs_shape[0], 32, kernel_size=8, stride=4), nn.ReLU(),
                nn.Conv2d(32, 64, kernel_size=4, stride=2), nn.ReLU(),
                nn.Conv2d(64, 64, kernel_size=3, stride=1), nn.ReLU(),
                nn.Flatten())
            hidden = 512
        else:
            self.body = nn.Sequential(nn.Linear(obs_shape[0], 128), nn.ReLU())
            hidden = 128
        features = self.body(torch.zeros(1, *obs_shape)).shape[1]
        self.policy = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, n_actions))
        self.value = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        """Policy logits [batch, n_actions] and state values [batch]."""
        x = x.float() / 255 if x.dtype == torch.uint8 else x   # frames stay uint8 until here
        features = self.body(x)
        return self.policy(features), self.value(features).squeeze(-1)


@torch.no_grad()
def select_actions(net, states, device):
    """Actions sampled from the policy for a batch of states."""
    logits, _ = net(torch.as_tensor(states, device=device))
    return torch.distributions.Categorical(logits=logits).sample().cpu().numpy()


def calc_loss_a2c(net, states, actions, ref_vals, entropy_beta):
    """A2C loss: value MSE, policy gradient with advantage, entropy bonus; returns it and its parts."""
    logits, values = net(states)
    loss_value = F.mse_loss(values, ref_vals)
    log_probs = F.log_softmax(logits, dim=1)
    adv = ref_vals - values.detach()
    loss_policy = -(adv * log_probs[torch.arange(len(actions)), actions]).mean()
    loss_entropy = entropy_beta * (log_probs.exp() * log_probs).sum(dim=1).mean()
    loss_total = loss_policy + loss_value + loss_entropy
    stats = {"advantage": adv.mean(), "values": values.mean(), "loss_entropy": loss_entropy,
             "loss_policy": loss_policy, "loss_value": loss_value, "loss_total": loss_total}
    return loss_total, stats


def grads_func(params, args, weights, steps, worker_id, send):
    """Worker process: play its envs with its copy of the published net; for each batch, wait for
    the optimizer step that took its last gradient, then send the gradient at the new weights."""
    torch.set_num_threads(1)   # one core per worker
    torch.manual_seed(args.seed + worker_id)
    device = torch.device("cuda" if args.cuda else "cpu")
    net = weights.copy_to(device)
    env = common.make_fast_env(args.env, args.envs, threads=1)
    exp_source = common.ExperienceSourceFirstLast(
        env, lambda states: select_actions(net, states, device), params.gamma, params.reward_steps,
        seed=args.seed + worker_id * args.envs)
    batch, frames_sent, step = [], 0, -1
    for exps in exp_source:
        batch.extend(exps)
        if len(batch) < params.grad_batch:
            continue
        states, actions, ref_vals = common.unpack_batch_a2c(batch, net, device, params.gamma)
        batch.clear()
        # synchronous steps: every gradient a step averages is taken at the weights the step updates
        step = wait_for_step(steps, step)
        weights.refresh(net)  # to that step's weights (GPU)
        net.zero_grad()  # grads are this process's own, also where the net's weights are shared (CPU)
        loss_total, stats = calc_loss_a2c(net, states, actions, ref_vals, params.entropy_beta)
        loss_total.backward()
        grads = [p.grad.cpu().numpy() for p in net.parameters()]
        stats = {k: v.item() for k, v in stats.items()}
        new_frames, frames_sent = exp_source.frames - frames_sent, exp_source.frames
        send((grads, stats, new_frames, exp_source.pop_episodes()))


def wait_for_step(steps, last):
    """Wait until the main process has made an optimizer step after step number last; return the
    newest step's number. A worker whose main process is gone has nobody to wait for: it ends."""
    while int(steps) == last:
        if not multiprocessing.parent_process().is_alive():
            raise BrokenPipeError("the main process is gone")
        time.sleep(0.001)
    return int(steps)


def mean_grads(net, grads_list, device):
    """Set each parameter's grad to the mean of the workers' gradients, taken on device, replacing
    what was there: for batches of one size, the gradient of the mean loss over all their samples."""
    for param, grads in zip(net.parameters(), zip(*grads_list)):
        param.grad = sum(torch.as_tensor(grad, device=device) for grad in grads) / len(grads)


if __name__ == "__main__":
    parser = common.argument_parser(__doc__)
    parser.add_argument("--processes", type=common.positive_int, help="workers (default: 4)")
    parser.add_argument("--envs", type=common.positive_int, help="envs per worker (default: 8)")
    args, params, device = common.setup(parser, HYPERPARAMS)
    args.processes, args.envs = args.processes or params.processes, args.envs or params.envs
    torch.set_num_threads(1)  # here only gradients are averaged and applied: the cores are the workers'
    env = common.make_fast_env(args.env, 1)  # here only for its spaces: the workers play their own
    net = A2C(env.single_observation_space.shape, env.single_action_space.n).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    weights = common.SharedWeights(net)
    steps = torch.zeros((), dtype=torch.int64).share_memory_()   # optimizer steps made
    workers = {f"worker {i}": (params, args, weights, steps, i) for i in range(args.processes)}
    grads_list, frames = [], 0

    with common.RewardTracker(args, net, env) as tracker, common.ChildProcesses(grads_func, workers) as train_queue:
        for grads, stats, new_frames, episodes in train_queue:
            frames += new_frames
            if tracker.update(frames, episodes):
                break
            # the main process only applies gradients: it averages one from each worker into one step
            grads_list.append(grads)
            if len(grads_list) < args.processes:
                continue
            mean_grads(net, grads_list, device)
            grads_list.clear()
            stats["grad_max"] = torch.stack([p.grad.abs().max() for p in net.parameters()]).max().item()
            stats["grad_l2"] = torch.nn.utils.clip_grad_norm_(net.parameters(), params.clip_grad).item()
            optimizer.step()
            weights.publish(net)
            steps += 1  # after the weights: a worker that sees the new step number finds them
            tracker.train(loss=stats["loss_total"], **stats)
    sys.exit(tracker.exit_code)
