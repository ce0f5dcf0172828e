"""A hook for a script's processes (tests put it in a sitecustomize.py): a DQN script's replay
warm-up is $RL_TEST_REPLAY_START frames, not Pong's 10,000."""

import os

import runs

_setup = runs.setup


def short_warm_up_setup(*args):
    args, params, checkpoint = _setup(*args)
    if hasattr(params, "replay_start"):
        params.replay_start = int(os.environ["RL_TEST_REPLAY_START"])
    return args, params, checkpoint


runs.setup = short_warm_up_setup
