#!/usr/bin/env python3
"""A3C on Pong, gradient parallel across machines, in synchronous steps: torchrun starts the ranks,
every rank plays and computes a gradient, one all_reduce sums them, and every rank takes the same
optimizer step. How to start it on one machine or several, and what crosses: docs/HOW.md."""

import datetime
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common
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
    envs=8,  # envs per rank
    micro_batch=32,  # samples per rank gradient: 4 x 32 = 128 per step, as in a3c_data
)
CARTPOLE = dict(PONG, learning_rate=1e-3)
HYPERPARAMS = {"pong": PONG, "cartpole": CARTPOLE}
TIMEOUT = datetime.timedelta(seconds=60)  # a collective that waits longer for a rank ends the run


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


def gradients(params, args, env, net, rank, device):
    """Play this rank's envs; for each batch, leave the gradient of its mean loss in net's grads and
    yield (samples, loss stats, frames played, finished episodes)."""
    torch.manual_seed(args.seed + rank)  # rank r plays as a3c_grad's worker r
    # On a GPU, a call of the net replays a CUDA graph of its kernels (one per batch size): one
    # launch, not tens.
    graphed_net = torch.compile(net, backend="cudagraphs") if args.cuda else net
    exp_source = common.ExperienceSourceFirstLast(
        env,
        lambda states: select_actions(graphed_net, states, device),
        params.gamma,
        params.reward_steps,
        seed=args.seed + rank * params.envs,
    )
    micro_batch, frames_sent = [], 0
    for exps in exp_source:
        micro_batch.extend(exps)
        if len(micro_batch) < params.micro_batch:
            continue
        states, actions, ref_vals = common.unpack_batch_a2c(micro_batch, net, device, params.gamma)
        micro_batch.clear()
        net.zero_grad()
        loss_total, stats = calc_loss_a2c(
            graphed_net, states, actions, ref_vals, params.entropy_beta
        )
        loss_total.backward()
        stats = dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # one GPU sync for all
        new_frames, frames_sent = exp_source.frames - frames_sent, exp_source.frames
        yield len(actions), stats, new_frames, exp_source.pop_episodes()


def mean_grads(net, grads, samples, device):
    """Set each parameter's grad, on device, to the gradient of the mean loss over all the samples,
    replacing what was there; grads: the ranks' gradients, each times its samples, summed (flat)."""
    mean = grads.to(device) / sum(samples)
    for param, grad in zip(net.parameters(), mean.split([p.numel() for p in net.parameters()])):
        param.grad = grad.view_as(param)


def mean_stats(stats_list, samples):
    """Each loss stat of all samples, from the processes' batches weighted by their samples."""
    return {
        name: sum(n * stats[name] for n, stats in zip(samples, stats_list)) / sum(samples)
        for name in stats_list[0]
    }


def exchange(grads, report):
    """The sum of grads over every rank, in place, and every rank's report, in rank order. A rank
    that is gone, or silent for TIMEOUT, ends the run."""
    reports = [None] * dist.get_world_size()
    try:
        dist.all_reduce(grads)
        dist.all_gather_object(reports, report)
    except RuntimeError as error:
        # This is how gloo reports a lost rank: its first line says why, the rest is C++ frames.
        why = str(error).strip().splitlines()[0]
        raise runs.ProcessLost(f"rank {dist.get_rank()} lost a rank: {why}") from None
    return reports


def rank0_options(parser, args, params):
    """Rank 0's options and hyperparameters on every rank (only rank 0 can see a resumed run's
    folder), whose checkpoint must have as many ranks."""
    options = [args, params]
    dist.broadcast_object_list(options, src=0)
    args, params = options
    world_size = dist.get_world_size()
    if getattr(args, "world_size", world_size) != world_size:
        parser.error(
            f"--resume: the run in {args.resume} has {args.world_size} ranks, not {world_size}"
        )
    args.world_size = world_size
    return args, params


def share_weights(net, optimizer):
    """Rank 0's weights and Adam state (a resumed run's) on every rank, as CPU tensors for gloo."""
    weights = torch.nn.utils.parameters_to_vector(net.parameters()).cpu()
    dist.broadcast(weights, src=0)
    torch.nn.utils.vector_to_parameters(weights.to(next(net.parameters()).device), net.parameters())
    state = optimizer.state_dict()
    state["state"] = {
        i: {name: value.cpu() for name, value in s.items()} for i, s in state["state"].items()
    }
    shared = [state]
    dist.broadcast_object_list(shared, src=0)
    optimizer.load_state_dict(shared[0])  # its tensors go to the parameters' device


if __name__ == "__main__":
    parser = runs.argument_parser(__doc__)
    parser.add_argument(
        "--envs", type=runs.positive_int, help=f"envs per rank (default: {PONG['envs']})"
    )
    parser.parse_args()  # bad input ends every rank alike, before one waits for another
    if "RANK" not in os.environ:
        parser.error(
            "start it with torchrun, e.g. torchrun --standalone --nproc-per-node 4 a3c_dist.py"
        )
    rank = int(os.environ["RANK"])  # numbers the ranks across machines
    # Rank 0 reads the options and a resumed run's checkpoint, records the run and decides its stop.
    master_process = rank == 0
    if master_process:
        args, params, checkpoint = runs.setup(parser, HYPERPARAMS)
    else:  # a signal asks every rank to stop; rank 0 decides the step at which all do
        args = params = checkpoint = None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, runs.request_stop)
    # Gloo carries CPU tensors, between GPU machines too.
    dist.init_process_group("gloo", timeout=TIMEOUT)
    args, params = rank0_options(parser, args, params)
    device = torch.device("cuda" if args.cuda else "cpu")
    torch.manual_seed(args.seed)
    if args.cuda:  # LOCAL_RANK picks the GPU on this machine
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)  # where calls that take the current device land
    # The network runs on one thread; the envs step on the rank's share of the cores.
    torch.set_num_threads(1)
    threads = common.cores_per_process(int(os.environ["LOCAL_WORLD_SIZE"]))
    env = common.make_fast_env(args.env, params.envs, threads=threads)
    net = A2C(env.single_observation_space.shape, env.single_action_space.n, args.bf16).to(device)
    # The learning rate is scaled by the batch's square root.
    lr = params.learning_rate * (dist.get_world_size() * params.micro_batch / 128) ** 0.5
    optimizer = torch.optim.Adam(net.parameters(), lr=lr, eps=params.adam_eps)
    tracker = runs.RewardTracker(args, net, env)
    counts = runs.Counters(frames=0)  # played in all, over the whole run
    # What a checkpoint holds, and --resume restores.
    checkpoint_contents = dict(net=net, optimizer=optimizer, tracker=tracker, counts=counts)

    if checkpoint:  # go on where the stopped run was
        runs.restore(args, checkpoint, checkpoint_contents)
    share_weights(net, optimizer)  # every rank starts from rank 0's
    stop = False

    with runs.Run(args, params, tracker, checkpoint_contents, records=master_process) as run:
        for samples, stats, new_frames, episodes in gradients(params, args, env, net, rank, device):
            # Every rank sums every rank's gradient and applies the same step: the weights stay
            # equal. The gradient goes to the CPU, as gloo carries CPU tensors.
            grads = torch.cat([p.grad.flatten() for p in net.parameters()]).cpu() * samples
            reports = exchange(grads, (samples, stats, new_frames, episodes, stop))
            samples_list, stats_list, frames_list, episodes_list, stops = zip(*reports)
            # Rank 0 decided to stop a step ago: every rank stops here, at the same step.
            if stops[0]:
                break
            if master_process:  # rank 0 counts the run's frames
                counts.frames += sum(frames_list)
                tracker.update(counts.frames, sum(episodes_list, []))
                run.save_checkpoint_if_due()
                stop = run.should_stop()
            mean_grads(net, grads, samples_list, device)
            stats = mean_stats(stats_list, samples_list)
            stats["grad_max"] = torch.stack([p.grad.abs().max() for p in net.parameters()]).max()
            stats["grad_l2"] = torch.nn.utils.clip_grad_norm_(net.parameters(), params.clip_grad)
            optimizer.step()
            if master_process:
                tracker.record_step(loss=stats["loss_total"], **stats)
    dist.destroy_process_group()
    # os._exit, not sys.exit: gloo's threads may still be releasing the last collective's tensors,
    # which takes the GIL, and Python's finalization under them aborts the process (SIGABRT)
    os._exit(run.exit_code)
