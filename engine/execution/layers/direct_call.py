"""A module whose call is its forward: the inference engine's layers skip nn.Module's call path.

`nn.Module.__call__` looks for hooks, forward pre-hooks and global state on every call, a few
microseconds each on a CPU, and a one-token pass makes hundreds of module calls
(benchmarks/bench_pass_breakdown.py). The engine's modules register no hooks, so they call their
forward directly; autograd, `state_dict`, `.to()` and torch.compile are unaffected.
"""

from torch import nn


class DirectCallModule(nn.Module):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
