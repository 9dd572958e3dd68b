"""The exception hierarchy of trainloom.

Every error inherits from :class:`TrainloomError` and also from the builtin a caller would naturally
catch (``RuntimeError`` for communication failures, ``ValueError`` for bad configuration), and pickles
across processes (DataLoader workers, multiprocessing) with its attributes intact.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "TrainloomError",
    "CommError",
    "CommTimeoutError",
    "NcclError",
    "NcclUnavailableError",
    "StoreError",
    "ConfigError",
]


class TrainloomError(Exception):
    """Base class of every exception trainloom raises on purpose."""


def _state(exc: BaseException) -> dict[str, Any]:
    """What a pickled error must carry besides its constructor arguments: ``args`` (which callers
    may have rewritten, e.g. a communicator's note) and every attribute set after construction
    (``communicator``, ``__notes__``, ...). ``BaseException.__setstate__`` sets each item back."""
    return {**exc.__dict__, "args": exc.args}


class CommError(TrainloomError, RuntimeError):
    """A collective failed: a peer died, the ranks disagree, or the engine reported an error."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not complete before its deadline."""


class NcclError(CommError):
    """An NCCL call returned an error status.

    Attributes:
        status: the ``ncclResult_t`` value.
        where: the NCCL API that failed, e.g. ``"ncclAllReduce"``.
    """

    def __init__(self, status: int, where: str, message: str = "") -> None:
        self.status = int(status)
        self.where = where
        self.message = message
        text = f"{where}: {message} (code={self.status})" if message else f"{where} (code={self.status})"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.where, self.message), _state(self))


class NcclUnavailableError(CommError):
    """libnccl could not be loaded; the message lists every path tried and its dlerror()."""


class StoreError(TrainloomError):
    """A cache store (LMDB, Redis) failed. Never reported as a cache miss.

    Attributes:
        backend: ``"lmdb"``, ``"redis"`` or another store name.
        key: the key involved, when there is one.
    """

    def __init__(self, message: str, backend: Optional[str] = None, key: Optional[str] = None) -> None:
        self.message = message
        self.backend = backend
        self.key = key
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.backend, self.key), _state(self))


class ConfigError(TrainloomError, ValueError):
    """An argument or environment setting is invalid."""
