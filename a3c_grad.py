#!/usr/bin/env python3
"""A3C on Pong, gradient parallel, in synchronous steps: each worker computes a gradient on its own
samples, the main process averages one from each worker into one optimizer step, and every worker
waits for that step before its next gradient. What crosses, and what waits for what: docs/HOW.md."""

import multiprocessing
import sys

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
    micro_batch=32,  # samples per worker gradient: 4 x 32 = 128 per step, as in a3c_data
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


def grads_func(params, args, weights, grad_slots, step_receiver, worker_id, *, send):
    """Worker process: play its envs with the main process's net (its published weights on a GPU);
    for each batch, wait for the optimizer step that took its last gradient, then put the gradient
    at the new weights in its slot and send what goes with it."""
    # The network runs on one thread; the envs step on the worker's share of the cores.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed + worker_id)
    device = torch.device("cuda" if args.cuda else "cpu")
    net = weights.copy_to(device) if args.cuda else weights
    # On a GPU, a call of the net replays a CUDA graph of its kernels (one per batch size): one
    # launch, not tens.
    graphed_net = torch.compile(net, backend="cudagraphs") if args.cuda else net
    if args.cuda:
        # Page-locked slots speed up each step's copy of the gradient off the GPU into its slot.
        processes.page_lock(grad_slots)
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
    micro_batch, frames_sent = [], 0
    for exps in exp_source:
        micro_batch.extend(exps)
        if len(micro_batch) < params.micro_batch:
            continue
        states, actions, ref_vals = common.unpack_batch_a2c(micro_batch, net, device, params.gamma)
        micro_batch.clear()
        # synchronous steps: every gradient a step averages is taken at the weights the step updates
        # (with gradients taken at older weights, the value never learns at 3e-3: docs/RESULTS.md)
        # This returns once the step is made; if the main process is gone, it raises EOFError, which
        # ends this process.
        step_receiver.recv()
        if args.cuda:
            weights.refresh(net)  # to that step's weights
        # The grads are this process's own, also where the net's weights are shared (on the CPU).
        net.zero_grad()
        loss_total, stats = calc_loss_a2c(
            graphed_net, states, actions, ref_vals, params.entropy_beta
        )
        loss_total.backward()
        # The gradient crosses in shared memory, with no pickling.
        grad_slots[worker_id].copy_(torch.cat([p.grad.flatten() for p in net.parameters()]))
        stats = dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # one GPU sync for all
        new_frames, frames_sent = exp_source.frames - frames_sent, exp_source.frames
        send((worker_id, len(actions), stats, new_frames, exp_source.pop_episodes()))


def mean_grads(net, grads, samples, device):
    """Set each parameter's grad, on device, to the gradient of the mean loss over all the samples,
    replacing what was there; grads: the workers' gradients, a flat row each, of its mean loss."""
    mean = torch.tensor(samples, dtype=grads.dtype, device=device) @ grads.to(device) / sum(samples)
    for param, grad in zip(net.parameters(), mean.split([p.numel() for p in net.parameters()])):
        param.grad = grad.view_as(param)


def mean_stats(stats_list, samples):
    """Each loss stat of all samples, from the processes' batches weighted by their samples."""
    return {
        name: sum(n * stats[name] for n, stats in zip(samples, stats_list)) / sum(samples)
        for name in stats_list[0]
    }


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
    # The main process only averages and applies gradients: the cores are the workers'.
    torch.set_num_threads(1)
    env = common.make_fast_env(args.env, 1)  # here only for its spaces: the workers play their own
    net = A2C(env.single_observation_space.shape, env.single_action_space.n, args.bf16).to(device)
    # The learning rate is scaled by the batch's square root.
    lr = params.learning_rate * (params.processes * params.micro_batch / 128) ** 0.5
    optimizer = torch.optim.Adam(net.parameters(), lr=lr, eps=params.adam_eps)
    tracker = runs.RewardTracker(args, net, env)
    counts = runs.Counters(frames=0)  # played in all, over the whole run
    # What a checkpoint holds, and --resume restores.
    checkpoint_contents = dict(net=net, optimizer=optimizer, tracker=tracker, counts=counts)

    if checkpoint:  # go on where the stopped run was
        runs.restore(args, checkpoint, checkpoint_contents)
    # the workers act with this net itself on the CPU, as the optimizer steps change it; on a GPU
    # with copies that the main process publishes: no CUDA tensor crosses a process boundary
    weights = processes.SharedWeights(net) if args.cuda else net
    # The gradient slots hold a row per worker.
    grad_slots = torch.zeros(params.processes, sum(p.numel() for p in net.parameters()))
    # The tensors move to shared memory before any child starts.
    processes.share_memory(parser, weights, grad_slots, page_locked=args.cuda)
    # a pipe per worker, to tell it that the step is made: it waits in recv, with no polling
    step_receivers, step_senders = zip(
        *(multiprocessing.Pipe(duplex=False) for _ in range(params.processes))
    )
    workers = {
        f"worker {i}": (params, args, weights, grad_slots, step_receivers[i], i)
        for i in range(params.processes)
    }
    filled_slots = {}  # worker id: (samples, loss stats) of the gradient in its slot

    with (
        runs.Run(args, params, tracker, checkpoint_contents) as run,
        processes.ChildProcesses(grads_func, workers) as messages,
    ):
        for step_sender in step_senders:
            # Step 0 is the initial weights: every worker takes its first gradient at them.
            step_sender.send(None)
        for worker_id, samples, stats, new_frames, episodes in messages:
            counts.frames += new_frames
            tracker.update(counts.frames, episodes)
            run.save_checkpoint_if_due()
            if run.should_stop():
                break
            # The main process only applies gradients: it averages one from each worker into a step.
            filled_slots[worker_id] = samples, stats
            if len(filled_slots) < params.processes:
                continue
            # The samples and stats are read in slot order.
            samples_list, stats_list = zip(*(filled_slots[i] for i in range(params.processes)))
            filled_slots.clear()
            mean_grads(net, grad_slots, samples_list, device)
            stats = mean_stats(stats_list, samples_list)
            stats["grad_max"] = torch.stack([p.grad.abs().max() for p in net.parameters()]).max()
            stats["grad_l2"] = torch.nn.utils.clip_grad_norm_(net.parameters(), params.clip_grad)
            optimizer.step()
            if args.cuda:
                weights.publish(net)
            for step_sender in step_senders:
                # The word comes after the weights: a worker that hears of the step finds them.
                step_sender.send(None)
            tracker.record_step(loss=stats["loss_total"], **stats)
    sys.exit(run.exit_code)
