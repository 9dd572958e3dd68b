"""Fused optimizer steps: ``fuse_optimizer`` / ``fuse_step`` (Bagua's ``bagua.torch_api.contrib``).

Example::

    >>> from trainloom.optim import fuse_optimizer
    >>> opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    >>> model(x).sum().backward()
    >>> opt.fuse_step()
"""

from trainloom.optim.fused import (
    FuseError,
    calculate_mutual_groups,
    flat_buffers,
    fuse_optimizer,
    fuse_step,
    is_fused_optimizer,
    kernel_checks,
)

__all__ = [
    "FuseError",
    "calculate_mutual_groups",
    "flat_buffers",
    "fuse_optimizer",
    "fuse_step",
    "is_fused_optimizer",
    "kernel_checks",
]
