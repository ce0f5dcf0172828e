"""Unit tests of what the scripts define: hyperparameters, networks, losses and gradient plumbing."""
import inspect
import pathlib
import sys
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # so plain `pytest` finds the scripts
import a3c_data  # noqa: E402
import a3c_grad  # noqa: E402
import common  # noqa: E402
import dqn_baseline  # noqa: E402
import dqn_fast  # noqa: E402
import dqn_mp  # noqa: E402

DQN_MODULES = [dqn_baseline, dqn_fast, dqn_mp]
A3C_MODULES = [a3c_data, a3c_grad]


# ---------------------------------------------------------------- the copies between scripts
@pytest.mark.parametrize("modules, names", [
    (DQN_MODULES, ["PONG", "CARTPOLE", "HYPERPARAMS", "DQN", "epsilon_by_frame"]),
    ([dqn_fast, dqn_mp], ["select_actions", "calc_loss_dqn"]),
    (A3C_MODULES, ["A2C", "select_actions", "calc_loss_a2c"]),
])
def test_copies_between_scripts_are_identical(modules, names):
    for name in names:
        first = getattr(modules[0], name)
        for module in modules[1:]:
            other = getattr(module, name)
            if inspect.isfunction(first) or inspect.isclass(first):
                assert inspect.getsource(other) == inspect.getsource(first), f"{module.__name__}.{name}"
            else:
                assert other == first, f"{module.__name__}.{name}"


def test_a3c_scripts_share_all_but_their_batching_hyperparameters():
    batching = {"micro_batch", "batch_size", "grad_batch", "grads_per_step"}
    for env in ["pong", "cartpole"]:
        data, grad = a3c_data.HYPERPARAMS[env], a3c_grad.HYPERPARAMS[env]
        assert {k: v for k, v in data.items() if k not in batching} == \
            {k: v for k, v in grad.items() if k not in batching}


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
    assert dqn_fast.epsilon_by_frame(params, 50_000) == pytest.approx(0.51)      # 1 + 0.5 * (0.02 - 1)
    assert dqn_fast.epsilon_by_frame(params, 100_000) == pytest.approx(0.02)
    assert dqn_fast.epsilon_by_frame(params, 1_000_000) == pytest.approx(0.02)


def test_pong_replay_buffer_fits_in_memory():
    replay_size = dqn_fast.HYPERPARAMS["pong"]["replay_size"]
    buffer = common.ReplayBuffer(replay_size, gym.spaces.Box(0, 255, (4, 84, 84), np.uint8))
    arrays = [buffer.states, buffer.last_states, buffer.actions, buffer.rewards, buffer.dones]
    # 100k states of 4 * 84 * 84 bytes (2.63 GiB) plus only the newest frame of each next state
    assert sum(a.nbytes for a in arrays) < 3.3 * 2 ** 30


# ---------------------------------------------------------------- a3c_grad plumbing
def test_a3c_grad_applies_the_sum_of_worker_gradients():
    net = torch.nn.Linear(2, 1)
    net.weight.grad = torch.full((1, 2), 100.0)     # a stale gradient must be replaced, not added to
    worker_1 = [np.array([[1.0, 2.0]], dtype=np.float32), np.array([3.0], dtype=np.float32)]
    worker_2 = [np.array([[10.0, 20.0]], dtype=np.float32), np.array([30.0], dtype=np.float32)]
    a3c_grad.sum_grads(net, [worker_1, worker_2], "cpu")
    assert net.weight.grad.tolist() == [[11.0, 22.0]]
    assert net.bias.grad.tolist() == [33.0]


def test_a3c_grad_summed_worker_gradients_equal_the_gradient_of_the_summed_losses():
    torch.manual_seed(0)
    net = a3c_grad.A2C((4,), 2)
    batches = [(torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1]), torch.randn(5)) for _ in range(2)]
    sent = []
    for states, actions, ref_vals in batches:          # what each worker does
        net.zero_grad()
        a3c_grad.calc_loss_a2c(net, states, actions, ref_vals, 0.01)[0].backward()
        sent.append([p.grad.numpy().copy() for p in net.parameters()])
    a3c_grad.sum_grads(net, sent, "cpu")
    applied = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    sum(a3c_grad.calc_loss_a2c(net, *batch, 0.01)[0] for batch in batches).backward()
    for got, expected in zip(applied, net.parameters()):
        torch.testing.assert_close(got, expected.grad)
