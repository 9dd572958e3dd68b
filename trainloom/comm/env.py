"""Rank, world size and node layout: Bagua's ``bagua.torch_api.env`` over the torchrun environment.

``torchrun`` exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
When none of them is set the process is rank 0 of a world of 1 (scripts run under plain ``python``
and in debuggers); when some are set and others are not, :func:`read_launch_env` raises a
:class:`~trainloom.errors.ConfigError` naming the missing ones.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import socket
from typing import Any, Optional

from trainloom.errors import ConfigError

__all__ = [
    "LaunchEnv",
    "read_launch_env",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
    "get_default_bucket_size",
    "LAUNCH_VARS",
]


def as_int(value: object) -> Optional[int]:
    """``value`` as an int when it is an integer argument (a rank, size or count): an ``int``, a numpy
    integer or another ``numbers.Integral``, but not a bool; else None."""
    if type(value) is int:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


#: The variables torchrun sets, in the order they are reported.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: What a communicator that finds the store gone while connecting tells the user.
STORE_GONE_HINT = (
    "Under a plain launch global rank 0 hosts the TCPStore and communicators connect at their first "
    "collective, so rank 0 must stay alive until every group has been used once: call barrier() on the "
    "default group before rank 0 exits (or destroys the process group), or launch with torchrun, whose "
    "agent hosts the store"
)

#: Bagua's default bucket size (10 MiB); override with TRAINLOOM_DEFAULT_BUCKET_SIZE (or Bagua's
#: BAGUA_DEFAULT_BUCKET_SIZE).
DEFAULT_BUCKET_SIZE = 10 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    #: True when nothing was set and the process runs alone (rank 0 of 1).
    single_process: bool
    #: False when neither LOCAL_RANK/LOCAL_WORLD_SIZE nor local_world_size= said where the rank sits:
    #: local_rank and local_world_size are then provisional (one node) and init_process_group
    #: replaces them with the layout it finds (ranks sharing this rank's node identity).
    local_known: bool = True


def _int_var(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_launch_env(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
    need_master: bool = True,
    caller: str = "init_process_group",
) -> LaunchEnv:
    """Read the torchrun variables, with explicit overrides.

    Args:
        rank: overrides RANK.
        world_size: overrides WORLD_SIZE.
        local_world_size: overrides LOCAL_WORLD_SIZE (LOCAL_RANK then defaults to
            ``rank % local_world_size``).
        need_master: MASTER_ADDR/MASTER_PORT are required (False when the caller brings a store).
        caller: the function named at the start of error messages.

    Returns:
        The launch environment.

    Raises:
        ConfigError: some variables are set and others missing (naming the missing ones), a value
            is not an integer, or the values are inconsistent (rank outside the world, ...).

    Example::

        env = read_launch_env()          # under torchrun, or rank 0 of 1 under plain python
        env.rank, env.world_size
    """
    env = {k: os.environ[k] for k in LAUNCH_VARS if os.environ.get(k, "") != ""}
    overrides = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": local_world_size}
    if not env and all(v is None for v in overrides.values()):
        return LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, True)
    for name, value in overrides.items():
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name.lower()} must be an int, got {value!r}")
    r = rank if rank is not None else (_int_var("RANK", env["RANK"]) if "RANK" in env else None)
    w = world_size
    if w is None and "WORLD_SIZE" in env:
        w = _int_var("WORLD_SIZE", env["WORLD_SIZE"])
    lws = local_world_size
    if lws is None and "LOCAL_WORLD_SIZE" in env:
        lws = _int_var("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"])
    lr = _int_var("LOCAL_RANK", env["LOCAL_RANK"]) if "LOCAL_RANK" in env and rank is None else None
    # torchrun sets all of RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; a script that sets only
    # MASTER_ADDR/MASTER_PORT and passes rank=/world_size= (the early torch.distributed launchers
    # with multiprocessing.Process) says nothing of nodes, and the layout is found at the rendezvous.
    torchrun_like = bool(env.keys() - {"MASTER_ADDR", "MASTER_PORT"})
    covered = {
        "RANK": rank is not None,
        "WORLD_SIZE": world_size is not None,
        "LOCAL_RANK": rank is not None or not torchrun_like,
        "LOCAL_WORLD_SIZE": local_world_size is not None or not torchrun_like,
        "MASTER_ADDR": not need_master or w == 1,
        "MASTER_PORT": not need_master or w == 1,
    }
    missing = [k for k in LAUNCH_VARS if k not in env and not covered[k]]
    if missing:
        present = sorted(set(env) | {k for k, v in overrides.items() if v is not None})
        raise ConfigError(
            f"{caller}: {', '.join(missing)} not set, but {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'}. Launch with torchrun (which sets "
            f"{', '.join(LAUNCH_VARS)}), set the missing variables, or pass rank=/world_size=/"
            "local_world_size= explicitly"
        )
    if r is None or w is None:  # unreachable: both are in LAUNCH_VARS and were checked above
        raise ConfigError(f"{caller}: RANK and WORLD_SIZE are required")
    if w < 1:
        raise ConfigError(f"world_size must be >= 1, got {w}")
    if not 0 <= r < w:
        raise ConfigError(f"rank {r} is outside the world 0..{w - 1} (world_size={w})")
    local_known = lws is not None
    if lws is None:
        lws = w
    if not 1 <= lws <= w:
        raise ConfigError(f"local_world_size must be in 1..{w} (world_size), got {lws}")
    if lr is None:
        lr = r % lws
    if not 0 <= lr < lws:
        raise ConfigError(f"LOCAL_RANK={lr} is outside 0..{lws - 1} (LOCAL_WORLD_SIZE={lws})")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int_var("MASTER_PORT", env["MASTER_PORT"]) if "MASTER_PORT" in env else 0
    if w > 1 and need_master and not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    if port == 0 and w == 1:
        port = _free_port()
    return LaunchEnv(r, w, lr, lws, addr, port, False, local_known)


def _default_group() -> Any:  # late import: group.py imports this module
    from trainloom.comm import group

    return group._STATE.default


def get_rank() -> int:
    """The rank of this process in the default process group.

    Before :func:`~trainloom.comm.init_process_group` it is read from the environment (RANK, or 0
    when nothing is set).

    Returns:
        The rank, ``0 <= rank < get_world_size()``.

    Example::

        if get_rank() == 0:
            save_checkpoint()
    """
    pg = _default_group()
    if pg is not None:
        return pg.rank
    return read_launch_env(need_master=False, caller="get_rank").rank


def get_world_size() -> int:
    """The number of processes in the default process group (from the environment before init).

    Returns:
        The world size (WORLD_SIZE, or 1 when nothing is set).

    Example::

        shard = len(dataset) // get_world_size()
    """
    pg = _default_group()
    if pg is not None:
        return pg.world_size
    return read_launch_env(need_master=False, caller="get_world_size").world_size


def get_local_rank() -> int:
    """This process's index on its node (LOCAL_RANK), ``0 <= local_rank < get_local_size()``.

    Returns:
        The local rank.

    Example::

        torch.cuda.set_device(get_local_rank())  # before init_process_group(), as in Bagua
    """
    from trainloom.comm import group

    if group._STATE.launch is not None:
        return group._STATE.launch.local_rank
    return read_launch_env(need_master=False, caller="get_local_rank").local_rank


def get_local_size() -> int:
    """The number of processes on this node (LOCAL_WORLD_SIZE).

    Returns:
        The local world size.

    Example::

        per_node = get_local_size()
    """
    from trainloom.comm import group

    if group._STATE.launch is not None:
        return group._STATE.launch.local_world_size
    return read_launch_env(need_master=False, caller="get_local_size").local_world_size


def get_default_bucket_size() -> int:
    """The default communication bucket size in bytes (Bagua's 10 MiB).

    Read from TRAINLOOM_DEFAULT_BUCKET_SIZE, else BAGUA_DEFAULT_BUCKET_SIZE, else 10 MiB.

    Returns:
        The bucket size in bytes.

    Raises:
        ConfigError: the variable is not a positive integer.

    Example::

        bucket_bytes = get_default_bucket_size()
    """
    for name in ("TRAINLOOM_DEFAULT_BUCKET_SIZE", "BAGUA_DEFAULT_BUCKET_SIZE"):
        value = os.environ.get(name)
        if value:
            size = _int_var(name, value)
            if size <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive number of bytes")
            return size
    return DEFAULT_BUCKET_SIZE
