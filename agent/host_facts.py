"""What the agent says about its host: name, versions, memory, disk, GPUs in wire form."""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import urlsplit

from agent.gpu import GpuSnapshot
from protocol.plain_text import printable
from protocol.wire import GpuBackendName, GpuStatus, HostFacts, PreflightCheck, SnapshotFailure


def default_host_name() -> str:
    """The short hostname as a DNS label (lower case, other characters -> '-')."""
    name = socket.gethostname().split(".")[0].lower()
    name = re.sub(r"[^a-z0-9-]", "-", name).strip("-")[:63]
    return name or "host"


def route_address(url: str) -> str:
    """The local address this host uses to reach URL's host: the one to advertise by default.

    A UDP `connect()` only asks the kernel for a route, no packet is sent, so this works while
    the control plane is down. A control plane on loopback gives a loopback address, which
    keeps a one-machine setup (the demo) local. Raises OSError when there is no route or the
    name does not resolve.
    """
    parts = urlsplit(url)
    if not parts.hostname:
        raise OSError(f"{url!r} names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    family, _, _, _, address = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        return str(sock.getsockname()[0])


def agent_version() -> str:
    """The installed dctl version."""
    try:
        return version("dctl")
    except PackageNotFoundError:
        return "0+unknown"


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (what a CPU engine holds), 0 when unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_facts(
    backend: GpuBackendName,
    sample: GpuSnapshot | None,
    preflight: list[PreflightCheck],
    data_dir: Path,
    engine_tls: bool = False,
    snapshots: list[str] | None = None,
    snapshot_failures: list[SnapshotFailure] | None = None,
    metrics_url: str | None = None,
) -> HostFacts:
    """Slow-changing facts about this host, with the preflight results, whether its engines
    serve HTTPS and where the agent's own /metrics answers."""
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    # What the system and the driver say goes through `printable`: the control plane refuses
    # a control character in any of it, and a refused heartbeat is a host gone silent.
    return HostFacts(
        hostname=printable(socket.gethostname()),
        os=printable(platform.platform()),
        agent_version=agent_version(),
        gpu_backend=backend,
        driver_version=_printable(sample.driver_version if sample else None),
        cuda_driver_version=_printable(sample.cuda_driver_version if sample else None),
        cpu_count=os.cpu_count(),
        memory_bytes=memory,
        disk_free_bytes=shutil.disk_usage(data_dir).free,
        preflight=preflight,
        engine_tls=engine_tls,
        snapshots=sorted(snapshots or [])[:256],
        snapshot_failures=(snapshot_failures or [])[:16],
        metrics_url=metrics_url,
    )


def _printable(text: str | None) -> str | None:
    return None if text is None else printable(text)


def gpu_status(sample: GpuSnapshot) -> list[GpuStatus]:
    """Wire form of a GPU sample (percent and Celsius, as the control plane stores them)."""
    return [
        GpuStatus(
            index=d.index,
            uuid=printable(d.uuid),
            name=printable(d.name),
            memory_total_bytes=d.memory_total_bytes or 0,
            memory_used_bytes=d.memory_used_bytes or 0,
            utilization_percent=round(d.utilization_ratio * 100, 1)
            if d.utilization_ratio is not None
            else None,
            temperature_c=d.temperature_celsius,
            power_w=d.power_watts,
            power_limit_w=d.power_limit_watts,
            ecc_uncorrectable=d.ecc_uncorrected_errors,
            persistence_mode=d.persistence_mode,
            compute_capability=_printable(d.compute_capability),
        )
        for d in sample.devices
    ]
