#!/usr/bin/env python3
"""A3C on Pong, gradient parallel across machines, in synchronous steps (A2C's update with A3C's
workers): torchrun starts the ranks, torch.distributed (gloo) joins them; rank 0 averages one
gradient from every other rank into one optimizer step, which every rank waits for.

What crosses the process boundary, over gloo and only as CPU tensors: from each worker rank, one
flat message (its gradient, loss stats, frames played and finished episodes); back from rank 0,
the weights after the optimizer step that took its gradient, which the worker copies into its
network on its device, and whether to stop.
Start it with `torchrun --standalone --nproc-per-node 5 a3c_dist.py` (4 workers), or on several
machines with `torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:29400`."""
import os
import sys
import threading

import torch
import torch.distributed as dist
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
    envs=8,                   # envs per worker
    grad_batch=32,            # samples per worker gradient: 4 x 32 = 128 per step, as in a3c_data
)
CARTPOLE = dict(PONG, learning_rate=1e-3)
HYPERPARAMS = {"pong": PONG, "cartpole": CARTPOLE}
MAX_EPISODES = 32             # finished episodes one message carries; more wait for the next
STATS = ["advantage", "values", "loss_entropy", "loss_policy", "loss_value", "loss_total"]


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


def grads_func(params, args, net, worker_id, device):
    """Worker rank: play its envs with its copy of rank 0's net; for each batch, take the weights of
    the optimizer step that took its last gradient from rank 0, then send it the gradient at them,
    until rank 0 says stop."""
    torch.manual_seed(args.seed + worker_id)
    env = common.make_fast_env(args.env, args.envs, threads=1)
    exp_source = common.ExperienceSourceFirstLast(
        env, lambda states: select_actions(net, states, device), params.gamma, params.reward_steps,
        seed=args.seed + worker_id * args.envs)
    answer = torch.empty(sum(p.numel() for p in net.parameters()) + 1)
    batch, frames_sent, episodes = [], 0, []
    for exps in exp_source:
        batch.extend(exps)
        if len(batch) < params.grad_batch:
            continue
        states, actions, ref_vals = common.unpack_batch_a2c(batch, net, device, params.gamma)
        batch.clear()
        # synchronous steps: every gradient a step averages is taken at the weights the step updates
        unblocked(dist.recv, answer, 0)
        if answer[-1]:  # rank 0 says stop
            return
        torch.nn.utils.vector_to_parameters(answer[:-1].to(device, copy=True), net.parameters())
        net.zero_grad()
        loss_total, stats = calc_loss_a2c(net, states, actions, ref_vals, params.entropy_beta)
        loss_total.backward()
        grads = [p.grad.cpu() for p in net.parameters()]
        stats = {k: v.item() for k, v in stats.items()}
        new_frames, frames_sent = exp_source.frames - frames_sent, exp_source.frames
        episodes += exp_source.pop_episodes()
        unblocked(dist.send, pack_message(grads, stats, new_frames, episodes[:MAX_EPISODES]), 0)
        del episodes[:MAX_EPISODES]


def mean_grads(net, grads_list, device):
    """Set each parameter's grad to the mean of the workers' gradients, taken on device, replacing
    what was there: for batches of one size, the gradient of the mean loss over all their samples."""
    for param, grads in zip(net.parameters(), zip(*grads_list)):
        param.grad = sum(torch.as_tensor(grad, device=device) for grad in grads) / len(grads)


def pack_message(grads, stats, new_frames, episodes):
    """One flat tensor: the gradient, the loss stats, frames played, the number of finished
    episodes, then their rewards and their steps, each padded to MAX_EPISODES."""
    padding = [0] * (MAX_EPISODES - len(episodes))
    tail = [stats[name] for name in STATS] + [new_frames, len(episodes)]
    tail += [reward for reward, _ in episodes] + padding + [steps for _, steps in episodes] + padding
    return torch.cat([grad.flatten() for grad in grads] + [torch.tensor(tail, dtype=torch.float32)])


def message_size(net):
    """Length of a pack_message tensor for net."""
    return sum(p.numel() for p in net.parameters()) + len(STATS) + 2 + 2 * MAX_EPISODES


def unpack_message(msg, net):
    """(grads shaped like net's parameters, stats, frames played, episodes) from pack_message."""
    sizes = [p.numel() for p in net.parameters()]
    grads = [grad.view_as(p) for grad, p in zip(msg[:sum(sizes)].clone().split(sizes), net.parameters())]
    tail = msg[sum(sizes):].tolist()
    stats, new_frames, count = dict(zip(STATS, tail)), int(tail[len(STATS)]), int(tail[len(STATS) + 1])
    rewards, steps = tail[len(STATS) + 2:][:MAX_EPISODES], tail[len(STATS) + 2:][MAX_EPISODES:]
    return grads, stats, new_frames, [(reward, int(n)) for reward, n in zip(rewards[:count], steps)]


def unblocked(func, *args):
    """Call a blocking gloo function in a helper thread and wait for it here: a call blocked in gloo
    would hold back Ctrl-C and SIGTERM until it returned."""
    outcome = {}

    def call():
        try:
            outcome["result"] = func(*args)
        except RuntimeError as error:   # gloo lost the peer: raised again in this thread
            outcome["error"] = ConnectionError(error)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class WorkerGradients:
    """Rank 0's end: rounds of one message from each worker, in rank order; before each round, every
    worker gets the newest weights, those of the step that the last round's gradients went into."""

    def __init__(self, net, world_size):
        self.net, self.world_size = net, world_size
        self.msg = torch.empty(message_size(net))

    def __iter__(self):
        while True:
            self.answer(stop=False)
            for self.sender in range(1, self.world_size):
                self.call(dist.recv, self.msg, self.sender)
                yield unpack_message(self.msg, self.net)

    def answer(self, stop):
        """Send the newest weights, and whether to stop, to every worker."""
        weights = torch.nn.utils.parameters_to_vector(self.net.parameters()).cpu()
        answer = torch.cat([weights, torch.tensor([float(stop)])])
        for worker in range(1, self.world_size):
            self.call(dist.send, answer, worker)

    def stop(self):
        """Take the rest of the round's messages, then tell every worker to stop."""
        for self.sender in range(self.sender + 1, self.world_size):
            self.call(dist.recv, self.msg, self.sender)
        self.answer(stop=True)

    @staticmethod
    def call(func, tensor, worker):
        """Send a tensor to, or receive one from, a worker; one that is gone ends the run."""
        try:
            unblocked(func, tensor, worker)
        except ConnectionError as error:  # torchrun names the rank that died
            raise ChildProcessError(f"lost a worker: {error}") from None


if __name__ == "__main__":
    parser = common.argument_parser(__doc__)
    parser.add_argument("--envs", type=common.positive_int, help="envs per worker (default: 8)")
    args, params, device = common.setup(parser, HYPERPARAMS)
    args.envs = args.envs or params.envs
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --standalone --nproc-per-node 5 a3c_dist.py")
    if args.cuda:  # the GPU that LOCAL_RANK picks on this machine (RANK numbers ranks across machines)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo")  # carries CPU tensors, between GPU machines too
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:
        parser.error("rank 0 needs workers: --nproc-per-node 2 or more")
    env = common.make_fast_env(args.env, 1)  # here only for its spaces: the workers play their own
    net = A2C(env.single_observation_space.shape, env.single_action_space.n).to(device)
    weights = torch.nn.utils.parameters_to_vector(net.parameters()).cpu()
    dist.broadcast(weights, src=0)  # every worker starts from rank 0's weights
    if rank > 0:
        torch.nn.utils.vector_to_parameters(weights.to(device), net.parameters())
        try:
            grads_func(params, args, net, rank - 1, device)
        except KeyboardInterrupt:  # Ctrl-C, or torchrun ending the run: rank 0 prints the summary
            os._exit(130)  # now: a helper thread may still wait in gloo, where teardown would abort
        except ConnectionError as error:  # rank 0 is gone
            print(f"a3c_dist.py: error: rank {rank} lost rank 0: {error}", file=sys.stderr, flush=True)
            os._exit(1)
        dist.destroy_process_group()
        sys.exit(0)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    grads_list, frames = [], 0

    with common.RewardTracker(args, net, env) as tracker:
        train_queue = WorkerGradients(net, world_size)
        for grads, stats, new_frames, episodes in train_queue:
            frames += new_frames
            if tracker.update(frames, episodes):
                break
            # rank 0 only applies gradients: it averages one from each worker into one step
            grads_list.append(grads)
            if len(grads_list) < world_size - 1:
                continue
            mean_grads(net, grads_list, device)
            grads_list.clear()
            stats["grad_max"] = torch.stack([p.grad.abs().max() for p in net.parameters()]).max().item()
            stats["grad_l2"] = torch.nn.utils.clip_grad_norm_(net.parameters(), params.clip_grad).item()
            optimizer.step()
            tracker.train(loss=stats["loss_total"], **stats)
        train_queue.stop()
    if tracker.exit_code:  # stopped by a signal or a lost worker: a helper thread may still wait in gloo
        os._exit(tracker.exit_code)
    dist.destroy_process_group()
    sys.exit(0)
