"""Unit tests of what scripts define: hyperparameters, networks, losses and gradient plumbing."""

import copy
import inspect
import time
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

import a3c_data
import a3c_dist
import a3c_grad
import common
import dqn_baseline
import dqn_compile
import dqn_fast
import dqn_mp
import processes
import runs
from conftest import DEVICES

DQN_MODULES = [dqn_baseline, dqn_fast, dqn_mp, dqn_compile]
GAMMA = 0.5
A3C_MODULES = [a3c_data, a3c_grad]


# ---------------------------------------------------------------- the copies between scripts
@pytest.mark.parametrize(
    "modules, names",
    [
        (DQN_MODULES, ["DQN", "epsilon_by_frame"]),
        ([dqn_fast, dqn_mp], ["DQNAgent"]),
        ([dqn_fast, dqn_mp, dqn_compile], ["PONG", "CARTPOLE", "HYPERPARAMS", "calc_loss_dqn"]),
        (A3C_MODULES, ["A2C", "select_actions", "calc_loss_a2c"]),
    ],
)
def test_copies_between_scripts_are_identical(modules, names):
    for name in names:
        first = getattr(modules[0], name)
        for module in modules[1:]:
            other = getattr(module, name)
            if inspect.isfunction(first) or inspect.isclass(first):
                assert inspect.getsource(other) == inspect.getsource(first), (
                    f"{module.__name__}.{name}"
                )
            else:
                assert other == first, f"{module.__name__}.{name}"


def test_the_faster_dqns_hyperparameters_are_the_baselines_and_the_envs_stepped_as_one():
    for env in ["pong", "cartpole"]:
        assert dqn_fast.HYPERPARAMS[env] == dict(dqn_baseline.HYPERPARAMS[env], envs=3)


def test_a3c_scripts_differ_only_in_batching():
    for env in ["pong", "cartpole"]:
        data, grad = a3c_data.HYPERPARAMS[env], a3c_grad.HYPERPARAMS[env]
        differing = {k for k in data.keys() | grad.keys() if data.get(k) != grad.get(k)}
        assert differing == {"batch_size"}
    # a3c_data's batch is what an a3c_grad step averages: one gradient from each worker
    assert a3c_data.PONG["batch_size"] == a3c_grad.PONG["processes"] * a3c_grad.PONG["micro_batch"]


# ---------------------------------------------------------------- networks
@pytest.mark.parametrize("obs_shape, dtype", [((4, 84, 84), torch.uint8), ((4,), torch.float32)])
@pytest.mark.parametrize("batch", [1, 3])
def test_network_output_shapes(obs_shape, dtype, batch):
    x = torch.zeros(batch, *obs_shape, dtype=dtype)
    with torch.no_grad():
        q_vals = dqn_fast.DQN(obs_shape, 6)(x)
        logits, value = a3c_data.A2C(obs_shape, 6)(x)
    assert q_vals.shape == (batch, 6)
    assert logits.shape == (batch, 6)
    assert value.shape == (batch,)
    assert q_vals.dtype == logits.dtype == value.dtype == torch.float32


# ---------------------------------------------------------------- hyperparameters
def test_pong_epsilon_decays_linearly_then_stays():
    params = types.SimpleNamespace(**dqn_fast.HYPERPARAMS["pong"])
    assert dqn_fast.epsilon_by_frame(params, 0) == 1.0
    assert dqn_fast.epsilon_by_frame(params, 50_000) == pytest.approx(0.51)  # 1 + 0.5 * (0.02 - 1)
    assert dqn_fast.epsilon_by_frame(params, 100_000) == pytest.approx(0.02)
    assert dqn_fast.epsilon_by_frame(params, 1_000_000) == pytest.approx(0.02)


def test_pong_replay_buffer_holds_about_one_frame_a_transition():
    replay_size = dqn_fast.HYPERPARAMS["pong"]["replay_size"]
    buffer = common.ReplayBuffer(replay_size, gym.spaces.Box(0, 255, (4, 84, 84), np.uint8))
    arrays = [
        buffer.frames,
        buffer.index.rows,
        buffer.index.uses,
        buffer.actions,
        buffer.rewards,
        buffer.dones,
    ]
    # 112,564 frames of 84 * 84 bytes (0.74 GiB), 5 slots and the rest of 100k transitions (4.7 MB)
    assert sum(a.nbytes for a in arrays) < 1.15 * replay_size * 84 * 84 + 6 * 8 * replay_size


# ---------------------------------------------------------------- a3c_grad plumbing
def test_a3c_grad_applies_the_mean_of_worker_gradients_weighted_by_their_samples():
    net = torch.nn.Linear(2, 1)  # parameters: weight [1, 2], bias [1]
    net.weight.grad = torch.full((1, 2), 100.0)  # a stale gradient must be replaced, not added to
    # Worker 0 took its gradient on 1 sample, worker 1 on 3.
    slots = torch.tensor([[1.0, 2.0, 3.0], [11.0, 22.0, 33.0]])
    a3c_grad.mean_grads(net, slots, [1, 3], "cpu")
    assert net.weight.grad.tolist() == [[8.5, 17.0]]  # (1 * 1 + 3 * 11) / 4, (2 + 66) / 4
    assert net.bias.grad.tolist() == [25.5]  # (3 + 99) / 4
    stats = a3c_grad.mean_stats(
        [{"loss_total": 1.0, "values": -2.0}, {"loss_total": 5.0, "values": 2.0}], [1, 3]
    )
    assert stats == {"loss_total": 4.0, "values": 1.0}  # (1 + 15) / 4, (-2 + 6) / 4


@pytest.mark.parametrize("device", DEVICES)
def test_a3c_grad_averaged_worker_gradients_equal_the_gradient_of_the_mean_loss_over_all_samples(
    device,
):
    torch.manual_seed(0)
    net = a3c_grad.A2C((4,), 2)
    # unequal batches: an episode's end flushes several experiences at once
    batches = [(torch.randn(n, 4), torch.randint(2, (n,)), torch.randn(n)) for n in (5, 3)]
    slots, stats_list = torch.zeros(2, sum(p.numel() for p in net.parameters())), []
    for slot, (states, actions, ref_vals) in zip(slots, batches):  # what each worker does
        net.zero_grad()
        loss_total, stats = a3c_grad.calc_loss_a2c(net, states, actions, ref_vals, 0.01)
        loss_total.backward()
        slot.copy_(torch.cat([p.grad.flatten() for p in net.parameters()]))
        stats_list.append({k: v.item() for k, v in stats.items()})
    net.to(device)
    # This is what the main process applies, averaged on the device.
    a3c_grad.mean_grads(net, slots, [5, 3], device)
    applied = [p.grad.cpu() for p in net.parameters()]
    assert {p.grad.device.type for p in net.parameters()} == {device}
    net.cpu().zero_grad()
    # This is a3c_data's one batch.
    states, actions, ref_vals = (torch.cat(parts) for parts in zip(*batches))
    loss_total, stats = a3c_grad.calc_loss_a2c(net, states, actions, ref_vals, 0.01)
    loss_total.backward()
    for got, expected in zip(applied, net.parameters()):
        torch.testing.assert_close(got, expected.grad)
    # Every stat is a mean over samples: weighted by samples, the workers' give that of all samples.
    assert a3c_grad.mean_stats(stats_list, [5, 3]) == pytest.approx(
        {k: v.item() for k, v in stats.items()}
    )


# ---------------------------------------------------------------- a3c_data plumbing
class Sent(Exception):
    pass


def test_a3c_data_worker_alternates_two_slots_leaving_a_sent_one_until_its_next_message_is_taken():
    # The main process copies a message's states out of their slot before it takes that worker's
    # next message, so the slot must hold them until the worker's next send returns.
    params = types.SimpleNamespace(**dict(a3c_data.HYPERPARAMS["cartpole"], processes=2))
    args = types.SimpleNamespace(env="cartpole", seed=3, cuda=False)
    env = common.make_fast_env("cartpole")
    net = a3c_data.A2C(env.single_observation_space.shape, env.single_action_space.n)
    slots = a3c_data.make_sample_slots(params, env.single_observation_space)
    taken = []  # (slot, states) of each message, as the main process copies them

    def send(message):  # what the main process does with worker 1's messages
        worker_id, slot, actions, _, _, _ = message
        assert worker_id == 1
        if taken:
            last_slot, last_states = taken[-1]
            assert slot != last_slot
            # The slot is not refilled yet.
            assert torch.equal(slots[1, last_slot, : len(last_states)], last_states)
        taken.append((slot, slots[1, slot, : len(actions)].clone()))
        if len(taken) == 300:
            raise Sent

    threads = torch.get_num_threads()
    with torch.random.fork_rng(), pytest.raises(Sent):
        a3c_data.data_func(params, args, net, slots, 1, send=send)
    torch.set_num_threads(threads)
    sizes = [len(states) for _, states in taken]
    # Some messages went past a micro-batch and a sample from each env: games ended in their last
    # step, and they fit.
    assert max(sizes) > params.micro_batch + params.envs - 1
    assert not slots[0].any()  # worker 0's slots untouched


# ---------------------------------------------------------------- losses
class LinearQ(torch.nn.Module):
    """Q-values = state @ table: one-hot states pick a row of the table."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table))

    def forward(self, x):
        return x @ self.table


@pytest.mark.parametrize("module", DQN_MODULES)
def test_calc_loss_dqn_by_hand(module):
    net, tgt_net = LinearQ([[1.0, 2.0], [3.0, 4.0]]), LinearQ([[10.0, 20.0], [30.0, 40.0]])
    batch = (
        np.array([[1, 0], [0, 1]], np.float32),
        np.array([1, 0]),
        np.array([1.0, -1.0], np.float32),
        np.array([False, True]),
        np.array([[0, 1], [1, 0]], np.float32),
    )
    loss = module.calc_loss_dqn(batch, net, tgt_net, GAMMA, "cpu")
    # Q(s, a) = [2, 3]; targets: 1 + 0.5 * max(30, 40) = 21, and -1 (done: no bootstrap)
    assert loss.item() == pytest.approx(((2 - 21) ** 2 + (3 + 1) ** 2) / 2)  # 188.5
    loss.backward()
    assert tgt_net.table.grad is None  # the target is a constant


def test_dqn_compile_train_step_by_hand():
    # a buffer of one transition, twice: every draw gives loss (Q(s, a) - y)^2 with Q(s, a) = 2 and
    # y = 1 + 0.5 * 40 = 21; its gradient on the table's entry [0, 1] is 2 * (q - y)
    net, tgt_net = LinearQ([[1.0, 2.0], [3.0, 4.0]]), LinearQ([[10.0, 20.0], [30.0, 40.0]])
    buffer = dqn_compile.DeviceReplayBuffer(
        4, gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), torch.device("cpu")
    )
    exp = common.ExperienceFirstLast(
        np.array([1, 0], np.float32), 1, 1.0, np.array([0, 1], np.float32), 1
    )
    buffer.extend([exp, exp])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    loss = dqn_compile.train_step(buffer, net, tgt_net, optimizer, 8, GAMMA)
    assert loss.item() == pytest.approx(19**2)
    assert net.table[0, 1].item() == pytest.approx(2 + 0.01 * 38)  # 2.38
    dqn_compile.train_step(buffer, net, tgt_net, optimizer, 8, GAMMA)  # the last grad is gone first
    assert net.table[0, 1].item() == pytest.approx(2.38 + 0.01 * 2 * (21 - 2.38))  # 2.7524
    assert torch.equal(net.table.detach()[[0, 1, 1], [0, 0, 1]], torch.tensor([1.0, 3.0, 4.0]))
    assert torch.equal(tgt_net.table.detach(), torch.tensor([[10.0, 20.0], [30.0, 40.0]]))


def random_dqn_batch(rng, device="cpu"):
    """Tensors (states, actions, rewards, dones, last_states) of 96 random 4-vector transitions."""
    arrays = (
        rng.normal(size=(96, 4)).astype(np.float32),
        rng.integers(2, size=96),
        rng.normal(size=96).astype(np.float32),
        rng.random(96) < 0.2,
        rng.normal(size=(96, 4)).astype(np.float32),
    )
    return tuple(torch.as_tensor(array, device=device) for array in arrays)


def pong_transitions(steps):
    """The one-step experiences of `steps` steps of 2 Pong envs under random actions (seed 0), a
    step's list at a time: real frames, and (within 1,000 steps) an episode's end."""
    env = common.make_fast_env("pong", 2)
    rng = np.random.default_rng(0)
    source = common.ExperienceSourceFirstLast(
        env, lambda obs: rng.integers(6, size=2), GAMMA, seed=0
    )
    played = [exps for _, exps in zip(range(steps), source)]
    env.close()
    return played


@pytest.fixture(scope="module")
def pong_played():
    """The one-step experiences of 150 steps of 2 Pong envs under random actions."""
    return [exp for exps in pong_transitions(150) for exp in exps]


@pytest.mark.parametrize("module", DQN_MODULES)
def test_a_dqn_training_step_feeds_both_networks_pong_frames_scaled_to_0_1(module, pong_played):
    # What both networks' first layers see, in a step on real Pong frames from the buffer.
    net = module.DQN((4, 84, 84), 6)
    tgt_net = copy.deepcopy(net)
    seen = []
    for first_layer in (net.body[0], tgt_net.body[0]):
        first_layer.register_forward_pre_hook(lambda layer, args: seen.append(args[0].detach()))
    if module is dqn_compile:
        buffer = dqn_compile.DeviceReplayBuffer(
            1000, common.make_fast_env("pong").single_observation_space, torch.device("cpu")
        )
        buffer.extend(pong_played)
        dqn_compile.train_step(buffer, net, tgt_net, torch.optim.Adam(net.parameters()), 64, GAMMA)
    else:
        buffer = common.ReplayBuffer(
            1000, common.make_fast_env("pong").single_observation_space, seed=0
        )
        for exp in pong_played:
            buffer.append(exp)
        module.calc_loss_dqn(buffer.sample(64), net, tgt_net, GAMMA, "cpu")
    assert len(seen) == 2
    for inputs in seen:
        assert inputs.dtype == torch.float32 and inputs.min() >= 0 and 0.5 < inputs.max() <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_dqn_compile_device_buffer_gives_the_replay_buffers_samples_for_the_same_indices(device):
    # a ring of 500 that wraps 4 times over 1,100 steps of 2 envs, an episode's end included
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    host, device = (
        common.ReplayBuffer(500, space),
        dqn_compile.DeviceReplayBuffer(500, space, torch.device(device)),
    )
    checked = 0
    for step, exps in enumerate(pong_transitions(1100)):
        for exp in exps:
            host.append(exp)
        device.extend(exps)
        assert len(device) == len(host)
        # Check at an end, and at part full, full and wrapped.
        if any(exp.last_state is None for exp in exps) or step % 50 == 0:
            host.rng = np.random.default_rng(checked)
            # These are the indices that host.sample draws.
            idx = np.random.default_rng(checked).integers(0, len(host), 300)
            for expected, got in zip(
                host.sample(300), device.transitions(torch.as_tensor(idx, device=device.device))
            ):
                assert np.array_equal(expected, got.cpu().numpy())
            checked += 1
    assert device.count > 2000  # 2 envs, 1,100 steps, less the steps that only reset an env
    assert checked >= 3 and host.dones.any()


def test_dqn_compile_device_buffer_samples_only_what_it_holds():
    space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    buffer = dqn_compile.DeviceReplayBuffer(8, space, torch.device("cpu"))
    state = np.zeros(4, np.float32)
    buffer.extend(
        [common.ExperienceFirstLast(state + v, v, v / 2, state + v + 1, 1) for v in (1.0, 2.0, 3.0)]
    )
    states, actions, rewards, dones, last_states = buffer.sample(1000)
    assert set(actions.tolist()) == {1, 2, 3}  # 3 of 8 slots filled: only those drawn
    assert torch.equal(states[:, 0], actions.float()) and torch.equal(rewards, actions / 2)
    assert torch.equal(last_states[:, 0], actions + 1.0) and not dones.any()
    for v in range(4, 14):  # 10 more: the ring overwrites 1 to 5
        buffer.extend([common.ExperienceFirstLast(state + v, v, v / 2, None, 1)])
    states, actions, rewards, dones, last_states = buffer.sample(1000)
    assert set(actions.tolist()) == set(range(6, 14)) and dones.all() and not last_states.any()


def filled_device_buffer(device, capacity=64):
    """A DeviceReplayBuffer of 4-vectors on device, full, some transitions terminal."""
    rng = np.random.default_rng(0)
    buffer = dqn_compile.DeviceReplayBuffer(
        capacity, gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), device
    )
    buffer.extend(
        [
            common.ExperienceFirstLast(
                rng.normal(size=4).astype(np.float32),
                int(rng.integers(2)),
                float(rng.normal()),
                None if rng.random() < 0.2 else rng.normal(size=4).astype(np.float32),
                1,
            )
            for _ in range(capacity)
        ]
    )
    return buffer


@pytest.mark.parametrize("device", DEVICES)
def test_dqn_compile_steps_as_the_script_takes_them_match_eager_steps_no_recompile_or_skipped_graph(
    device,
):
    # as dqn_compile.py runs them: acting compiled without gradient, then training steps that sample
    # the device buffer (on the GPU as CUDA graphs: warm-up, recording, replays), with new
    # transitions, acting and a new epsilon between them and a target sync after some replays; a
    # twin takes the same steps eagerly. Drawn as eager code draws (fallback_random), the compiled
    # step samples the same indices from the same seed
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    device = torch.device(device)
    mode = "reduce-overhead" if device.type == "cuda" else None
    nets = [dqn_compile.DQN((4,), 2).to(device) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    tgt_nets = [copy.deepcopy(net) for net in nets]
    optimizers = [torch.optim.Adam(net.parameters(), lr=1e-3) for net in nets]
    buffers = [filled_device_buffer(device) for _ in range(2)]
    start = [p.detach().clone() for p in nets[0].parameters()]
    rng = np.random.default_rng(1)
    states = torch.as_tensor(rng.normal(size=(3, 4)).astype(np.float32), device=device)
    epsilon = torch.tensor(1.0, device=device)
    torch._dynamo.mark_static_address(epsilon)
    with (
        torch._dynamo.config.patch(error_on_recompile=True),
        torch._inductor.config.patch(fallback_random=True),
    ):
        act = dqn_compile.compile_or_exit(
            None, dqn_compile.select_actions, mode, [nets[1], states, epsilon]
        )
        compiled_step = dqn_compile.compile_train_step(
            buffers[1], nets[1], tgt_nets[1], optimizers[1], 96, GAMMA
        )
        for step in range(1, 9):
            torch.manual_seed(step)
            eager = dqn_compile.train_step(
                buffers[0], nets[0], tgt_nets[0], optimizers[0], 96, GAMMA
            )
            torch.manual_seed(step)
            compiled = compiled_step()
            assert compiled.item() == pytest.approx(eager.item(), rel=1e-4), step
            for eager_param, compiled_param in zip(nets[0].parameters(), nets[1].parameters()):
                torch.testing.assert_close(compiled_param, eager_param, rtol=1e-4, atol=1e-5)
            epsilon.fill_(0.0)  # greedy: acting between steps sees the weights the steps made
            torch.testing.assert_close(act(nets[1], states, epsilon), nets[0](states).argmax(dim=1))
            epsilon.fill_(1.0 - step / 8)
            exp = common.ExperienceFirstLast(
                rng.normal(size=4).astype(np.float32), step % 2, 1.0, None, 1
            )
            for buffer in buffers:
                buffer.extend([exp])
            if step == 5:  # after replays: the target's weights change under the graphs
                for net, tgt_net in zip(nets, tgt_nets):
                    tgt_net.load_state_dict(net.state_dict())
    for eager_param, before in zip(nets[0].parameters(), start):
        assert not torch.equal(eager_param, before)  # every weight moved: the steps were real
    if device.type == "cuda":  # acting replayed as CUDA graphs, none skipped (the CPU records none)
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


def test_dqn_compile_acting_explores_at_rate_epsilon():
    net = LinearQ([[0.0, 1.0, 0.0, 0.0]] * 2)  # greedy: action 1, whatever the state
    states = torch.ones(4000, 2)
    # A random action is 1 a quarter of the time.
    for epsilon, expected in [(0.0, 0.0), (0.5, 0.5 * 3 / 4), (1.0, 3 / 4)]:
        actions = dqn_compile.select_actions(net, states, torch.tensor(epsilon))
        assert set(actions.tolist()) <= {0, 1, 2, 3}
        assert (actions != 1).float().mean().item() == pytest.approx(expected, abs=0.03)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_dqn_compile_on_cuda_queues_200_training_steps_with_no_host_sync_recompile_or_graph_skip():
    # the script's step as it runs on Pong: a step's transitions stored, a compiled training step
    # replayed as a CUDA graph, a target sync every 50. Behind a kernel that keeps the GPU busy for
    # about 2 s, none of it may wait for the GPU: the stream is still busy when all 200 are queued
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    device = torch.device("cuda")
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    buffer = dqn_compile.DeviceReplayBuffer(2000, space, device)
    played = pong_transitions(400)
    for exps in played[:300]:
        buffer.extend(exps)
    net = dqn_compile.DQN(space.shape, 6, bf16=True).to(device)
    tgt_net = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    step = dqn_compile.compile_train_step(buffer, net, tgt_net, optimizer, 96, 0.99)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(step.WARMUP_CALLS + 1):  # compiling, warm-up, recording
            step()
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # cycles: about 2 s at the H100's and H200's 1.98 GHz
        queued = time.perf_counter()
        for i, exps in enumerate(played[300:] * 2):
            buffer.extend(exps)
            loss = step()
            if i % 50 == 49:
                tgt_net.load_state_dict(net.state_dict())
        queued = time.perf_counter() - queued
        busy = not torch.cuda.current_stream().query()
        assert np.isfinite(loss.item())
    assert busy, f"the GPU finished its 2 s kernel while 200 steps were queued in {queued:.2f} s"
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


class FixedA2C(torch.nn.Module):
    """Logits and values are parameters of their own, whatever the state."""

    def __init__(self, logits, values):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits))
        self.values = torch.nn.Parameter(torch.tensor(values))

    def forward(self, x):
        return self.logits, self.values


@pytest.mark.parametrize("module", A3C_MODULES)
def test_calc_loss_a2c_by_hand(module):
    net = FixedA2C([[0.0, 0.0], [0.0, 0.0]], [1.0, 2.0])  # uniform policy over 2 actions
    loss_total, stats = module.calc_loss_a2c(
        net, None, torch.tensor([0, 1]), torch.tensor([3.0, 1.0]), 0.01
    )
    ln2 = np.log(2)
    assert stats["loss_value"].item() == pytest.approx(((1 - 3) ** 2 + (2 - 1) ** 2) / 2)  # 2.5
    assert stats["advantage"].item() == pytest.approx((2 - 1) / 2)  # [2, -1]
    # -mean(adv * log pi(a|s)) = -(2 * -ln2 + -1 * -ln2) / 2
    assert stats["loss_policy"].item() == pytest.approx(ln2 / 2)
    # beta * mean(sum p log p) = 0.01 * -ln2: minus beta times the entropy
    assert stats["loss_entropy"].item() == pytest.approx(-0.01 * ln2)
    assert loss_total.item() == pytest.approx(2.5 + ln2 / 2 - 0.01 * ln2)


@pytest.mark.parametrize("module", A3C_MODULES)
def test_policy_loss_sends_no_gradient_to_the_value_head(module):
    torch.manual_seed(0)
    net = module.A2C((4,), 3)
    _, stats = module.calc_loss_a2c(
        net, torch.randn(8, 4), torch.randint(3, (8,)), torch.randn(8), 0.01
    )
    stats["loss_policy"].backward()
    value_head = [*net.value_hidden.parameters(), *net.value.parameters()]
    assert all(p.grad is None or not p.grad.any() for p in value_head)  # advantage detached
    assert any(p.grad is not None and p.grad.any() for p in net.policy.parameters())


@pytest.mark.parametrize("module", A3C_MODULES)
def test_entropy_loss_step_makes_the_policy_less_certain(module):
    net = FixedA2C([[2.0, 0.0, -1.0]], [0.0])

    def entropy():
        probs = torch.softmax(net.logits, dim=1)
        return -(probs * probs.log()).sum().item()

    before = entropy()
    _, stats = module.calc_loss_a2c(net, None, torch.tensor([0]), torch.tensor([0.0]), 0.01)
    stats["loss_entropy"].backward()
    with torch.no_grad():
        net.logits -= 10.0 * net.logits.grad  # one gradient-descent step on the entropy term
    assert entropy() > before


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a3c_graphed_net_acts_and_takes_gradients_as_the_net_itself(device, bf16):
    # As an A3C worker calls it under --cuda: acting on its envs' states without gradient, then the
    # gradient of a micro-batch of one of several sizes, then new weights copied in place (a
    # refresh, an optimizer step); on the GPU each call replays a CUDA graph recorded for its size,
    # on the CPU only the tracing is run.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    device = torch.device(device)
    net = a3c_grad.A2C((4, 84, 84), 6, bf16).to(device)
    graphed_net = torch.compile(net, backend="cudagraphs")  # the scripts' line
    rng = np.random.default_rng(0)
    # On a GPU, a convolution run twice gives the same sums.
    with torch.backends.cudnn.flags(enabled=True, deterministic=True):
        for call, size in enumerate([32, 33, 39, 32, 33, 39]):
            states = rng.integers(0, 256, (8, 4, 84, 84), dtype=np.uint8)
            acted = []
            for acting_net in [net, graphed_net]:
                torch.manual_seed(call)
                acted.append(a3c_grad.select_actions(acting_net, states, device))
            np.testing.assert_array_equal(acted[1], acted[0])
            batch = (
                torch.as_tensor(
                    rng.integers(0, 256, (size, 4, 84, 84), dtype=np.uint8), device=device
                ),
                torch.as_tensor(rng.integers(0, 6, size), device=device),
                torch.as_tensor(rng.normal(size=size).astype(np.float32), device=device),
            )
            grads, losses = [], []
            for loss_net in [net, graphed_net]:
                net.zero_grad()
                loss_total, stats = a3c_grad.calc_loss_a2c(loss_net, *batch, 0.01)
                loss_total.backward()
                grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
                losses.append(torch.stack(list(stats.values())))
            torch.testing.assert_close(losses[1], losses[0])
            torch.testing.assert_close(grads[1], grads[0])
            with torch.no_grad():  # new weights, in place: the graphs read them where they are
                for p in net.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
    # Every call was replayed as a CUDA graph, none skipped (the CPU records none).
    if device.type == "cuda":
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


# ---------------------------------------------------------------- a3c_dist messages
def test_a3c_dist_shares_a3c_grad_code_and_hyperparameters():
    for name in ["A2C", "select_actions", "calc_loss_a2c"]:
        assert inspect.getsource(getattr(a3c_dist, name)) == inspect.getsource(
            getattr(a3c_grad, name)
        )
    for env in ["pong", "cartpole"]:
        # torchrun's --nproc-per-node sets the number of ranks
        assert a3c_dist.HYPERPARAMS[env] == {
            k: v for k, v in a3c_grad.HYPERPARAMS[env].items() if k != "processes"
        }


def test_a3c_dist_ranks_gradients_summed_times_their_samples_give_the_mean_weighted_by_samples():
    net = torch.nn.Linear(2, 1)  # parameters: weight [1, 2], bias [1]
    # These are each rank's flat gradient, and its samples.
    sent = [([1.0, 2.0, 3.0], 1), ([11.0, 22.0, 33.0], 3)]
    # This is what all_reduce leaves on every rank.
    summed = sum(torch.tensor(grad) * samples for grad, samples in sent)
    net.weight.grad = torch.full((1, 2), 100.0)  # a stale gradient must be replaced, not added to
    a3c_dist.mean_grads(net, summed, [1, 3], "cpu")
    assert net.weight.grad.tolist() == [[8.5, 17.0]]  # (1 * 1 + 3 * 11) / 4, (2 + 66) / 4
    assert net.bias.grad.tolist() == [25.5]  # (3 + 99) / 4
    # The loss is (1 + 3 * 5) / 4.
    assert a3c_dist.mean_stats([{"loss": 1.0}, {"loss": 5.0}], [1, 3]) == {"loss": 4.0}


def exchange_as_rank(store, rank, *, send):
    """Child process: rank `rank` of 2 exchanges its gradient and report, sends what it has then."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    grads = torch.tensor([1.0, 2.0]) * (rank + 1)
    episodes = [(-3.5, 12), (0.0, 40)] + [(21.0, 900)] * 40 if rank else []
    report = (rank + 1, {"loss": 0.25 + rank, "values": -1.0}, 10 * rank, episodes, rank == 0)
    reports = a3c_dist.exchange(grads, report)
    send((rank, grads.tolist(), reports))
    while True:
        time.sleep(1)


def test_a3c_dist_exchange_sums_gradients_on_every_rank_and_gives_every_report_in_rank_order(
    tmp_path,
):
    children = {f"rank {rank}": (str(tmp_path / "store"), rank) for rank in range(2)}
    got = {}
    with processes.ChildProcesses(exchange_as_rank, children) as messages:
        for rank, grads, reports in messages:
            got[rank] = grads, reports
            if len(got) == 2:
                break
    # every report whole, its 42 episodes too, and rank 0's word to stop
    expected = [
        (1, {"loss": 0.25, "values": -1.0}, 0, [], True),
        (
            2,
            {"loss": 1.25, "values": -1.0},
            10,
            [(-3.5, 12), (0.0, 40)] + [(21.0, 900)] * 40,
            False,
        ),
    ]
    assert got == {rank: ([3.0, 6.0], expected) for rank in range(2)}


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather_object"])
def test_a3c_dist_a_lost_rank_is_named_in_one_line_without_gloos_cpp_frames(
    collective, monkeypatch
):
    def lost(*args):  # what gloo raises when a peer's connection resets
        raise torch.distributed.DistBackendError(
            "[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:6028: "
            "Connection reset by peer\n"
            "Exception raised from recvBytes (most recent call first):\nframe #0: c10::Error::Error"
        )

    monkeypatch.setattr(a3c_dist.dist, "all_reduce", lambda tensor: None)
    monkeypatch.setattr(a3c_dist.dist, collective, lost)
    monkeypatch.setattr(a3c_dist.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(a3c_dist.dist, "get_rank", lambda: 1)
    with pytest.raises(runs.ProcessLost) as error:
        a3c_dist.exchange(torch.zeros(3), (32, {"loss": 0.5}, 32, [], False))
    assert (
        str(error.value)
        == "rank 1 lost a rank: [gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:6028: "
        "Connection reset by peer"
    )


# ---------------------------------------------------------------- bf16 mixed precision
U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest


@pytest.fixture(scope="module")
def pong_frames():
    """32 stacked observations of real Pong, under random actions, ball in play."""
    env = common.make_fast_env("pong", 1, threads=1)
    rng = np.random.default_rng(0)
    states = [env.reset(seed=0)[0][0]]
    while len(states) < 96:
        states.append(env.step(rng.integers(6, size=1))[0][0])
    env.close()
    return np.stack(states[64:])


def weighted_layers(net):
    return [m for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]


def reduction_condition(net, backward):
    """For each layer: || |delta|^T |x| || / || delta^T x ||, the condition number of the sum that
    gives its weight gradient (x its input, delta the gradient at its output), from an fp32 pass.
    1 where no terms cancel; the bigger, the more of a term's rounding error survives the sum."""
    seen = {}

    def keep_input_and_delta(m, args, out):
        seen[m] = [args[0].detach()]
        out.register_hook(seen[m].append)

    hooks = [m.register_forward_hook(keep_input_and_delta) for m in weighted_layers(net)]
    backward()
    for hook in hooks:
        hook.remove()

    def grad(m, x, delta):
        if isinstance(m, torch.nn.Conv2d):
            return torch.nn.grad.conv2d_weight(x, m.weight.shape, delta, stride=m.stride)
        return delta.t() @ x

    condition = {}
    for m, (x, delta) in seen.items():
        condition[m] = (grad(m, x.abs(), delta.abs()).norm() / grad(m, x, delta).norm()).item()
    return condition


def relative_error(approx, exact):
    return ((approx - exact).norm() / exact.norm()).item()


def dqn_backward(net, frames, seed, device):
    rng = np.random.default_rng(seed)
    tgt_net = copy.deepcopy(net)
    batch = (
        frames,
        rng.integers(6, size=32),
        rng.uniform(-1, 1, size=32).astype(np.float32),
        np.zeros(32, dtype=bool),
        frames[::-1].copy(),
    )

    def backward():
        net.zero_grad()
        loss = dqn_fast.calc_loss_dqn(batch, net, tgt_net, 0.99, device)
        loss.backward()
        return loss.detach()

    return backward


def a2c_backward(net, frames, seed, device):
    rng = np.random.default_rng(seed)
    states = torch.as_tensor(frames, device=device)
    actions = torch.as_tensor(rng.integers(6, size=32), device=device)
    ref_vals = torch.as_tensor(rng.uniform(-1, 1, size=32), dtype=torch.float32, device=device)

    def backward():
        net.zero_grad()
        loss = a3c_data.calc_loss_a2c(net, states, actions, ref_vals, 0.01)[0]
        loss.backward()
        return loss.detach()

    return backward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "make, backward", [(dqn_fast.DQN, dqn_backward), (a3c_data.A2C, a2c_backward)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_loss_and_gradients_stay_within_the_rounding_bound(
    make, backward, seed, device, pong_frames, monkeypatch
):
    """The bound, first order in U. Under autocast a layer rounds its two operands to bf16 (a
    relative error of at most U each) and sums their products in fp32, so each product is off by at
    most 2U. A weight's gradient comes from L = 4 such layers in a row (3 convolutions and the
    hidden layer, the output layer being fp32): the forward pass up to the layer, the backward pass
    above it. So every term of the sum that makes it is off by at most 2 L U, and the sum by at most
    2 L U times its condition number (reduction_condition): 8 U times that, per weight tensor. The
    loss is mostly a mean of squares (the value term dominates A2C's at these returns), terms that
    do not cancel: 2 L U."""
    # The reference is fp32, not TF32's 10 bits.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(seed)
    net = make((4, 84, 84), 6).to(device)
    run = backward(net, pong_frames, seed, device)
    condition = reduction_condition(net, run)
    loss32 = run()
    grads32 = [m.weight.grad.clone() for m in weighted_layers(net)]
    net.bf16 = True
    loss16 = run()
    grads16 = [m.weight.grad.clone() for m in weighted_layers(net)]
    bound = 2 * 4 * U
    assert relative_error(loss16, loss32) <= bound
    for m, grad16, grad32 in zip(weighted_layers(net), grads16, grads32):
        assert grad16.dtype == torch.float32
        # The bound is capped: where the sum is ill-conditioned (the first convolution's, 57 to 97
        # here) the bound passes anything, a zero gradient too; errors seen there are at most 0.26.
        assert relative_error(grad16, grad32) <= min(bound * condition[m], 0.5), m
    # and bf16 does change them: a run that silently stayed fp32 fails here
    assert any(relative_error(g16, g32) > U / 4 for g16, g32 in zip(grads16, grads32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [dqn_fast.DQN, a3c_data.A2C])
def test_bf16_net_returns_fp32_and_nearly_fp32_values(make, device, pong_frames, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    net = make((4, 84, 84), 6).to(device)
    states = torch.as_tensor(pong_frames, device=device)
    with torch.no_grad():
        exact = net(states)
        net.bf16 = True
        mixed = net(states)
    for approx, value in zip(
        *(out if isinstance(out, tuple) else (out,) for out in (mixed, exact))
    ):
        assert approx.dtype == torch.float32
        assert 0 < relative_error(approx, value) <= 2 * 4 * U  # 4 layers, two rounded operands each


def pong_experiences(source_class, steps):
    """Every experience of `steps` steps of 2 Pong envs (ale-py's vector env, seed 0) under a fixed
    cycle of actions, with the frame count after each step."""
    env = common.make_fast_env("pong", 2)
    source = source_class(env, lambda obs: np.array([0, 2]), 0.99, seed=0)
    played, frames = [], []
    for exps in source:
        played += exps
        frames.append(source.frames)
        if len(frames) == steps:
            break
    env.close()
    return played, frames


def test_overlapped_source_yields_what_the_common_source_does_for_the_same_actions():
    # NOOP and UP: a Pong game ends (21-0) within 1,000 steps, so an episode's end and the
    # autoreset step after it are among the transitions compared
    stepped, frames = pong_experiences(common.ExperienceSourceFirstLast, 1100)
    # The overlapped source's first yield comes before any step.
    split, split_frames = pong_experiences(dqn_compile.OverlappedExperienceSource, 1101)
    assert split_frames[0] == 0 and split_frames[1:] == frames
    assert any(exp.last_state is None for exp in stepped)
    assert len(split) == len(stepped) > 2 * 1000
    for a, b in zip(stepped, split):
        assert np.array_equal(a.state, b.state) and (a.action, a.reward, a.steps) == (
            b.action,
            b.reward,
            b.steps,
        )
        assert (a.last_state is None) == (b.last_state is None)
        assert a.last_state is None or np.array_equal(a.last_state, b.last_state)
