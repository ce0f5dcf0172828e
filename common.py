"""What the scripts share of reinforcement learning: the env makers and wrappers, the n-step
experience source, the replay buffer and batch unpacking. What a user changes lives in each script;
the run's plumbing in runs.py and processes.py."""

import collections
import hashlib
import os
import sys

import ale_py
import gymnasium as gym
import numpy as np
import torch

gym.register_envs(ale_py)
# ALE logs errors only, with no banner for every env made.
ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)


# ---------------------------------------------------------------- environments
# The envs every script knows: gymnasium ids, and the mean reward of 100 episodes that solves them.
ENV_IDS = {"pong": "PongNoFrameskip-v4", "cartpole": "CartPole-v1"}
STOP_REWARDS = {"pong": 18.0, "cartpole": 195.0}
FRAME_SKIP = 4  # emulator frames per agent step on Atari: one action, repeated 4 times


class FireAndNoopsOnReset(gym.Wrapper):
    """Start an episode as ale-py's vector env does: FIRE for one frame where the game has it, then
    k no-op frames, k drawn from 0 to noop_max - 1 less one for the FIRE (so 0 to 28 for Pong and
    noop_max 30, with 0 twice as likely). gymnasium's AtariPreprocessing would draw 1 to 30."""

    def __init__(self, env, noop_max):
        super().__init__(env)
        self.noop_max = noop_max
        self.fire = "FIRE" in env.unwrapped.get_action_meanings()

    def reset(self, **kwargs):
        """Reset, FIRE, then the no-ops; a game that ends on one of those frames is reset again."""
        obs, info = self.env.reset(**kwargs)
        noops = self.np_random.integers(max(self.noop_max, 1)) - self.fire
        for action in [1] * self.fire + [0] * noops:
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def atari_game(env):
    """The ALE game name of an env ("pong"), or None for other envs."""
    return gym.spec(ENV_IDS[env]).kwargs.get("game")


def make_python_env(env, n_envs=1, noop_max=30, render_mode=None):
    """Python pipeline: gymnasium wrappers in a SyncVectorEnv (next-step autoreset)."""

    def make_one():
        one = gym.make(ENV_IDS[env], render_mode=render_mode)
        if atari_game(env):
            one = FireAndNoopsOnReset(one, noop_max)
            one = gym.wrappers.AtariPreprocessing(one, noop_max=0, frame_skip=FRAME_SKIP)
            one = gym.wrappers.FrameStackObservation(one, 4, padding_type="zero")
        return one

    return gym.vector.SyncVectorEnv([make_one] * n_envs)


def make_fast_env(env, n_envs=1, threads=0, noop_max=30):
    """Fast envs: ale-py's C++ AtariVectorEnv (same preprocessing) for Atari, else SyncVectorEnv."""
    game = atari_game(env)
    if game is None:
        return make_python_env(env, n_envs)
    return ale_py.vector_env.AtariVectorEnv(
        game,
        n_envs,
        num_threads=threads,
        noop_max=noop_max,
        frameskip=FRAME_SKIP,
        stack_num=4,
        repeat_action_probability=0.0,
        reward_clipping=False,
    )


def cores_per_process(processes):
    """The cores this process may use, shared among `processes` processes that step their envs at
    once (at least 1): emulator threads each. Each env steps alone, so threads change no result."""
    # macOS and Windows have no sched_getaffinity.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // processes)


# ---------------------------------------------------------------- experience
# reward: discounted sum of up to n rewards; last_state: state after them, None if the episode
# terminated; steps: how many rewards were summed (fewer than n at an episode's end)
ExperienceFirstLast = collections.namedtuple(
    "ExperienceFirstLast", ["state", "action", "reward", "last_state", "steps"]
)


class ExperienceSourceFirstLast:
    """Steps a vector env with a batched agent; each iteration is one step of all envs and
    yields the n-step experiences it completed."""

    def __init__(self, env, agent, gamma, steps_count=1, seed=None):
        self.env, self.agent = env, agent
        self.gamma, self.steps_count, self.seed = gamma, steps_count, seed
        self.frames = 0  # agent steps taken, all envs together
        self.finished = []  # (reward, steps) of episodes ended since pop_episodes()
        n = env.num_envs
        self.history = [collections.deque() for _ in range(n)]  # (state, action, reward) per env
        self.ep_reward, self.ep_steps = np.zeros(n), np.zeros(n, dtype=np.int64)
        self.needs_reset = np.zeros(n, dtype=bool)

    def __iter__(self):
        """Forever: step all envs once, yield the list of experiences that step completed."""
        obs, _ = self.env.reset(seed=self.seed)
        while True:
            actions = self.agent(obs)
            next_obs, rewards, terminated, truncated, _ = self.env.step(actions)
            yield self.experiences(obs, actions, rewards, terminated, truncated, next_obs)
            obs = next_obs

    def experiences(self, obs, actions, rewards, terminated, truncated, next_obs):
        """Take in a step of all envs; return the experiences it completed."""
        exps = []
        for i, history in enumerate(self.history):
            if self.needs_reset[i]:  # next-step autoreset: this step only reset env i
                self.needs_reset[i] = False
                continue
            self.frames += 1
            self.ep_reward[i] += rewards[i]
            self.ep_steps[i] += 1
            history.append((obs[i], actions[i], rewards[i]))
            if terminated[i] or truncated[i]:
                # bootstrap from the real last observation on truncation, never on termination
                last = None if terminated[i] else next_obs[i]
                while history:
                    exps.append(self._first_last(history, last))
                    history.popleft()
                self.finished.append((self.ep_reward[i], int(self.ep_steps[i])))
                self.ep_reward[i], self.ep_steps[i] = 0, 0
                self.needs_reset[i] = True
            elif len(history) == self.steps_count:
                exps.append(self._first_last(history, next_obs[i]))
                history.popleft()
        return exps

    def _first_last(self, history, last_state):
        """Experience from the first state in history to last_state."""
        reward = 0.0
        for _, _, r in reversed(history):
            reward = r + self.gamma * reward
        state, action, _ = history[0]
        return ExperienceFirstLast(state, action, reward, last_state, len(history))

    def pop_episodes(self):
        """(reward, steps) of every episode finished since the last call."""
        finished, self.finished = self.finished, []
        return finished

    def state_dict(self):
        return {"frames": self.frames}  # a resumed run's frames go on counting

    def load_state_dict(self, state):
        self.frames = state["frames"]


class ReplayBuffer:
    """Ring buffer of one-step transitions, sampled uniformly: append stores one, sample draws a
    batch. Consecutive Pong states share three of their four frames, so the buffer stores each
    frame once (FrameIndex, below): 100,000 transitions as pairs of 4-frame states would take 5.6
    GB, their frames stored once 0.8 GB."""

    ARRAYS = ("actions", "rewards", "dones")

    def __init__(self, capacity, obs_space, seed=None):
        self.capacity, self.size, self.pos = capacity, 0, 0
        self.index = FrameIndex(capacity, obs_space)
        self.frames = np.zeros((self.index.slots, *self.index.frame_shape), dtype=obs_space.dtype)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=bool)
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.size

    def append(self, exp):
        """Store one experience, overwriting the oldest when full."""
        assert exp.steps == 1, "the buffer stores one-step transitions"
        i = self.pos
        for slot, frame in self.index.place(i, exp):
            self.frames[slot] = frame
        self.actions[i] = exp.action
        self.rewards[i] = exp.reward
        self.dones[i] = exp.last_state is None
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size):
        """Arrays (states, actions, rewards, dones, last_states) at batch_size random positions."""
        return self.transitions(self.rng.integers(0, self.size, batch_size))

    def transitions(self, idx):
        """Arrays (states, actions, rewards, dones, last_states) at the ring positions idx."""
        # Each row's frames are read once: its state's, and its next state's newest.
        frames = self.frames[self.index.rows[idx]]
        # A next state is its state's frames but the oldest.
        states, last_states = frames[:, :-1], frames[:, 1:]
        if not self.index.stacked:
            states, last_states = states[:, 0], last_states[:, 0]
        return states, self.actions[idx], self.rewards[idx], self.dones[idx], last_states

    def state_dict(self):
        """The filled rows, the store up to its highest slot in use and the other arrays' filled
        part, as tensors that share the arrays' memory (torch.save writes that part, no copy); the
        ring's position and the sampling generator's state."""
        rows = self.index.rows[: self.size]
        filled = {name: torch.from_numpy(getattr(self, name)[: self.size]) for name in self.ARRAYS}
        return dict(
            filled,
            rows=torch.from_numpy(rows),
            frames=torch.from_numpy(self.frames[: rows.max(initial=0) + 1]),
            capacity=self.capacity,
            pos=self.pos,
            size=self.size,
            rng=self.rng.bit_generator.state,
        )

    def load_state_dict(self, state):
        """Copy a state_dict's arrays into the buffer (from a mapped checkpoint: read as copied)."""
        if state["capacity"] != self.capacity:  # the ring's order holds at its own size only
            raise ValueError(
                f"{state['capacity']} transitions, where the script has {self.capacity}"
            )
        self.pos, self.size = state["pos"], state["size"]
        self.frames[: len(state["frames"])] = state["frames"].numpy()
        self.index.load(state["rows"].numpy(), state["frames"])
        for name in self.ARRAYS:
            getattr(self, name)[: self.size] = state[name].numpy()
        self.rng.bit_generator.state = state["rng"]


class FrameIndex:
    """Which slots of a store of frames the transitions of a ring are made of, each frame stored
    once: consecutive states share all frames but one, so a frame is found again by a 128-bit digest
    of its bytes, and its slot is free again when no transition uses it. Slot 0 holds zeros: the
    padding, a terminal's next frame."""

    def __init__(self, capacity, obs_space):
        shape, self.dtype = obs_space.shape, obs_space.dtype
        # An observation is a stack of frames; a vector observation is one frame of its own.
        self.stacked = len(shape) == 3
        self.frame_shape = shape[1:] if self.stacked else shape
        # The store has a frame for each transition, and room for those no transition starts
        # with: the next frame of each truncated episode's last transition (an eighth more:
        # episodes of 8 steps and more) and of each env's newest, and the 3 older frames of each
        # env's oldest (64: up to 16 envs).
        self.slots = capacity + capacity // 8 + 64
        # Each ring position holds the slots of its state's frames, then of its next state's newest.
        self.rows = np.zeros((capacity, (shape[0] if self.stacked else 1) + 1), dtype=np.int64)
        self.load(self.rows[:0], np.zeros((1, *self.frame_shape), self.dtype))

    def place(self, pos, exp):
        """Point ring position pos at a one-step experience's frames, releasing those it held;
        returns the (slot, frame) pairs new to the store, for the caller to write there."""
        for slot in self.rows[pos]:
            self.uses[slot] -= 1
            if self.uses[slot] == 0:
                del self.slot_of[self.digests[slot]]
                self.free.append(slot)
        frames = list(exp.state) if self.stacked else [exp.state]
        last = exp.last_state if exp.last_state is None or not self.stacked else exp.last_state[-1]
        # A terminal state's next frame is zeros.
        frames.append(np.zeros_like(frames[0]) if last is None else last)
        new = []
        for k, frame in enumerate(frames):
            frame = np.ascontiguousarray(frame, dtype=self.dtype)
            key = digest(frame)
            slot = self.slot_of.get(key)
            if slot is None:  # The frame is not in the store yet.
                if not self.free:
                    raise RuntimeError(
                        f"the replay buffer's store of {self.slots} frames is full: more than 16 "
                        "envs, or episodes truncated within 8 steps, need more (FrameIndex.slots)"
                    )
                slot = self.slot_of[key] = self.free.pop()
                self.digests[slot] = key
                new.append((slot, frame))
            self.rows[pos, k] = slot
            self.uses[slot] += 1
        return new

    def load(self, rows, frames):
        """Take a ring's filled rows and the store's frames up to their top slot (on the CPU)."""
        self.rows[: len(rows)], self.rows[len(rows) :] = rows, 0
        self.uses = np.bincount(self.rows.ravel(), minlength=self.slots)
        self.uses[0] += 1  # Slot 0, the zeros, is never freed.
        frames = np.asarray(frames)
        self.digests = [
            digest(frames[slot]) if uses else None for slot, uses in enumerate(self.uses)
        ]
        self.slot_of = {key: slot for slot, key in enumerate(self.digests) if key}
        # The list runs from the highest slot down, so pop() takes the lowest.
        self.free = [slot for slot in range(self.slots - 1, 0, -1) if not self.uses[slot]]


def digest(frame):
    """128 bits of BLAKE2b: two frames of a run collide with odds far below any hardware fault's."""
    return hashlib.blake2b(frame, digest_size=16).digest()


def unpack_batch_dqn(batch, device):
    """Tensors (states, actions, rewards, dones, last_states) on device from ReplayBuffer.sample."""
    return tuple(torch.as_tensor(array, device=device) for array in batch)


def unpack_batch_a2c(exps, net, device, gamma):
    """States, actions and n-step reference values, as tensors on device; those not terminated are
    bootstrapped with gamma ** steps times the value of their last state, which net computes on the
    device it is on."""
    states = torch.as_tensor(np.stack([e.state for e in exps]), device=device)
    actions = torch.as_tensor(np.array([e.action for e in exps]), device=device)
    ref_vals = np.array([e.reward for e in exps], dtype=np.float32)
    alive = [i for i, e in enumerate(exps) if e.last_state is not None]
    if alive:
        net_device = next(net.parameters()).device
        last_states = torch.as_tensor(
            np.stack([exps[i].last_state for i in alive]), device=net_device
        )
        with torch.no_grad():
            last_vals = net(last_states)[1].cpu().numpy()
        steps = np.array([exps[i].steps for i in alive])
        ref_vals[alive] += gamma**steps * last_vals
    return states, actions, torch.as_tensor(ref_vals, device=device)


# ---------------------------------------------------------------- network health
# A ReLU layer with fewer of its outputs above zero than this on the health states is dead: the
# seed-1 Pong run that never learned had 0.01% in two convolutions at 0.26M frames, and the lowest
# dip a network was seen to come back from was 1.67%, in a third convolution at 14k frames.
DEAD_ACTIVE_SHARE = 0.0003


class NetworkHealth:
    """Whether a DQN's ReLU units still fire, read on a fixed batch of states from its replay
    buffer. A unit (a convolution's channel, a linear layer's neuron) that is zero on every state
    passes no gradient back, so it stays zero: when a layer has no live units left, every state gets
    the same Q-values."""

    STATES = 256  # the fixed batch: states at evenly spread buffer positions at the first measure

    def __init__(self, net, buffer):
        self.net, self.buffer, self.states = net, buffer, None
        self.relus = [module for module in net.modules() if isinstance(module, torch.nn.ReLU)]
        self.warned = False  # a dead layer is told once

    @torch.no_grad()
    def measure(self):
        """Scalars by name: for the k-th ReLU layer the share of its units zero on every state
        (reluk/dead_units) and of its activations above zero (reluk/active); the Q-values' standard
        deviation over the states, averaged over the actions (q_spread)."""
        if self.states is None:
            count = min(self.STATES, len(self.buffer))  # distinct positions, at least 1 apart
            positions = np.linspace(0, len(self.buffer) - 1, count).astype(np.int64)
            states = self.buffer.transitions(positions)[0]
            self.states = torch.as_tensor(states, device=next(self.net.parameters()).device)
        outputs = []
        hooks = [
            relu.register_forward_hook(lambda module, inputs, output: outputs.append(output))
            for relu in self.relus
        ]
        q_values = self.net(self.states)
        for hook in hooks:
            hook.remove()
        scalars, dead = {}, []
        for k, output in enumerate(outputs, start=1):
            fired = output > 0
            unit_fired = fired.transpose(0, 1).flatten(1).any(dim=1)  # dimension 1 is the unit
            scalars[f"relu{k}/dead_units"] = 1 - unit_fired.float().mean().item()
            scalars[f"relu{k}/active"] = fired.float().mean().item()
            if scalars[f"relu{k}/active"] < DEAD_ACTIVE_SHARE:
                dead.append(f"relu{k}")
        scalars["q_spread"] = q_values.std(dim=0, correction=0).mean().item()
        if dead and not self.warned:
            self.warned = True
            print(
                f"{os.path.basename(sys.argv[0])}: warning: the network's {' and '.join(dead)} "
                f"had under {DEAD_ACTIVE_SHARE:.2%} of its outputs above zero: a dead layer gives "
                "every state nearly the same Q-values, and the run will not learn; stop it and "
                "start again with another --seed (docs/HOW.md, network health)",
                file=sys.stderr,
            )
        return scalars
