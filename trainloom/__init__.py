"""trainloom: a Cython-accelerated data pipeline, collectives and fused optimizer steps for PyTorch.

Subpackages:

* :mod:`trainloom.data`  -- cached datasets over LMDB/Redis and load-balancing samplers;
* :mod:`trainloom.comm`  -- collectives over NCCL, a shared-memory engine and gloo;
* :mod:`trainloom.optim` -- ``fuse_optimizer`` / ``fuse_step``.
"""

# torch first, then compiled modules: torch's libgomp is then the OpenMP runtime the kernels share.
import torch  # noqa: F401

from trainloom._build_check import import_compiled
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

_openmp_helpers = import_compiled("trainloom._openmp_helpers")

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
