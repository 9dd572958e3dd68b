"""Reduction operation codes shared by the collective API and every engine."""

import enum
from typing import Any, ContextManager

import torch

__all__ = ["ReduceOp", "OP_NAMES"]


class ReduceOp(enum.IntEnum):
    """Reduction operations, with Bagua's values (engines receive the plain int)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


#: int code -> name, for messages.
OP_NAMES = {int(op): op.name for op in ReduceOp}


def divide_(t: torch.Tensor, n: int) -> None:
    """``t /= n``, a complex tensor part by part: torch's complex division rounds otherwise than
    dividing the two parts, which the shared-memory engine does (1 ulp in 29 of 64 elements)."""
    if t.is_complex():
        torch.view_as_real(t).div_(n)
    else:
        t.div_(n)


def writing(t: torch.Tensor) -> ContextManager[Any]:
    """The mode in which torch ops may write ``t``, the caller's tensor: an nn.Parameter (a leaf that
    requires grad) only under no_grad, a tensor made under torch.inference_mode() (an eval metric)
    only in inference mode. The engines' collectives write without autograd; the torch ops around
    them (gloo's copy into the output and AVG's division, copies back into staged outputs) must
    too (on gloo they raised after the data was exchanged: a Parameter then held the SUM)."""
    return torch.inference_mode() if t.is_inference() else torch.no_grad()
