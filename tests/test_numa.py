"""Host memory near the GPU (`memory.numa`): the GPU's node from sysfs, and the policy call."""
from __future__ import annotations

import ctypes
import platform
from types import SimpleNamespace

import pytest
import torch

from moeferry.memory import numa


def _props(monkeypatch, bus=0x41):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(pci_domain_id=0, pci_bus_id=bus, pci_device_id=0))


def test_gpu_node_read_from_the_pci_device(tmp_path, monkeypatch):
    _props(monkeypatch)
    dev = tmp_path / "0000:41:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert numa.gpu_node(torch.device("cuda"), tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")  # the platform gives the device no node
    assert numa.gpu_node(torch.device("cuda"), tmp_path) is None
    _props(monkeypatch, bus=0x42)  # no such device in sysfs
    assert numa.gpu_node(torch.device("cuda"), tmp_path) is None


def test_nodes_counted_from_sysfs(tmp_path):
    for name in ("node0", "node1", "has_cpu", "possible"):
        (tmp_path / name).mkdir()
    assert numa.node_count(tmp_path) == 2


def test_one_node_or_no_gpu_changes_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(numa, "_set_preferred", lambda node: calls.append(node) or True)
    assert numa.prefer_gpu_node(torch.device("cpu")) is None
    monkeypatch.setattr(numa, "node_count", lambda root=numa.NODES: 1)
    assert numa.prefer_gpu_node(torch.device("cuda")) is None
    monkeypatch.setattr(numa, "node_count", lambda root=numa.NODES: 2)
    monkeypatch.setattr(numa, "gpu_node", lambda device: None)
    assert numa.prefer_gpu_node(torch.device("cuda")) is None
    assert calls == []
    monkeypatch.setattr(numa, "gpu_node", lambda device: 1)
    assert numa.prefer_gpu_node(torch.device("cuda")) == 1 and calls == [1]


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in numa.SET_MEMPOLICY,
                    reason="set_mempolicy by syscall number: Linux x86_64 / aarch64")
def test_the_policy_call_is_accepted_and_reported():
    """The kernel takes the call as made (node 0 exists on every Linux host); the default policy
    is put back after."""
    libc = ctypes.CDLL(None, use_errno=True)
    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 1)()
    get_mempolicy = {"x86_64": 239, "aarch64": 236}[platform.machine()]
    try:
        assert numa._set_preferred(0)
        assert libc.syscall(get_mempolicy, ctypes.byref(mode), mask, ctypes.c_ulong(65), None, 0) == 0
        assert mode.value == numa.MPOL_PREFERRED and mask[0] == 1
    finally:
        libc.syscall(numa.SET_MEMPOLICY[platform.machine()], 0, None, ctypes.c_ulong(0))  # MPOL_DEFAULT
