"""Simulated machines: fake sysfs trees that present given hardware claims.

Used by the tests, the quickstart (on a host that reports no hardware identifiers)
and the fleet simulator, through `bcd join --sysfs-root`.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from pathlib import Path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


def _nic(net: Path, name: str, mac: str, *, physical: bool, assign_type: int) -> None:
    nic = net / name
    nic.mkdir(parents=True, exist_ok=True)
    if physical:
        (nic / "device").mkdir(exist_ok=True)
    _write(nic / "address", mac)
    _write(nic / "addr_assign_type", str(assign_type))


def make_machine(
    root: Path,
    *,
    product_uuid: str | None = None,
    product_serial: str = "",
    board_serial: str = "",
    chassis_serial: str = "",
    macs: Sequence[str] = (),
    virtual_macs: Sequence[str] = (),
    random_macs: Sequence[str] = (),
    gpu_uuids: Sequence[str] = (),
    hostname: str = "host",
    boot_id: str | None = None,
) -> Path:
    """Write a machine's DMI, NICs, GPUs, hostname and boot id under ``root``; return it.

    ``product_uuid`` and ``boot_id`` default to fresh random UUIDs. ``macs`` become
    physical NICs ``eth<i>`` (a ``device`` entry, ``addr_assign_type`` 0),
    ``virtual_macs`` NICs ``veth<i>`` without ``device`` (also type 0), ``random_macs``
    physical NICs ``wlan<i>`` with a randomised address (type 1). ``lo`` is always there.
    """
    dmi = root / "sys" / "class" / "dmi" / "id"
    _write(dmi / "product_uuid", str(uuid.uuid4()) if product_uuid is None else product_uuid)
    _write(dmi / "product_serial", product_serial)
    _write(dmi / "board_serial", board_serial)
    _write(dmi / "chassis_serial", chassis_serial)
    net = root / "sys" / "class" / "net"
    _nic(net, "lo", "00:00:00:00:00:00", physical=False, assign_type=0)
    for i, mac in enumerate(macs):
        _nic(net, f"eth{i}", mac, physical=True, assign_type=0)
    for i, mac in enumerate(virtual_macs):
        _nic(net, f"veth{i}", mac, physical=False, assign_type=0)
    for i, mac in enumerate(random_macs):
        _nic(net, f"wlan{i}", mac, physical=True, assign_type=1)
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    for i, gpu in enumerate(gpu_uuids):
        _write(
            gpus / f"0000:{i + 7:02x}:00.0" / "information",
            f"Model: \t\t NVIDIA A100-SXM4-40GB\nIRQ:   \t\t 42\nGPU UUID: \t {gpu}\n"
            f"Video BIOS: \t 92.00.45.00.03\nBus Type: \t PCIe\n"
            f"Bus Location: \t 0000:{i + 7:02x}:00.0",
        )
    kernel = root / "proc" / "sys" / "kernel"
    _write(kernel / "hostname", hostname)
    _write(kernel / "random" / "boot_id", str(uuid.uuid4()) if boot_id is None else boot_id)
    return root


def random_mac(rng: random.Random) -> str:
    """A random globally administered unicast MAC that survives normalisation."""
    while True:
        octets = [rng.randrange(256) & 0xFC, *(rng.randrange(256) for _ in range(5))]
        text = ":".join(f"{o:02x}" for o in octets)
        if len(set(text.replace(":", ""))) > 1:
            return text


def random_machine(root: Path, seed: int) -> Path:
    """A distinct machine per ``seed`` with a trusted key (UUID, serial and one MAC)."""
    rng = random.Random(seed)  # noqa: S311 - simulated identifiers, not secrets
    return make_machine(
        root,
        product_uuid=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        product_serial=f"SN{seed:06d}{rng.getrandbits(32):08X}",
        macs=[random_mac(rng)],
        hostname=f"node-{seed}",
        boot_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
    )
