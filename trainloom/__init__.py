"""trainloom: a Cython-accelerated data pipeline, collectives and fused optimizer steps for PyTorch.

Subpackages:

* :mod:`trainloom.data`  -- cached datasets over LMDB/Redis and load-balancing samplers;
* :mod:`trainloom.comm`  -- collectives over NCCL, a shared-memory engine and gloo;
* :mod:`trainloom.optim` -- ``fuse_optimizer`` / ``fuse_step``.
"""

from typing import Any

# torch first, then compiled modules: torch's libgomp is then the OpenMP runtime the kernels share.
import torch  # noqa: F401

from trainloom._build_check import import_compiled as _import_compiled
from trainloom._config import config, show_config
from trainloom.errors import (
    CommError,
    CommTimeoutError,
    ConfigError,
    NcclError,
    NcclUnavailableError,
    StoreError,
    TrainloomError,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The OpenMP helpers load on first use (after torch, imported above), so that `trainloom info`
    # and `trainloom --help` still work, and say what is missing, when a compiled module is.
    if name == "_openmp_helpers":
        return _import_compiled("trainloom._openmp_helpers")
    raise AttributeError(f"module 'trainloom' has no attribute {name!r}")


__all__ = [
    "__version__",
    "config",
    "show_config",
    "TrainloomError",
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "NcclError",
    "NcclUnavailableError",
    "StoreError",
]
