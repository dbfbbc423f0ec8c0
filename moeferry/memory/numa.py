"""Host memory near the GPU: on a host with several NUMA nodes, prefer the GPU's node.

A cache miss reads its expert from a page-locked host bank, over PCIe from the GPU's side. A
bank page on a node away from the GPU's PCIe root crosses the socket link first: slower and
shared with everything else crossing it. The kernel places a page on the node of the thread
that first touches it (PyTorch's pinned allocator touches a bank's pages from several threads
while registering them), so without a policy a bank ends up spread over the nodes. At build,
before any bank exists, `prefer_gpu_node` sets the process's memory policy to *preferred* on
the GPU's node (`set_mempolicy(MPOL_PREFERRED)`: pages go there while it has free memory, else
elsewhere, nothing fails); threads started afterwards (the allocator's registering threads, the
loader's) inherit it. One node, an unknown GPU node, or a platform without the call: nothing
changes. CPU placement is left alone (the CPU lane's threads use every core).
"""
from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger("moeferry.memory")

MPOL_PREFERRED = 1
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}  # syscall numbers
NODES = Path("/sys/devices/system/node")


def node_count(root: Path = NODES) -> int:
    return len(list(root.glob("node[0-9]*")))


def gpu_node(device: torch.device, pci: Path = Path("/sys/bus/pci/devices")) -> int | None:
    """The NUMA node of the GPU's PCIe device (sysfs), None when unknown (-1 there: no affinity)."""
    p = torch.cuda.get_device_properties(device)
    f = pci / f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0" / "numa_node"
    try:
        node = int(f.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _set_preferred(node: int) -> bool:
    number = SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return False
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(number, MPOL_PREFERRED, mask, ctypes.c_ulong(64 * len(mask) + 1)) == 0


def prefer_gpu_node(device: torch.device) -> int | None:
    """Prefer the GPU's NUMA node for this process's new host pages (see module doc); the node,
    or None when nothing was changed."""
    nodes = node_count() if device.type == "cuda" else 1
    if nodes < 2:
        return None
    node = gpu_node(device)
    if node is None:
        log.info("NUMA: %d nodes, the GPU's is not known: host memory placed as the kernel decides", nodes)
        return None
    if not _set_preferred(node):
        log.warning("NUMA: could not prefer node %d (the GPU's) for host memory: %s", node,
                    ctypes.get_errno() or platform.machine())
        return None
    log.info("NUMA: %d nodes; host memory (expert banks) preferred on node %d, the GPU's", nodes, node)
    return node
