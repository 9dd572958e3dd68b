"""Reduction operation codes shared by the collective API and every engine."""

import enum

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
