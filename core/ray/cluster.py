"""Start the run's Ray: a local instance, or an existing cluster joined with `--ray-address` (or `RAY_ADDRESS`).

Joining a cluster: the driver connects to the head's GCS (`host:port`, as `ray start --head` prints it, or `auto`
for one started on this machine); the run's actors and placement groups belong to the run's job and end with it,
the cluster keeps running. Ray itself retries an unreachable or refusing address for minutes without saying why,
so the address is first probed over TCP for `--ray-connect-timeout` seconds: a run pointed at nothing stops with
the address, how long it tried and the last error.

Connecting to a running cluster takes under a second where starting a local instance takes about 4 s on a 2-core
machine; end to end, the demo's start did not measurably gain from it (docs/benchmarks.md, start-up).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time

import ray

from slime.errors import UsageError
from slime.observability.logging_utils import QUIET_ENV
from slime.utils.settings import Settings, option

logger = logging.getLogger(__name__)

#: Seconds between TCP probes of a cluster address that does not answer yet.
PROBE_INTERVAL_S = 0.5


@dataclasses.dataclass(frozen=True)
class RaySettings(Settings):
    """Where the run's Ray is (see the flags of the same names in `slime-run --help`)."""

    #: `--ray-address`, else the environment's `RAY_ADDRESS` (resolved by `from_environment`); None: start one.
    ray_address: str | None = option("ray_address")
    ray_connect_timeout: float = option("ray_connect_timeout", 30.0, convert=float, minimum=0.0)
    verbose: bool = option("verbose", False)

    @classmethod
    def from_environment(cls, args: object) -> RaySettings:
        """The settings of `args`, with `RAY_ADDRESS` standing in for an absent `--ray-address`."""
        settings = cls.from_args(args)
        if settings.ray_address is None and os.environ.get("RAY_ADDRESS"):
            return dataclasses.replace(settings, ray_address=os.environ["RAY_ADDRESS"])
        return settings


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) as (host, port); a ValueError names what is wrong."""
    if address.startswith("ray://"):
        raise ValueError(
            f"--ray-address {address}: Ray Client addresses (ray://) are not supported: the driver reads and "
            "writes the run's storage, so it runs on a node of the cluster; give the head's GCS address "
            "(host:port, as `ray start --head` prints it), or submit the run with `ray job submit`"
        )
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--ray-address {address!r}: expected host:port (e.g. 10.0.0.5:6379) or auto")
    return host, int(port)


def wait_for_address(address: str, timeout_s: float) -> None:
    """Return once `address` accepts a TCP connection; after `timeout_s` seconds without one, a UsageError
    naming the address, the time tried and the last error."""
    host, port = split_address(address)
    started = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return
        except OSError as exc:
            waited = time.monotonic() - started
            if waited >= timeout_s:
                reason = exc.strerror or type(exc).__name__
                raise UsageError(
                    f"--ray-address {address}: no Ray cluster answered there within {waited:.0f} s ({reason}); "
                    "check the address (`ray status` on the head node prints it) or start a head with "
                    f"`ray start --head --port {port}`; --ray-connect-timeout sets how long to try"
                ) from exc
        time.sleep(PROBE_INTERVAL_S)


def start_ray(settings: RaySettings) -> None:
    """Connect to `settings.ray_address` or, without one, start a local Ray instance (nothing when this process
    is already connected)."""
    if ray.is_initialized():
        return
    level = logging.INFO if settings.verbose else logging.WARNING
    if settings.ray_address is None:
        ray.init(logging_level=level)
        return
    address = settings.ray_address
    if address != "auto":
        try:
            wait_for_address(address, settings.ray_connect_timeout)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    # The cluster's workers inherit its nodes' environment, not this process's: hand them the quiet console's.
    quiet = {name: os.environ[name] for name in QUIET_ENV if name in os.environ}
    try:
        ray.init(address=address, logging_level=level, runtime_env={"env_vars": quiet} if quiet else None)
    except ConnectionError as exc:
        hint = (
            "start one with `ray start --head`, or leave --ray-address out to start a local Ray instance"
            if address == "auto"
            else "something answers on that port: check that it is a Ray head's GCS port, that both sides run the "
            "same Ray version, and that this machine holds the cluster's token (Ray's default token authentication "
            "refuses a driver without it)"
        )
        raise UsageError(f"--ray-address {address}: {exc}; {hint}") from exc
    resources = ray.cluster_resources()
    nodes = len([node for node in ray.nodes() if node.get("Alive")])
    logger.info(
        "joined the Ray cluster at %s: %d node%s, %g CPUs, %g GPUs",
        address,
        nodes,
        "" if nodes == 1 else "s",
        resources.get("CPU", 0),
        resources.get("GPU", 0),
    )
