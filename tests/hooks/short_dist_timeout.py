"""A hook for a3c_dist's ranks (tests put it in a sitecustomize.py): init_process_group runs with a
sixth of the timeout that a3c_dist.py gives it (a test waits 10 s, not 60)."""

import torch.distributed as dist

_init = dist.init_process_group


def init_process_group(*args, timeout, **kwargs):
    return _init(*args, timeout=timeout / 6, **kwargs)


dist.init_process_group = init_process_group
