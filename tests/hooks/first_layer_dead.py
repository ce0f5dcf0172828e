"""A hook for a script's processes (tests put it in a sitecustomize.py): every network that
common.NetworkHealth watches has its first layer's biases set far below zero first, so that its
first ReLU layer fires on no state."""

import torch

import common

watch = common.NetworkHealth.__init__


def watch_with_the_first_layer_dead(self, net, buffer):
    first = next(
        module for module in net.modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
    )
    with torch.no_grad():
        first.bias.fill_(-100.0)
    watch(self, net, buffer)


common.NetworkHealth.__init__ = watch_with_the_first_layer_dead
