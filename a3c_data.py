#!/usr/bin/env python3
"""A3C on Pong, data parallel: worker processes play and send training samples to the main process.
What crosses between them, and what waits for what: docs/HOW.md."""

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
    # 3e-3, not the book's 1e-3: with 1e-3 a3c_data was still at -20.15 after 2.2M frames;
    # with 3e-3 it solved Pong at 4.03M frames (docs/RESULTS.md)
    learning_rate=3e-3,
    adam_eps=1e-3,
    entropy_beta=0.01,
    reward_steps=4,  # n of the n-step reference values
    clip_grad=0.1,  # max L2 norm of the gradient
    processes=4,  # worker processes
    envs=8,  # envs per worker
    micro_batch=32,  # samples per worker message
    batch_size=128,  # samples per training step
)
CARTPOLE = dict(PONG, learning_rate=1e-3)
HYPERPARAMS = {"pong": PONG, "cartpole": CARTPOLE}


# ---------------------------------------------------------------- network, agent, loss
class A2C(nn.Module):
    """Policy logits and state value from one shared body: the Nature DQN convolutions for frames,
    a small MLP for vectors."""

    def __init__(self, obs_shape, n_actions, bf16=False):
        super().__init__()
        # In mixed precision, the hidden layers compute in bfloat16 and the output layers in fp32.
        self.bf16 = bf16
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
        self.policy_hidden = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.value_hidden = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.policy, self.value = nn.Linear(hidden, n_actions), nn.Linear(hidden, 1)

    def forward(self, x):
        """Policy logits [batch, n_actions] and state values [batch], in fp32."""
        x = x.float() / 255 if x.dtype == torch.uint8 else x  # frames stay uint8 until here
        # entered at every call, so autocast's cached bf16 weights never outlive an optimizer step
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            features = self.body(x)
            policy, value = self.policy_hidden(features), self.value_hidden(features)
        # in fp32: CPU autocast would leave log_softmax in bf16, and .numpy() refuses bf16
        return self.policy(policy.float()), self.value(value.float()).squeeze(-1)


@torch.no_grad()
def select_actions(net, states, device):
    """Actions sampled from the policy for a batch of states."""
    logits, _ = net(torch.as_tensor(states, device=device))
    return torch.distributions.Categorical(logits=logits).sample().cpu().numpy()


def calc_loss_a2c(net, states, actions, ref_vals, entropy_beta):
    """A2C loss: value MSE, advantage policy gradient, entropy bonus; returned with its parts."""
    logits, values = net(states)
    loss_value = F.mse_loss(values, ref_vals)
    log_probs = F.log_softmax(logits, dim=1)
    adv = ref_vals - values.detach()
    loss_policy = -(adv * log_probs.gather(1, actions.unsqueeze(-1)).squeeze(-1)).mean()
    loss_entropy = entropy_beta * (log_probs.exp() * log_probs).sum(dim=1).mean()
    loss_total = loss_policy + loss_value + loss_entropy
    stats = {
        "advantage": adv.mean(),
        "values": values.mean(),
        "loss_entropy": loss_entropy,
        "loss_policy": loss_policy,
        "loss_value": loss_value,
        "loss_total": loss_total,
    }
    return loss_total, stats


def data_func(params, args, weights, sample_slots, worker_id, *, send):
    """Worker process: play its envs with the main process's net (its published weights on a GPU),
    send n-step samples, their reference values bootstrapped with that net, in micro-batches: the
    states in its two slots in turn, the rest in the message."""
    # The network runs on one thread; the envs step on the worker's share of the cores.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed + worker_id)
    device = torch.device("cuda" if args.cuda else "cpu")
    net = weights.copy_to(device) if args.cuda else weights
    # On a GPU, a call of the net replays a CUDA graph of its kernels (one per batch size): one
    # launch, not tens.
    graphed_net = torch.compile(net, backend="cudagraphs") if args.cuda else net
    env = common.make_fast_env(
        args.env, params.envs, threads=common.cores_per_process(params.processes)
    )
    exp_source = common.ExperienceSourceFirstLast(
        env,
        lambda states: select_actions(graphed_net, states, device),
        params.gamma,
        params.reward_steps,
        seed=args.seed + worker_id * params.envs,
    )
    micro_batch, frames_sent, slot = [], 0, 0
    for exps in exp_source:
        micro_batch.extend(exps)
        if len(micro_batch) < params.micro_batch:
            continue
        states, actions, ref_vals = common.unpack_batch_a2c(micro_batch, net, "cpu", params.gamma)
        micro_batch.clear()
        sample_slots[worker_id, slot, : len(states)] = states
        new_frames, frames_sent = exp_source.frames - frames_sent, exp_source.frames
        send(
            (
                worker_id,
                slot,
                actions.numpy(),
                ref_vals.numpy(),
                new_frames,
                exp_source.pop_episodes(),
            )
        )
        slot = 1 - slot  # this one is filled again only after the next message is taken
        if args.cuda:
            weights.refresh(net)  # once a micro-batch, played and valued with one set of weights


def make_sample_slots(params, obs_space):
    """Two slots a worker for its micro-batches' states: it fills one while the main process copies
    from the other. A slot holds the most a message can: a micro-batch less one sample, then a step
    of its envs, each giving up to reward_steps samples (all its last ones, at a game's end)."""
    size = params.micro_batch - 1 + params.envs * params.reward_steps
    return torch.from_numpy(
        np.zeros((params.processes, 2, size, *obs_space.shape), obs_space.dtype)
    )


if __name__ == "__main__":
    parser = runs.argument_parser(__doc__)
    parser.add_argument(
        "--processes", type=runs.positive_int, help=f"workers (default: {PONG['processes']})"
    )
    parser.add_argument(
        "--envs", type=runs.positive_int, help=f"envs per worker (default: {PONG['envs']})"
    )
    args, params, checkpoint = runs.setup(parser, HYPERPARAMS)
    device = torch.device("cuda" if args.cuda else "cpu")
    torch.manual_seed(args.seed)
    env = common.make_fast_env(args.env, 1)  # here only for its spaces: the workers play their own
    net = A2C(env.single_observation_space.shape, env.single_action_space.n, args.bf16).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=params.learning_rate, eps=params.adam_eps)
    graphed_net = torch.compile(net, backend="cudagraphs") if args.cuda else net  # as the workers'
    tracker = runs.RewardTracker(args, net, env)
    counts = runs.Counters(frames=0)  # played in all, over the whole run
    # What a checkpoint holds, and --resume restores.
    checkpoint_contents = dict(net=net, optimizer=optimizer, tracker=tracker, counts=counts)

    if checkpoint:  # go on where the stopped run was
        runs.restore(args, checkpoint, checkpoint_contents)
    # the workers act with this net itself on the CPU, as the optimizer steps change it; on a GPU
    # with copies that the main process publishes: no CUDA tensor crosses a process boundary
    weights = processes.SharedWeights(net) if args.cuda else net
    # The states cross to the main process in these shared slots, with no pickling.
    sample_slots = make_sample_slots(params, env.single_observation_space)
    # The tensors move to shared memory before any child starts.
    processes.share_memory(parser, weights, sample_slots, page_locked=args.cuda)
    workers = {
        f"worker {i}": (params, args, weights, sample_slots, i) for i in range(params.processes)
    }
    batch = []

    with (
        runs.Run(args, params, tracker, checkpoint_contents) as run,
        processes.ChildProcesses(data_func, workers) as messages,
    ):
        for worker_id, slot, actions, ref_vals, new_frames, episodes in messages:
            counts.frames += new_frames
            tracker.update(counts.frames, episodes)
            run.save_checkpoint_if_due()
            if run.should_stop():
                break
            # the main process only trains: it stacks micro-batches from all workers into one batch
            # The states are copied out of the slot before the worker fills it again.
            states = sample_slots[worker_id, slot, : len(actions)].to(device, copy=True)
            batch.append((states, torch.as_tensor(actions), torch.as_tensor(ref_vals)))
            if sum(len(b[0]) for b in batch) < params.batch_size:
                continue
            states, actions, ref_vals = (torch.cat(parts).to(device) for parts in zip(*batch))
            batch.clear()
            optimizer.zero_grad()
            loss_total, stats = calc_loss_a2c(
                graphed_net, states, actions, ref_vals, params.entropy_beta
            )
            loss_total.backward()
            stats["grad_max"] = torch.stack([p.grad.abs().max() for p in net.parameters()]).max()
            stats["grad_l2"] = torch.nn.utils.clip_grad_norm_(net.parameters(), params.clip_grad)
            optimizer.step()
            if args.cuda:
                weights.publish(net)
            tracker.record_step(loss=stats["loss_total"], **stats)
    sys.exit(run.exit_code)
