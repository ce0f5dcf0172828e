"""Unit tests of common.py: inputs built by hand, expected values worked out by hand."""

import collections
import contextlib
import copy
import errno
import io
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import types

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn as nn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import common
import processes
import runs
from conftest import DEVICES, REPO, our_lines

GAMMA = 0.5


# ---------------------------------------------------------------- a scripted env
class ScriptedEnv(gym.Env):
    """Observation: offset + steps taken this episode; reward of step t: 10 ** (t - 1)
    (1, 10, 100, ...); the episode ends at step `length`, terminated or truncated.
    With gamma 0.5 a window of rewards starting at 10 ** k sums to 10 ** k * (1 + 5 + 25 + ...),
    exact in floating point."""

    observation_space = gym.spaces.Box(0, 1000, (1,), np.float32)
    action_space = gym.spaces.Discrete(1000)

    def __init__(self, length, truncate=False, offset=0):
        self.length, self.truncate, self.offset = length, truncate, offset
        self.t = 0

    def _obs(self):
        return np.array([self.offset + self.t], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        ended = self.t == self.length
        return (
            self._obs(),
            float(10 ** (self.t - 1)),
            ended and not self.truncate,
            ended and self.truncate,
            {},
        )


def scripted_vec_env(*envs):
    """SyncVectorEnv (default next-step autoreset) over the given ScriptedEnv instances."""
    return gym.vector.SyncVectorEnv([lambda env=env: env for env in envs])


class CountingAgent:
    """Call k gives env i the action 10 * k + i: an experience tells which call chose its action."""

    def __init__(self):
        self.calls = 0

    def __call__(self, obs):
        actions = 10 * self.calls + np.arange(len(obs))
        self.calls += 1
        return actions


def as_tuple(exp):
    """(state, action, reward, last_state, steps) as plain numbers; last_state None stays None."""
    last = None if exp.last_state is None else float(exp.last_state[0])
    return float(exp.state[0]), int(exp.action), float(exp.reward), last, exp.steps


def play(source, iterations):
    """Experiences of each of the first `iterations` steps, as tuples, and `frames` after each."""
    steps, frames = [], []
    # The range comes first: zip must not step the env once more.
    for _, exps in zip(range(iterations), source):
        steps.append([as_tuple(e) for e in exps])
        frames.append(source.frames)
    return steps, frames


# ---------------------------------------------------------------- ExperienceSourceFirstLast
def test_one_step_experiences_follow_the_script():
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(ScriptedEnv(3)), CountingAgent(), GAMMA, steps_count=1
    )
    steps, frames = play(source, 5)
    # one env: call k gives action 10 * k
    assert steps == [
        [(0.0, 0, 1.0, 1.0, 1)],
        [(1.0, 10, 10.0, 2.0, 1)],
        [(2.0, 20, 100.0, None, 1)],  # terminated: no last state
        [],  # autoreset step
        [(0.0, 40, 1.0, 1.0, 1)],  # next episode starts from the reset observation
    ]
    assert frames == [1, 2, 3, 3, 4]


def test_three_step_rewards_are_discounted_and_flushed_at_termination():
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(ScriptedEnv(5)), CountingAgent(), GAMMA, steps_count=3
    )
    steps, frames = play(source, 9)
    assert steps == [
        [],
        [],
        [(0.0, 0, 1 + 0.5 * 10 + 0.25 * 100, 3.0, 3)],  # 31
        [(1.0, 10, 10 + 0.5 * 100 + 0.25 * 1000, 4.0, 3)],  # 310
        # step 5 terminates: the three states still waiting are flushed with shorter windows
        [
            (2.0, 20, 100 + 0.5 * 1000 + 0.25 * 10000, None, 3),  # 3100
            (3.0, 30, 1000 + 0.5 * 10000, None, 2),  # 6000
            (4.0, 40, 10000.0, None, 1),
        ],
        [],  # autoreset step
        [],
        [],
        [(0.0, 60, 31.0, 3.0, 3)],  # new episode from the reset observation, with call 6's action
    ]
    assert frames == [1, 2, 3, 4, 5, 5, 6, 7, 8]


def test_truncation_flushes_with_the_real_final_observation():
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(ScriptedEnv(4, truncate=True)), CountingAgent(), GAMMA, steps_count=3
    )
    steps, _ = play(source, 4)
    assert steps == [
        [],
        [],
        [(0.0, 0, 31.0, 3.0, 3)],
        # step 4 truncates: flushed, each bootstrapping from the final observation [4]
        [
            (1.0, 10, 10 + 0.5 * 100 + 0.25 * 1000, 4.0, 3),  # 310
            (2.0, 20, 100 + 0.5 * 1000, 4.0, 2),  # 600
            (3.0, 30, 1000.0, 4.0, 1),
        ],
    ]


def test_episode_shorter_than_n_steps_is_flushed_whole():
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(ScriptedEnv(2, truncate=True)), CountingAgent(), GAMMA, steps_count=3
    )
    steps, _ = play(source, 2)
    assert steps == [[], [(0.0, 0, 1 + 0.5 * 10, 2.0, 2), (1.0, 10, 10.0, 2.0, 1)]]


def test_autoreset_step_yields_nothing_and_is_not_counted():
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(ScriptedEnv(2)), CountingAgent(), GAMMA, steps_count=1
    )
    steps, frames = play(source, 6)
    # calls 2 and 5 only reset the env: their actions (20, 50) appear nowhere
    assert steps == [
        [(0.0, 0, 1.0, 1.0, 1)],
        [(1.0, 10, 10.0, None, 1)],
        [],
        [(0.0, 30, 1.0, 1.0, 1)],
        [(1.0, 40, 10.0, None, 1)],
        [],
    ]
    assert frames == [1, 2, 2, 3, 4, 4]


def test_pop_episodes_returns_reward_and_steps_then_empties():
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(ScriptedEnv(3)), CountingAgent(), GAMMA, steps_count=3
    )
    it = iter(source)
    next(it), next(it)
    assert source.pop_episodes() == []  # mid-episode: nothing finished
    for _ in range(6):  # end of episode 1, reset, episode 2
        next(it)
    # undiscounted 1 + 10 + 100 in 3 steps, twice
    assert source.pop_episodes() == [(111.0, 3), (111.0, 3)]
    assert source.pop_episodes() == []


def test_two_envs_never_mix_experiences():
    short, long = ScriptedEnv(2), ScriptedEnv(4, offset=100)  # env 1's observations are 100 + t
    source = common.ExperienceSourceFirstLast(
        scripted_vec_env(short, long), CountingAgent(), GAMMA, steps_count=3
    )
    steps, frames = play(source, 7)
    # env 0: episodes at calls 0-1 and 3-4, resets at 2 and 5; env 1: episode at 0-3, reset at 4
    assert steps == [
        [],
        [(0.0, 0, 1 + 0.5 * 10, None, 2), (1.0, 10, 10.0, None, 1)],
        [(100.0, 1, 31.0, 103.0, 3)],
        [(101.0, 11, 310.0, None, 3), (102.0, 21, 600.0, None, 2), (103.0, 31, 1000.0, None, 1)],
        [(0.0, 30, 6.0, None, 2), (1.0, 40, 10.0, None, 1)],
        [],
        [],
    ]
    assert frames[-1] == 5 + 6  # env 0 stepped at calls 0, 1, 3, 4, 6; env 1 at 0, 1, 2, 3, 5, 6
    assert source.pop_episodes() == [(11.0, 2), (1111.0, 4), (11.0, 2)]


# ---------------------------------------------------------------- ReplayBuffer
FRAMES_SPACE = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
VECTOR_SPACE = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)


def vector_exp(value, last_state="next"):
    """Experience: state [value] * 4, action value, reward value / 2, last state [value + 1] * 4."""
    state = np.full(4, value, dtype=np.float32)
    last = state + 1 if last_state == "next" else last_state
    return common.ExperienceFirstLast(state, value, value / 2, last, 1)


@pytest.mark.parametrize(
    "space", [FRAMES_SPACE, VECTOR_SPACE], ids=["uint8-frames", "float32-vector"]
)
def test_replay_sample_shapes_and_dtypes(space):
    buffer = common.ReplayBuffer(8, space, seed=0)
    state = np.ones(space.shape, dtype=space.dtype)
    for _ in range(3):
        buffer.append(common.ExperienceFirstLast(state, 1, 1.0, state, 1))
    states, actions, rewards, dones, last_states = buffer.sample(5)
    assert (states.shape, states.dtype) == ((5, *space.shape), space.dtype)
    assert (last_states.shape, last_states.dtype) == ((5, *space.shape), space.dtype)
    assert (actions.shape, actions.dtype) == ((5,), np.int64)
    assert (rewards.shape, rewards.dtype) == ((5,), np.float32)
    assert (dones.shape, dones.dtype) == ((5,), np.bool_)


def test_replay_rebuilds_stacked_last_state_from_newest_frame():
    frames = np.random.default_rng(0).integers(0, 256, (7, 84, 84), dtype=np.uint8)
    buffer = common.ReplayBuffer(8, FRAMES_SPACE, seed=0)
    for i in range(3):  # a trajectory: state i is frames i..i+3, its last state frames i+1..i+4
        buffer.append(
            common.ExperienceFirstLast(frames[i : i + 4], i, 0.0, frames[i + 1 : i + 5], 1)
        )
    states, actions, _, dones, last_states = buffer.sample(16)
    assert set(actions) == {0, 1, 2}
    for state, action, last_state in zip(states, actions, last_states):
        np.testing.assert_array_equal(state, frames[action : action + 4])
        np.testing.assert_array_equal(last_state, frames[action + 1 : action + 5])
    assert not dones.any()


def test_replay_terminal_vector_experience_is_done_with_zero_last_state():
    buffer = common.ReplayBuffer(1, VECTOR_SPACE, seed=0)
    buffer.append(vector_exp(2.0))  # its last state [3, 3, 3, 3] must not survive
    buffer.append(vector_exp(3.0, last_state=None))  # overwrites the only slot
    _, _, _, dones, last_states = buffer.sample(2)
    assert dones.tolist() == [True, True]
    np.testing.assert_array_equal(last_states, np.zeros((2, 4), dtype=np.float32))


def test_replay_terminal_stacked_experience_is_done_with_zero_newest_frame():
    # only the newest frame is stored, so the rebuilt last state is state[1:] + a zero frame;
    # harmless, since dones masks it out of the target
    state = np.arange(1, 5, dtype=np.uint8)[:, None, None].repeat(84, 1).repeat(84, 2)
    buffer = common.ReplayBuffer(4, FRAMES_SPACE, seed=0)
    buffer.append(common.ExperienceFirstLast(state, 0, 1.0, None, 1))
    _, _, _, dones, last_states = buffer.sample(1)
    assert dones.tolist() == [True]
    np.testing.assert_array_equal(last_states[0, :3], state[1:])
    np.testing.assert_array_equal(last_states[0, 3], np.zeros((84, 84), dtype=np.uint8))


def test_replay_overwrites_oldest_when_over_capacity():
    buffer = common.ReplayBuffer(3, VECTOR_SPACE, seed=0)
    for value in range(1, 6):  # 1, 2, 3, then 4 and 5 replace 1 and 2
        buffer.append(vector_exp(float(value)))
    assert len(buffer) == 3
    states, actions, rewards, dones, last_states = buffer.sample(200)
    assert set(actions) == {3, 4, 5}
    np.testing.assert_array_equal(states, np.repeat(actions[:, None], 4, axis=1).astype(np.float32))
    np.testing.assert_array_equal(rewards, actions / 2)
    np.testing.assert_array_equal(last_states, states + 1)
    assert not dones.any()


def test_replay_samples_only_filled_slots():
    buffer = common.ReplayBuffer(10, VECTOR_SPACE, seed=0)
    assert len(buffer) == 0
    buffer.append(vector_exp(1.0))
    buffer.append(vector_exp(2.0))
    assert len(buffer) == 2
    states, actions, _, _, _ = buffer.sample(200)
    assert set(actions) == {1, 2}  # an empty slot would give action 0
    assert set(states[:, 0]) == {1.0, 2.0}


class ArraysReplayBuffer:
    """The replay buffer before frames were stored once, the reference that ReplayBuffer's batches
    must equal byte for byte: each transition's whole state and its next state's newest frame."""

    def __init__(self, capacity, obs_space, seed=None):
        self.capacity, self.size, self.pos = capacity, 0, 0
        shape, dtype = obs_space.shape, obs_space.dtype
        self.stacked = len(shape) == 3
        self.states = np.zeros((capacity, *shape), dtype=dtype)
        self.last_states = np.zeros(
            (capacity, *(shape[1:] if self.stacked else shape)), dtype=dtype
        )
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=bool)
        self.rng = np.random.default_rng(seed)

    def append(self, exp):
        i = self.pos
        self.states[i], self.actions[i], self.rewards[i] = exp.state, exp.action, exp.reward
        self.dones[i] = exp.last_state is None
        if exp.last_state is None:
            self.last_states[i] = 0
        else:
            self.last_states[i] = exp.last_state[-1] if self.stacked else exp.last_state
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size):
        idx = self.rng.integers(0, self.size, batch_size)
        states = self.states[idx]
        last_states = self.last_states[idx]
        if self.stacked:
            last_states = np.concatenate([states[:, 1:], last_states[:, None]], axis=1)
        return states, self.actions[idx], self.rewards[idx], self.dones[idx], last_states


class Palette(gym.Env):
    """Observations (frames of 6 x 6 bytes, or 3-vectors) drawn from a palette of `colors` fixed
    ones: few, and unrelated states share frames too; an episode terminates with probability 0.1 a
    step, or is truncated at its 12th."""

    action_space = gym.spaces.Discrete(3)

    def __init__(self, frames, colors):
        shape, dtype = ((6, 6), np.uint8) if frames else ((3,), np.float32)
        self.observation_space = gym.spaces.Box(0, 255, shape, dtype)
        self.palette = np.random.default_rng(7).integers(0, 256, (colors, *shape)).astype(dtype)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self.palette[self.np_random.integers(len(self.palette))], {}

    def step(self, action):
        self.steps += 1
        return (
            self.palette[self.np_random.integers(len(self.palette))],
            float(action),
            bool(self.np_random.random() < 0.1),
            self.steps == 12,
            {},
        )


def palette_steps(frames, colors, steps, envs=3):
    """Each step's one-step experiences of envs Palette envs (frames stacked by 4, zero-padded, as
    on Atari), and the lengths of the episodes that ended."""

    def make():
        env = Palette(frames, colors)
        return gym.wrappers.FrameStackObservation(env, 4, padding_type="zero") if frames else env

    env = gym.vector.SyncVectorEnv([make] * envs)
    rng = np.random.default_rng(0)
    source = common.ExperienceSourceFirstLast(
        env, lambda obs: rng.integers(3, size=envs), GAMMA, seed=0
    )
    played = [exps for _, exps in zip(range(steps), source)]
    return played, env.single_observation_space, [length for _, length in source.pop_episodes()]


def assert_frames_indexed(buffer):
    """Each slot's count of uses is the rows' pointing at it (slot 0 one more: never freed), free
    slots are those unused, and the store keeps each frame once."""
    index = buffer.index
    expected = np.bincount(index.rows.ravel(), minlength=len(index.uses))
    expected[0] += 1
    assert np.array_equal(index.uses, expected)
    assert sorted(index.free) == [
        slot for slot in range(1, len(index.uses)) if not index.uses[slot]
    ]
    used = np.flatnonzero(index.uses)
    assert len({buffer.frames[slot].tobytes() for slot in used}) == len(used)


@pytest.mark.parametrize("colors", [30, 10**6], ids=["shared", "distinct"])
@pytest.mark.parametrize("frames", [True, False], ids=["stacked-frames", "vectors"])
def test_replay_batches_match_the_arrays_buffer_byte_for_byte_through_ends_truncations_and_wraps(
    frames, colors
):
    steps, space, lengths = palette_steps(frames, colors, 400)
    buffer, reference = (
        common.ReplayBuffer(40, space, seed=3),
        ArraysReplayBuffer(40, space, seed=3),
    )
    for step, exps in enumerate(steps):
        for exp in exps:
            buffer.append(exp)
            reference.append(exp)
        if len(buffer):
            for got, expected in zip(buffer.sample(9), reference.sample(9)):
                assert got.dtype == expected.dtype and np.array_equal(got, expected)
        if step % 25 == 0:
            assert_frames_indexed(buffer)
    # The run had wraps, truncations and ends.
    assert sum(lengths) > 20 * 40 and lengths.count(12) > 20 and min(lengths) < 5
    # Live slots are at most a frame a transition, the envs' ends and zeros.
    live = np.count_nonzero(buffer.index.uses)
    assert live <= 31 if colors == 30 else 40 < live <= 40 + 40 // 12 + 4 * 3 + 1


# ---------------------------------------------------------------- batch unpacking
def test_unpack_batch_dqn_keeps_values_and_dtypes():
    batch = (
        np.arange(2 * 4 * 3 * 3, dtype=np.uint8).reshape(2, 4, 3, 3),
        np.array([3, 0], dtype=np.int64),
        np.array([1.5, -1.0], dtype=np.float32),
        np.array([False, True]),
        np.arange(2 * 4 * 3 * 3, dtype=np.uint8).reshape(2, 4, 3, 3)[::-1].copy(),
    )
    tensors = common.unpack_batch_dqn(batch, torch.device("cpu"))
    assert len(tensors) == 5
    for tensor, array in zip(tensors, batch):
        assert tensor.device == torch.device("cpu")
        assert tensor.dtype == torch.from_numpy(array).dtype
        np.testing.assert_array_equal(tensor.numpy(), array)
    assert [t.dtype for t in tensors] == [
        torch.uint8,
        torch.int64,
        torch.float32,
        torch.bool,
        torch.uint8,
    ]


class SumValueNet(nn.Module):
    """Stub actor-critic: zero logits, value = sum of the state (times a parameter, 1)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.zeros(len(x), 2, device=x.device), self.scale * x.sum(dim=1)


@pytest.mark.parametrize("net_device", DEVICES)
def test_unpack_batch_a2c_bootstraps_only_alive_experiences(net_device):
    exps = [
        common.ExperienceFirstLast(
            np.array([1, 0], np.float32), 1, 1.0, np.array([1, 2], np.float32), 1
        ),
        common.ExperienceFirstLast(np.array([0, 1], np.float32), 0, 2.0, None, 2),
        common.ExperienceFirstLast(
            np.array([2, 2], np.float32), 1, 0.5, np.array([4, 4], np.float32), 3
        ),
    ]
    # The net values the last states where it is; the batch goes where it is asked (a3c_data's
    # workers: the CPU).
    net = SumValueNet().to(net_device)
    states, actions, ref_vals = common.unpack_batch_a2c(exps, net, torch.device("cpu"), GAMMA)
    assert states.device == actions.device == torch.device("cpu")
    np.testing.assert_array_equal(states.numpy(), [[1, 0], [0, 1], [2, 2]])
    assert states.dtype == torch.float32
    assert actions.tolist() == [1, 0, 1] and actions.dtype == torch.int64
    # The references are 1 + 0.5 * V([1, 2]) = 1 + 0.5 * 3 = 2.5; terminated, 2;
    # and 0.5 + 0.5 ** 3 * V([4, 4]) = 0.5 + 1 = 1.5.
    assert ref_vals.tolist() == [2.5, 2.0, 1.5]
    assert ref_vals.dtype == torch.float32 and ref_vals.device == torch.device("cpu")


def test_unpack_batch_a2c_all_terminated_needs_no_net():
    exps = [common.ExperienceFirstLast(np.zeros(2, np.float32), 0, 3.0, None, 1)]
    _, _, ref_vals = common.unpack_batch_a2c(exps, None, torch.device("cpu"), GAMMA)
    assert ref_vals.tolist() == [3.0]


# ---------------------------------------------------------------- Atari pipelines
def test_classic_and_fast_atari_pipelines_give_identical_observations():
    classic = common.make_python_env("pong", 1, noop_max=0)
    fast = common.make_fast_env("pong", 1, threads=1, noop_max=0)
    try:
        obs_classic, _ = classic.reset(seed=42)
        obs_fast, _ = fast.reset(seed=42)
        assert obs_classic.shape == obs_fast.shape == (1, 4, 84, 84)
        assert obs_classic.dtype == obs_fast.dtype == np.uint8
        assert np.array_equal(obs_classic, obs_fast)
        rng = np.random.default_rng(0)
        for step in range(300):
            actions = rng.integers(0, classic.single_action_space.n, 1)
            out_classic, out_fast = classic.step(actions), fast.step(actions)
            for name, a, b in zip(
                ["obs", "reward", "terminated", "truncated"], out_classic, out_fast
            ):
                assert np.array_equal(a, b), f"{name} differs at step {step}"
    finally:
        classic.close()
        fast.close()


def test_the_fast_pipelines_emulator_threads_change_no_observation_reward_or_episode_start():
    one, two = (
        common.make_fast_env("pong", 4, threads=1),
        common.make_fast_env("pong", 4, threads=2),
    )
    try:
        assert np.array_equal(one.reset(seed=3)[0], two.reset(seed=3)[0])
        rng = np.random.default_rng(0)
        for step in range(100):
            actions = rng.integers(0, one.single_action_space.n, 4)
            for name, a, b in zip(
                ["obs", "reward", "terminated", "truncated"], one.step(actions), two.step(actions)
            ):
                assert np.array_equal(a, b), f"{name} differs at step {step}"
        # New episodes: each env draws its own no-ops, on whichever thread runs it.
        for _ in range(3):
            (obs_one, info_one), (obs_two, info_two) = one.reset(), two.reset()
            assert np.array_equal(obs_one, obs_two)
            assert np.array_equal(
                info_one["episode_frame_number"], info_two["episode_frame_number"]
            )
    finally:
        one.close()
        two.close()


def test_cores_per_process_shares_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [common.cores_per_process(n) for n in [1, 4, 5, 15, 16, 32]] == [16, 4, 3, 1, 1, 1]
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS and Windows have none
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [common.cores_per_process(n) for n in [1, 4, 9]] == [8, 2, 1]


@pytest.mark.slow
def test_classic_and_fast_atari_pipelines_start_episodes_alike():
    # frames played before the first observation: FIRE, then 0 to 28 no-ops, 0 twice as likely
    classic = common.make_python_env("pong", 1)
    fast = common.make_fast_env("pong", 1, threads=1)
    counts = {"classic": collections.Counter(), "fast": collections.Counter()}
    try:
        classic.reset(seed=0)
        fast.reset(seed=0)
        for _ in range(600):
            classic.reset()
            counts["classic"][classic.envs[0].unwrapped.ale.getEpisodeFrameNumber()] += 1
            counts["fast"][int(fast.reset()[1]["episode_frame_number"][0])] += 1
    finally:
        classic.close()
        fast.close()
    for name, count in counts.items():
        assert set(count) == set(range(1, 30)), name
        # expected: 600 * 2 / 30 = 40 games with no no-op, 20 with each other count. A uniform draw
        # over the 29 gives each about 21, a ratio near 1 (standard deviation 0.23): it fails 1.5
        others = [count[frames] for frames in range(2, 30)]
        assert count[1] / np.mean(others) >= 1.5, (name, count[1], np.mean(others))


class GameOfThreeFrames(gym.Env):
    """A game ending on its third frame; it counts its resets and frames and keeps the actions."""

    observation_space = gym.spaces.Discrete(4)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.resets, self.frames, self.played = 0, 0, []

    def get_action_meanings(self):
        return ["NOOP", "FIRE"]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets, self.frames = self.resets + 1, 0
        return 0, {}

    def step(self, action):
        self.frames += 1
        self.played.append(action)
        return self.frames, 0.0, self.frames == 3, False, {}


def test_a_game_that_ends_during_the_no_ops_is_reset_and_never_returned_ended():
    game = GameOfThreeFrames()
    env = common.FireAndNoopsOnReset(game, noop_max=30)
    played = []
    for seed in range(40):
        game.resets, game.played = 0, []
        obs, _ = env.reset(seed=seed)
        frames = len(game.played)  # FIRE, then the no-ops drawn
        assert game.played == [1] + [0] * (frames - 1)
        assert game.resets == 1 + frames // 3  # a new game each time one ended
        assert obs == frames % 3 != 3
        played.append(frames)
    assert max(played) >= 6  # some ended during the no-ops, twice over


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads Linux's /proc/cpuinfo")
def test_bf16_native_on_the_cpu_is_what_the_kernel_says_of_it():
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith(("flags", "Features")):  # x86, arm64
                flags |= set(line.partition(":")[2].split())
    assert runs.bf16_native(cuda=False) == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def test_bf16_on_a_gpu_that_emulates_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(sys, "argv", ["dqn_fast.py", "--cuda", "--bf16"])
    monkeypatch.delenv("RANK", raising=False)
    args, _, _ = runs.setup(runs.argument_parser("test"), {"pong": {}})
    assert args.cuda
    assert our_lines(capsys.readouterr().err) == [
        "dqn_fast.py: warning: --bf16 is emulated on this GPU: it may run slower than fp32"
    ]


@pytest.fixture
def threads_unchosen(monkeypatch):
    """OMP_NUM_THREADS unset, as in a user's shell, on a 2-core CPU; torch's threads given back
    after the test."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(common, "cores_per_process", lambda processes: 2 // processes)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "env, torch_threads, threads", [("cartpole", 4, 1), ("pong", 4, 2), ("pong", 1, 1)]
)
def test_cartpole_trains_on_one_thread_pong_on_the_cores_it_may_use_or_torchs_fewer(
    env, torch_threads, threads, threads_unchosen
):
    torch.set_num_threads(torch_threads)  # as torch counts a machine's cores
    runs.set_torch_threads(types.SimpleNamespace(env=env))
    assert torch.get_num_threads() == threads


@pytest.fixture
def core_clock(monkeypatch):
    """The wall clock and the main thread's core times (run, waited) as a test sets them."""
    clock = types.SimpleNamespace(seconds=100.0, ran=0.0, waited=0.0)
    monkeypatch.setattr(time, "perf_counter", lambda: clock.seconds)
    monkeypatch.setattr(runs, "core_times", lambda: (clock.ran, clock.waited))
    return clock


def test_a_run_whose_main_thread_waits_for_a_core_goes_on_with_one_thread_and_says_so_once(
    threads_unchosen, core_clock, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(2)
    threads = []
    with a_run(fake_args()) as (tracker, run):  # entered at 100 s
        # 5 s and 12 s into the loop: too soon, then the first reading, whatever was waited.
        # 9 s later: too soon; 10 s: 1.6 s waited of 6.6 wanted; 10 s: 2.1 of 8.1 (over a
        # quarter); 10 s: one thread already.
        for seconds, ran, waited in [
            (5, 2, 3),
            (7, 2, 3),
            (9, 4, 1.5),
            (1, 1, 0.1),
            (10, 6, 2.1),
            (10, 1, 9),
        ]:
            core_clock.seconds += seconds
            core_clock.ran += ran
            core_clock.waited += waited
            run.share_busy_cores()
            threads.append(torch.get_num_threads())
    assert threads == [2, 2, 2, 2, 1, 1]
    assert our_lines(capsys.readouterr().err) == [
        "test.py: warning: another process shares these cores (the main thread waited for one 26% "
        "of the time it wanted one over 10 s): torch goes on with 1 thread, not 2; a --resume on a "
        "free CPU takes them again"
    ]


@pytest.mark.parametrize("cuda", [False, True])
def test_a_user_who_chose_the_threads_keeps_them_and_a_gpu_run_its_own(
    cuda, threads_unchosen, core_clock, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    if not cuda:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    runs.set_torch_threads(types.SimpleNamespace(env="cartpole"))
    assert torch.get_num_threads() == (2 if not cuda else 1)
    torch.set_num_threads(2)
    args = fake_args()
    args.cuda = cuda
    with a_run(args) as (tracker, run):
        for _ in range(3):
            core_clock.seconds += 10
            core_clock.ran += 1
            core_clock.waited += 9
            run.share_busy_cores()
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""


def test_core_times_are_the_kernels_first_two_schedstat_counts_and_none_where_it_has_none(
    monkeypatch,
):
    monkeypatch.setattr(runs, "open", lambda path: io.StringIO("3000000000 2500000000 7\n"), False)
    assert runs.core_times() == (3.0, 2.5)

    def absent(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(runs, "open", absent, False)
    assert runs.core_times() == (0.0, 0.0)


@pytest.mark.parametrize("text, minutes", [("0", 0.0), ("0.5", 0.5), ("10", 10.0), ("1e3", 1000.0)])
def test_checkpoint_minutes_takes_any_number_of_minutes(text, minutes):
    assert (
        runs.argument_parser("test").parse_args(["--checkpoint-minutes", text]).checkpoint_minutes
        == minutes
    )


# ---------------------------------------------------------------- RewardTracker and Run
PARAMS = types.SimpleNamespace(gamma=0.99)  # a run's hyperparameters


def fake_args(max_frames=None, checkpoint_minutes=0):
    return types.SimpleNamespace(
        script="test",
        env="pong",
        name="unit",
        max_frames=max_frames,
        bf16=False,
        resume=None,
        checkpoint_minutes=checkpoint_minutes,
        cuda=False,
        seed=0,
        segment=0,
        folder=os.path.join("runs", "test-pong-unit"),
    )


def fake_env():
    return types.SimpleNamespace(
        single_observation_space=gym.spaces.Box(0, 1, (2,)),
        single_action_space=gym.spaces.Discrete(3),
    )


@contextlib.contextmanager
def a_run(args, net=None):
    """A script's run in short: its tracker, the Run around its loop, net all a checkpoint holds."""
    net = net or nn.Linear(2, 1)
    tracker = runs.RewardTracker(args, net, fake_env())
    with runs.Run(args, PARAMS, tracker, dict(net=net, tracker=tracker)) as run:
        yield tracker, run


def update(tracker, run, frames, episodes):
    """A loop's step: the tracker records; the run checkpoints when due and says whether to stop."""
    tracker.update(frames, episodes)
    run.save_checkpoint_if_due()
    return run.should_stop()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_is_taken_at_the_next_check_with_its_exit_code_and_a_checkpoint(
    signum, code, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs, "stop_signal", None)
    with a_run(fake_args(checkpoint_minutes=10)) as (tracker, run):
        assert not update(tracker, run, 10, [])
        runs.request_stop(signum, None)  # the handler only asks: the step in progress goes on
        runs.request_stop(signal.SIGINT, None)  # a second signal changes nothing
        assert update(tracker, run, 20, [(-21.0, 900)])
    assert (
        run.exit_code == code
        and json.loads(capsys.readouterr().out.splitlines()[-1])["frames"] == 20
    )
    checkpoint = torch.load(os.path.join(tracker.args.folder, runs.CHECKPOINT), weights_only=True)
    assert checkpoint["tracker"]["frames"] == 20 and checkpoint["tracker"]["rewards"] == [-21.0]


def test_a_run_that_records_nothing_writes_nothing_and_ends_with_its_own_line_and_code(
    tmp_path, monkeypatch, capsys
):
    # This is a3c_dist's Run on a rank other than 0.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs, "stop_signal", None)
    args = fake_args(checkpoint_minutes=10)
    tracker = runs.RewardTracker(args, nn.Linear(2, 1), fake_env())
    with runs.Run(args, PARAMS, tracker, dict(tracker=tracker), records=False) as run:
        raise runs.ProcessLost("rank 1 lost a rank: Connection reset by peer")
    assert run.exit_code == 1 and capsys.readouterr() == (
        "",
        "test.py: error: rank 1 lost a rank: Connection reset by peer\n",
    )
    with runs.Run(args, PARAMS, tracker, dict(tracker=tracker), records=False) as run:
        runs.request_stop(signal.SIGTERM, None)
    assert run.exit_code == 143 and capsys.readouterr() == ("", "") and not os.path.exists("runs")
    with pytest.raises(OSError):  # a write it never makes: a bug, with its traceback
        with runs.Run(args, PARAMS, tracker, dict(tracker=tracker), records=False):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x")


@pytest.mark.parametrize("stop", [None, signal.SIGTERM], ids=["end", "sigterm"])
def test_checkpoint_minutes_0_leaves_no_checkpoint_also_at_a_stop(stop, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with a_run(fake_args(checkpoint_minutes=0)) as (tracker, run):
        update(tracker, run, 100, [(1.0, 10)])
        monkeypatch.setattr(runs, "stop_signal", stop)
        assert update(tracker, run, 200, [(2.0, 10)]) == (stop is not None)
    assert run.exit_code == (143 if stop else 0)
    assert sorted(os.listdir(tracker.args.folder))[0] == "best.pt"
    assert not os.path.exists(os.path.join(tracker.args.folder, runs.CHECKPOINT))


def test_tracker_solved_only_after_100_episodes_at_stop_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with a_run(fake_args()) as (tracker, run):
        assert not update(tracker, run, 10, [(21.0, 100)] * 99)  # mean 21 but only 99 episodes
        assert not tracker.solved
        assert update(tracker, run, 20, [(21.0, 100)])  # the 100th
        assert tracker.solved and len(tracker.rewards) == 100


def test_tracker_solved_at_mean_exactly_stop_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with a_run(fake_args()) as (tracker, run):
        assert not update(tracker, run, 10, [(17.0, 100)] * 100)  # 100 episodes, mean 17 < 18
        # 50 more at 19: the window holds 50 at 17 and 50 at 19, mean 18.0
        assert not update(tracker, run, 20, [(19.0, 100)] * 49)
        assert update(tracker, run, 30, [(19.0, 100)])


def test_tracker_solved_is_not_lost_within_one_update(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with a_run(fake_args()) as (tracker, run):
        tracker.update(1, [(18.0, 1)] * 99)
        # the 100th episode solves it; the one after would drop the mean below 18 again
        assert update(tracker, run, 2, [(18.0, 1), (-21.0, 1)])
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["solved"] and summary["episodes"] == 100 and summary["mean_reward"] == 18.0


def test_tracker_prints_one_line_an_update_however_many_episodes_end_in_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    # 2 s pass between any two readings of the clock: every update may print.
    ticks = itertools.count(0.0, 2.0)
    monkeypatch.setattr(runs.time, "perf_counter", lambda: next(ticks))
    with a_run(fake_args()) as (tracker, run):
        tracker.update(100, [(18.0, 1)] * 98)
        # Two episodes in one update, the second solving: each was once a line, the second's speed
        # over 0 s.
        assert update(tracker, run, 300, [(18.0, 1), (18.0, 1)])
    lines = [line for line in capsys.readouterr().out.splitlines() if " games, " in line]
    assert lines == [
        "100: done 98 games, mean reward 18.000, speed 50.0 f/s",
        "300: done 100 games, mean reward 18.000, speed 100.0 f/s",
    ]


def test_run_stops_at_max_frames(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with a_run(fake_args(max_frames=1000)) as (tracker, run):
        assert not update(tracker, run, 999, [])
        assert update(tracker, run, 1000, [])
    with a_run(fake_args()) as (tracker, run):
        assert not update(tracker, run, 10**9, [])  # no limit


def test_save_whole_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "best.pt")
    for value in (1, 2):
        runs.save_whole({"value": value}, path)
        assert torch.load(path) == {"value": value}
    assert os.listdir(tmp_path) == ["best.pt"]


def test_save_whole_that_fails_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = str(tmp_path / "best.pt")
    runs.save_whole({"value": 1}, path)
    # Pickle refuses a local lambda: AttributeError up to Python 3.13, PicklingError from 3.14 on.
    with pytest.raises((AttributeError, pickle.PicklingError)):
        runs.save_whole({"value": 2, "not saveable": lambda: None}, path)
    assert torch.load(path) == {"value": 1} and os.listdir(tmp_path) == ["best.pt"]


# writes best.pt whole, then starts a second write that stalls in the middle, and says so
STALLED_WRITE = """
import sys, time
sys.path.insert(0, sys.argv[2])
import runs
class Stall:
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(60)
runs.save_whole({"value": 1}, sys.argv[1])
runs.save_whole({"value": 2, "stall": Stall()}, sys.argv[1])
"""


def test_save_whole_killed_in_the_middle_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "best.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_WRITE, str(path), REPO],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "writing\n"
    assert (tmp_path / "best.pt.tmp").exists()  # the new file is under way
    proc.kill()
    proc.wait()
    assert torch.load(path) == {"value": 1}


def test_tracker_saves_best_model_when_a_new_best_mean_appears(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net = nn.Linear(2, 1)
    with a_run(fake_args(), net) as (tracker, run):
        best_path = tmp_path / tracker.args.folder / "best.pt"
        tracker.update(10, [(-20.0, 1)] * 99)
        assert not best_path.exists()  # no full window yet
        tracker.update(20, [(-20.0, 1)])
        first = {k: v.clone() for k, v in net.state_dict().items()}
        assert torch.equal(torch.load(best_path)["state_dict"]["weight"], first["weight"])
        with torch.no_grad():
            net.weight += 1
        tracker.update(30, [(-21.0, 1)])  # a worse mean: best.pt stays
        assert torch.equal(torch.load(best_path)["state_dict"]["weight"], first["weight"])
        tracker.update(40, [(21.0, 1)])  # a better one: best.pt follows the net
        assert torch.equal(torch.load(best_path)["state_dict"]["weight"], net.weight)


def test_tracker_logs_the_first_and_every_log_every_th_training_step_reading_tensors_then(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with a_run(fake_args()) as (tracker, run):
        for step in range(1, 2 * runs.LOG_EVERY + 2):
            tracker.update(10 * step, [])
            tracker.record_step(loss=torch.tensor(float(step)), epsilon=0.5)
    events = EventAccumulator(str(tmp_path / tracker.args.folder))
    events.Reload()
    logged = [1, runs.LOG_EVERY + 1, 2 * runs.LOG_EVERY + 1]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (10 * s, s) for s in logged
    ]
    assert [e.value for e in events.Scalars("train/epsilon")] == [0.5] * 3
    assert tracker.steps == 2 * runs.LOG_EVERY + 1


def test_tracker_writes_scalars_and_best_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs, "LOG_EVERY", 1)
    net = nn.Linear(2, 1)
    with a_run(fake_args(), net) as (tracker, run):
        tracker.update(100, [(-21.0, 800)])
        tracker.record_step(loss=0.5)
        tracker.update(200, [(-19.0, 900)])
        tracker.record_step(loss=1.5)
    log_dir = tmp_path / tracker.args.folder

    events = EventAccumulator(str(log_dir))
    events.Reload()

    def scalars(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("episodes/reward") == [(100, -21.0), (200, -19.0)]
    assert scalars("episodes/avg_reward") == [(100, -21.0), (200, -20.0)]
    assert scalars("episodes/steps") == [(100, 800.0), (200, 900.0)]
    assert scalars("train/loss") == [(100, 0.5), (200, 1.5)]

    best = torch.load(log_dir / "best.pt")
    assert {
        k: best[k] for k in ("script", "env", "obs_shape", "n_actions", "frames", "mean_reward")
    } == {
        "script": "test",
        "env": "pong",
        "obs_shape": (2,),
        "n_actions": 3,
        "frames": 200,
        "mean_reward": -20.0,
    }
    assert best["state_dict"].keys() == net.state_dict().keys()
    for name, tensor in net.state_dict().items():
        assert torch.equal(best["state_dict"][name], tensor)

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["episodes"] == 2 and summary["frames"] == 200
    assert summary["mean_reward"] == -20.0 and summary["solved"] is False


# ---------------------------------------------------------------- NetworkHealth
def buffer_of(states):
    """A replay buffer holding one transition from each of these vector states."""
    buffer = common.ReplayBuffer(len(states), gym.spaces.Box(-np.inf, np.inf, (2,), np.float32))
    for state in states:
        buffer.append(common.ExperienceFirstLast(np.array(state, np.float32), 0, 0.0, None, 1))
    return buffer


def test_health_counts_dead_units_active_outputs_and_the_q_spread_worked_out_by_hand():
    # Unit 1 is x, unit 2 is y, unit 3 is -x - y; on the states (1, 1) and (2, -1) unit 1 fires on
    # both, unit 2 on the first, unit 3 on neither: 1 of 3 units dead, 3 of 6 outputs above zero.
    # The output copies units 1 and 2: Q-values (1, 1) and (2, 0), each action's spread 0.5 (the
    # population standard deviation).
    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        net[2].weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
        net[0].bias.zero_()
        net[2].bias.zero_()
    health = common.NetworkHealth(net, buffer_of([(1, 1), (2, -1)]))
    assert health.measure() == pytest.approx(
        {"relu1/dead_units": 1 / 3, "relu1/active": 0.5, "q_spread": 0.5}
    )


def test_health_keeps_the_states_it_first_took_and_reads_a_convolutions_channel_as_one_unit():
    # Channel 1 fires at one pixel of one state, channel 2 nowhere: half the channels dead, 1 of
    # 2 * 2 * 4 outputs above zero; a buffer filled with other states afterwards changes nothing.
    conv = nn.Conv2d(1, 2, kernel_size=1)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, -1.0]).view(2, 1, 1, 1))
        conv.bias.zero_()
    net = nn.Sequential(nn.Unflatten(1, (1, 1, 2)), conv, nn.ReLU(), nn.Flatten(), nn.Linear(4, 1))
    buffer = buffer_of([(0, 3), (0, 0)])
    health = common.NetworkHealth(net, buffer)
    expected = {"relu1/dead_units": 0.5, "relu1/active": 1 / 8}
    assert {
        name: value for name, value in health.measure().items() if name != "q_spread"
    } == expected
    buffer.append(common.ExperienceFirstLast(np.array([5, 5], np.float32), 0, 0.0, None, 1))
    assert {
        name: value for name, value in health.measure().items() if name != "q_spread"
    } == expected


@pytest.fixture(scope="module")
def pong_buffer():
    """A replay buffer of 300 transitions of random play on Pong."""
    env = common.make_python_env("pong")
    buffer = common.ReplayBuffer(300, env.single_observation_space)
    env.action_space.seed(0)
    exp_source = common.ExperienceSourceFirstLast(
        env, lambda obs: env.action_space.sample(), 0.99, seed=0
    )
    for exps in exp_source:
        for exp in exps:
            buffer.append(exp)
        if len(buffer) == 300:
            return buffer


def health_warnings(net, buffer, tmp_path, monkeypatch, capsys):
    """What a run's tracker says of this net's health, measured twice on the buffer."""
    monkeypatch.chdir(tmp_path)
    health = common.NetworkHealth(net, buffer)
    with a_run(fake_args()) as (tracker, run):
        tracker.record_health(health.measure())
        tracker.record_health(health.measure())
    return [line for line in capsys.readouterr().err.splitlines() if "dead" in line]


def test_a_network_whose_first_layer_fires_on_no_state_is_told_once(
    pong_buffer, tmp_path, monkeypatch, capsys
):
    import dqn_baseline

    net = dqn_baseline.DQN((4, 84, 84), 6)
    with torch.no_grad():
        net.body[0].bias.fill_(-100.0)
    warnings = health_warnings(net, pong_buffer, tmp_path, monkeypatch, capsys)
    assert len(warnings) == 1 and "relu1 " in warnings[0] and "--seed" in warnings[0]


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "solved-best.pt"])
def test_a_fresh_and_a_solved_pong_network_are_alive(
    trained, pong_buffer, tmp_path, monkeypatch, capsys
):
    import dqn_fast

    net = dqn_fast.DQN((4, 84, 84), 6)
    if trained:  # the fp32 run of docs/RESULTS.md that solved Pong
        best = os.path.join(
            os.path.dirname(__file__), "..", "docs", "runs", "dqn_fast-pong-20261203-052811"
        )
        net.load_state_dict(
            torch.load(os.path.join(best, "best.pt"), weights_only=True)["state_dict"]
        )
    assert health_warnings(net, pong_buffer, tmp_path, monkeypatch, capsys) == []


# ---------------------------------------------------------------- shared memory
PARSER = runs.ArgumentParser(prog="test")
SHARED_DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def test_share_memory_refuses_more_than_dev_shm_holds_with_one_line(fake_shm_free, capsys):
    fake_shm_free(40 * 2**20)
    tensors = [torch.zeros(2**20) for _ in range(11)]  # 11 x 4 MiB = 46.1 MB
    with pytest.raises(SystemExit) as exit_info:
        processes.share_memory(PARSER, *tensors)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "test: error: shared memory is short: this run shares 46.1 MB and /dev/shm has 41.9 MB "
        "free; in Docker, give the container more with docker run --shm-size=128m\n"
    )
    assert not any(t.is_shared() for t in tensors)  # nothing moved: all or none


def test_share_memory_takes_what_just_fits_with_no_margin(fake_shm_free):
    # no margin: Docker's 64 MiB must hold a3c_grad's default, 5 x 13.2 MB = 65.9 MB of 67.1
    fake_shm_free(4 * 2**20)
    tensors = [torch.zeros(2**20 // 4) for _ in range(4)]  # 4 MiB exactly
    processes.share_memory(PARSER, *tensors)
    assert all(t.is_shared() for t in tensors)


def test_share_memory_turns_torchs_failure_into_one_line(monkeypatch, capsys):
    # Where no room is counted first (macOS, Windows), or miscounted, torch's failure is caught.
    weights = processes.SharedWeights(nn.Linear(1000, 1000))
    isdir = os.path.isdir
    # There is no /dev/shm, as on macOS.
    monkeypatch.setattr(os.path, "isdir", lambda path: path != "/dev/shm" and isdir(path))

    def no_room(self):
        raise RuntimeError(
            "unable to allocate shared memory(shm) for file </torch_1_2_3>: "
            "No space left on device (28)"
        )

    monkeypatch.setattr(torch.Tensor, "share_memory_", no_room)
    with pytest.raises(SystemExit) as exit_info:
        processes.share_memory(PARSER, weights)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "test: error: shared memory is short: this run shares 4.0 MB and the system could not "
        "give it (unable to allocate shared memory(shm) for file </torch_1_2_3>: "
        "No space left on device (28)); in Docker, give the container more with "
        "docker run --shm-size=8m\n"
    )


def report_net(net, *, send):
    """Child process: send the values of the network it was given, again and again."""
    while True:
        send([param.detach().clone() for param in net.parameters()])
        time.sleep(0.05)


def test_a_shared_network_is_the_one_a_child_acts_with_and_counts_against_dev_shm(
    fake_shm_free, capsys
):
    # the CPU path of dqn_mp and the A3C scripts: the child gets the main process's net itself
    fake_shm_free(3 * 2**20)
    with pytest.raises(SystemExit):
        processes.share_memory(PARSER, nn.Linear(1000, 1000))  # 4,004,000 bytes of parameters
    assert "this run shares 4.0 MB and /dev/shm has 3.1 MB free" in capsys.readouterr().err
    learner = nn.Linear(3, 2)
    processes.share_memory(PARSER, learner)
    assert all(param.is_shared() for param in learner.parameters())
    with processes.ChildProcesses(report_net, {"child": (learner,)}) as reports:
        for count, params in enumerate(reports):
            if count == 0:
                assert all(
                    torch.equal(value, param) for value, param in zip(params, learner.parameters())
                )
                with torch.no_grad():
                    learner.weight += 1  # an optimizer step, in place: no publish
            elif torch.equal(params[0], learner.weight):
                break
            assert count < 200


# ---------------------------------------------------------------- SharedWeights
def shared_weights(net):
    """SharedWeights of net, in shared memory, page-locked where they are copied to a GPU."""
    weights = processes.SharedWeights(net)
    processes.share_memory(PARSER, weights, page_locked=next(net.parameters()).is_cuda)
    return weights


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_copies_reach_each_page_locked_tensor_also_one_at_a_freed_ones_addresses():
    # freed shared memory is often mapped again at the same addresses: a lock that outlived the
    # first tensor would send the second's copies from the GPU to the first one's pages
    for value in (1.0, 2.0):
        tensor = torch.zeros(1000).share_memory_()
        processes.page_lock(tensor)
        assert tensor.is_pinned()
        tensor.copy_(torch.full((1000,), value, device="cuda"))
        assert torch.equal(tensor, torch.full((1000,), value))
        del tensor


@pytest.mark.parametrize("device", SHARED_DEVICES)
def test_child_copy_equals_published_weights_after_refresh_and_lives_on_its_device(device):
    learner = nn.Linear(3, 2).to(device)
    weights = shared_weights(learner)
    child_net = weights.copy_to(device)
    assert all(p.device.type == device for p in child_net.parameters())
    assert (
        child_net is not learner
        and weights.flat.nbytes == 4 * (3 * 2 + 2)
        and weights.flat.is_shared()
    )
    # The tensor is page-locked for GPU copies, where Linux allows (no GPU: nothing to lock for).
    if device == "cuda":
        assert weights.flat.is_pinned() == (sys.platform == "linux")
    with torch.no_grad():
        learner.weight += 1  # an optimizer step
    weights.publish(learner)
    assert weights.refresh(child_net)
    for param, learned in zip(child_net.parameters(), learner.parameters()):
        assert param.device.type == device and torch.equal(param, learned)


def test_refresh_copies_only_when_a_publish_moved_the_version():
    learner = nn.Linear(3, 2)
    weights = shared_weights(learner)
    child_net = weights.copy_to("cpu")
    with torch.no_grad():
        child_net.weight.zero_()  # a mark that a copy would overwrite
    # Nothing is published yet.
    assert weights.refresh(child_net) and torch.equal(child_net.weight, torch.zeros(2, 3))
    weights.publish(learner)
    assert weights.version.value == 2 and weights.refresh(child_net)
    assert torch.equal(child_net.weight, learner.weight)


def test_refresh_gives_up_after_a_second_on_a_publish_that_never_ends_and_keeps_the_weights():
    learner = nn.Linear(3, 2)
    weights = shared_weights(learner)
    child_net = weights.copy_to("cpu")
    before = child_net.weight.detach().clone()
    weights.version.value += 1  # a learner that died in the middle of a publish
    with torch.no_grad():
        weights.flat.zero_()  # after writing part of it
    started = time.perf_counter()
    assert not weights.refresh(child_net)
    assert 0.9 < time.perf_counter() - started < 5 and torch.equal(child_net.weight, before)


def publish_numbers(weights, *, send):
    """Child process: publish weights all equal to the publish's number, 1, 2, 3, ..., forever."""
    net = copy.deepcopy(weights.net).to_empty(device="cpu")
    for number in range(1, 10**9):
        with torch.no_grad():
            for param in net.parameters():
                param.fill_(number)
        weights.publish(net)


def test_a_child_never_installs_a_torn_copy_of_weights_published_meanwhile():
    learner = nn.Linear(1000, 1000)  # 4 MB: a copy takes long enough for a publish to overlap it
    with torch.no_grad():
        for param in learner.parameters():
            param.zero_()
    weights = shared_weights(learner)
    child_net = weights.copy_to("cpu")
    installed, torn = [], False
    with processes.ChildProcesses(publish_numbers, {"writer": (weights,)}):
        deadline = time.time() + 60  # the writer starts within seconds
        while len(set(installed)) < 100 and time.time() < deadline:
            # It returns False: there is no gap in this writer's publishes for a second.
            whole = weights.refresh(child_net)
            values = torch.cat([p.detach().flatten() for p in child_net.parameters()])
            # The net holds the weights of one publish, whole, installed or kept.
            assert values.min() == values.max()
            if whole:
                installed.append(values[0].item())
        # the control: a plain copy, with no version to check, does catch a publish half-written
        while not torn and time.time() < deadline:
            plain = weights.flat.clone()
            torn = bool(plain.min() != plain.max())
    # The installs are whole, and newer and newer.
    assert len(set(installed)) == 100 and installed == sorted(installed)
    assert torn


def report_copy(weights, device, *, send):
    """Child process: refresh its copy of the published net and send it, again and again."""
    net = weights.copy_to(device)
    while True:
        weights.refresh(net)
        send([(param.device.type, param.detach().cpu()) for param in net.parameters()])
        time.sleep(0.05)


@pytest.mark.parametrize("device", SHARED_DEVICES)
def test_child_process_copy_follows_what_the_learner_publishes(device):
    learner = nn.Linear(3, 2).to(device)
    weights = shared_weights(learner)
    with processes.ChildProcesses(report_copy, {"child": (weights, device)}) as reports:
        for count, params in enumerate(reports):
            assert {device_type for device_type, _ in params} == {device}
            if all(
                torch.equal(value, param.cpu())
                for (_, value), param in zip(params, learner.parameters())
            ):
                if count > 0:
                    break  # the child has the weights published after its start
                with torch.no_grad():
                    learner.weight += 1
                weights.publish(learner)
            assert count < 200


# ---------------------------------------------------------------- ChildProcesses
def count_up(counter, *, send):
    """Child process: announce each message's number in shared memory, then send it, forever."""
    for number in range(10**6):
        counter.value = number
        send(number)


def test_a_child_sends_at_most_one_message_ahead_of_a_slow_reader():
    counter = torch.multiprocessing.get_context("spawn").Value("l", -1)
    ahead = []
    with processes.ChildProcesses(count_up, {"child": (counter,)}) as messages:
        for number in messages:
            deadline = time.monotonic() + 10
            while counter.value == number and time.monotonic() < deadline:
                time.sleep(0.001)  # until the child starts the next message, however late
            time.sleep(0.02)  # a slow reader: a free child would be far ahead by now
            ahead.append(counter.value - number)
            if number == 30:
                break
    # the child may start the next message once this one is taken, and no more: its numbers are
    # tiny messages, hundreds of which fit in any pipe's buffer
    assert set(ahead) == {1}


def crash(*, send):
    """Child process: send one message, then fail."""
    send("hello")
    raise RuntimeError("injected crash")


def test_a_crashed_child_ends_the_iteration_with_its_name_and_exit_code():
    received = []
    with pytest.raises(runs.ProcessLost, match="^child exited with code 1$"):
        with processes.ChildProcesses(crash, {"child": ()}) as messages:
            for message in messages:
                received.append(message)
    assert received == ["hello"]
