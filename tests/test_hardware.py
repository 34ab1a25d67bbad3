"""bcd.hardware: reading claims, normalisation, the hardware key, expect bindings."""

from __future__ import annotations

import hashlib
import random
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcd import hardware, wire
from tests import fakesys

UUID = "4c4c4544-0042-3510-8052-b4c04f4e3732"
MAC = "0c:c4:7a:12:34:56"
MAC2 = "3c:ec:ef:01:02:03"
GPU = "GPU-5f3a1c2e-9b7d-4e61-a0c8-1d2e3f405162"


# --- reading a machine ------------------------------------------------------------


def test_reads_dmi_nics_gpus_hostname_and_boot_id(tmp_path: Path) -> None:
    boot = "0b1d8c1e-6c0a-4a53-9a4e-6f1f6c0e5d11"
    fakesys.make_machine(
        tmp_path,
        product_uuid=UUID.upper(),
        product_serial="  ABC123 ",
        board_serial="BRD-9",
        chassis_serial="CH-7",
        macs=[MAC2, MAC],
        gpu_uuids=[GPU],
        hostname="gpu-17",
        boot_id=boot,
    )
    claims = hardware.read_claims(tmp_path)
    assert claims == wire.Claims(
        product_uuid=UUID.upper(),
        product_serial="ABC123",
        board_serial="BRD-9",
        chassis_serial="CH-7",
        macs=(MAC, MAC2),
        gpu_uuids=(GPU,),
        hostname="gpu-17",
        boot_id=boot,
    )


def test_empty_tree_gives_empty_claims(tmp_path: Path) -> None:
    assert hardware.read_claims(tmp_path) == wire.Claims()


def test_unreadable_file_gives_empty_value(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path, product_serial="ABC123")
    uuid_file = tmp_path / "sys/class/dmi/id/product_uuid"
    uuid_file.unlink()
    uuid_file.mkdir()  # reading a directory fails, even as root
    claims = hardware.read_claims(tmp_path)
    assert claims.product_uuid == ""
    assert claims.product_serial == "ABC123"


def test_virtual_nic_is_not_claimed(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path, macs=[MAC], virtual_macs=[MAC2])
    assert hardware.read_claims(tmp_path).macs == (MAC,)


def test_loopback_is_not_claimed(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path)
    assert hardware.read_claims(tmp_path).macs == ()


def test_randomised_mac_is_not_claimed(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path, macs=[MAC], random_macs=[MAC2])
    assert hardware.read_claims(tmp_path).macs == (MAC,)


def test_nic_without_addr_assign_type_counts_as_permanent(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path, macs=[MAC])
    (tmp_path / "sys/class/net/eth0/addr_assign_type").unlink()
    assert hardware.read_claims(tmp_path).macs == (MAC,)


def test_bond_member_claims_its_permanent_address(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path, macs=[MAC, MAC])
    slave = tmp_path / "sys/class/net/eth1/bonding_slave"
    slave.mkdir()
    (slave / "perm_hwaddr").write_text(MAC2 + "\n")
    assert hardware.read_claims(tmp_path).macs == (MAC, MAC2)


def test_claims_are_sent_as_read(tmp_path: Path) -> None:
    fakesys.make_machine(
        tmp_path,
        product_uuid="00000000-0000-0000-0000-000000000000",
        product_serial="To Be Filled By O.E.M.",
        macs=["0C-C4-7A-12-34-56"],
    )
    claims = hardware.read_claims(tmp_path)
    assert claims.product_uuid == "00000000-0000-0000-0000-000000000000"
    assert claims.product_serial == "To Be Filled By O.E.M."
    assert claims.macs == ("0C-C4-7A-12-34-56",)


def test_values_and_lists_are_capped(tmp_path: Path) -> None:
    macs = [f"0c:c4:7a:00:{i // 256:02x}:{i % 256:02x}" for i in range(80)]
    fakesys.make_machine(tmp_path, product_serial="S" * 1000, macs=macs, hostname="h" * 300)
    claims = hardware.read_claims(tmp_path)
    assert claims.product_serial == "S" * 256
    assert claims.hostname == "h" * 256
    assert claims.macs == tuple(sorted(macs)[:64])
    assert wire.Claims.from_json(claims.to_json()) == claims


# --- normalisation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [UUID, UUID.upper(), UUID.replace("-", ""), UUID.upper().replace("-", ""), f"  {UUID}\n"],
)
def test_uuid_is_lower_case_dashed(raw: str) -> None:
    assert hardware.normalize_uuid(raw) == UUID


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "not-a-uuid",
        "{" + UUID + "}",
        UUID[:-1],
        "00000000-0000-0000-0000-000000000000",
        "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF",
        "ffffffffffffffffffffffffffffffff",
        "11111111-1111-1111-1111-111111111111",
    ],
)
def test_placeholder_or_malformed_uuid_is_dropped(raw: str) -> None:
    assert hardware.normalize_uuid(raw) is None


@pytest.mark.parametrize("placeholder", hardware.PLACEHOLDERS)
def test_placeholder_serial_is_dropped(placeholder: str) -> None:
    assert hardware.normalize_serial(placeholder) is None
    assert hardware.normalize_serial(f"  {placeholder.lower()} ") is None
    assert hardware.normalize_serial(placeholder.upper()) is None


@pytest.mark.parametrize("raw", ["", "   ", "0", "000000", "XXXXXXXX", "----", "a-a:a"])
def test_empty_or_repeated_character_serial_is_dropped(raw: str) -> None:
    assert hardware.normalize_serial(raw) is None


def test_serial_is_trimmed_and_upper_cased() -> None:
    assert hardware.normalize_serial("  abc-123x \n") == "ABC-123X"


def test_value_with_control_character_is_dropped() -> None:
    assert hardware.normalize_serial("ABC\nmac:0c:c4:7a:12:34:56") is None
    assert hardware.normalize_gpu_uuid("GPU-1\x00") is None


@pytest.mark.parametrize(
    "raw", [MAC, MAC.upper(), "0c-c4-7a-12-34-56", "0cc4.7a12.3456", "0CC47A123456", f" {MAC} "]
)
def test_mac_forms_normalise_to_lower_case_colon_form(raw: str) -> None:
    assert hardware.normalize_mac(raw) == MAC


@pytest.mark.parametrize(
    "raw",
    [
        "02:42:ac:11:00:02",  # locally administered (docker)
        "01:00:5e:00:00:01",  # multicast
        "ff:ff:ff:ff:ff:ff",
        "00:00:00:00:00:00",
        "44:44:44:44:44:44",  # one repeated character
        "0c:c4:7a:12:34",
        "0c:c4-7a:12:34:56",
        "0c:c4:7a:12:34:5g",
        "",
    ],
)
def test_non_permanent_or_malformed_mac_is_dropped(raw: str) -> None:
    assert hardware.normalize_mac(raw) is None


def test_gpu_uuid_is_lower_cased() -> None:
    assert hardware.normalize_gpu_uuid(f" {GPU.upper()} ") == GPU.lower()


@pytest.mark.parametrize("raw", ["GPU-00000000-0000-0000-0000-000000000000", "N/A", ""])
def test_placeholder_gpu_uuid_is_dropped(raw: str) -> None:
    assert hardware.normalize_gpu_uuid(raw) is None


# --- the hardware key -------------------------------------------------------------


def test_key_hashes_sorted_kind_value_lines() -> None:
    claims = wire.Claims(
        product_uuid=UUID.upper(),
        product_serial="abc123",
        board_serial="ABC123",
        macs=("0C-C4-7A-12-34-56",),
        gpu_uuids=(GPU.upper(),),
    )
    lines = [f"gpu_uuid:{GPU.lower()}", f"mac:{MAC}", f"product_uuid:{UUID}", "serial:ABC123"]
    key = hardware.hardware_key(claims)
    assert key.hex == hashlib.sha256("\n".join(lines).encode()).hexdigest()
    assert key.kinds == frozenset(hardware.KINDS)
    assert key.trusted
    assert key.has_uuid_or_serial


def test_key_trusted_with_two_kinds() -> None:
    key = hardware.hardware_key(wire.Claims(product_serial="ABC123", macs=(MAC,)))
    assert key.trusted
    assert key.kinds == {"serial", "mac"}
    assert key.has_uuid_or_serial


def test_key_untrusted_with_one_kind() -> None:
    key = hardware.hardware_key(wire.Claims(macs=(MAC, MAC2)))
    assert key.hex is not None
    assert not key.trusted
    assert not key.has_uuid_or_serial
    assert key.kinds == {"mac"}


def test_three_serials_count_as_one_kind() -> None:
    claims = wire.Claims(product_serial="A1", board_serial="B2", chassis_serial="C3")
    assert not hardware.hardware_key(claims).trusted


def test_placeholder_machine_has_no_key() -> None:
    claims = wire.Claims(
        product_uuid="FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF",
        product_serial="To Be Filled By O.E.M.",
        board_serial="Default string",
        chassis_serial="System Serial Number",
        macs=("02:42:ac:11:00:02",),
        hostname="localhost",
    )
    key = hardware.hardware_key(claims)
    assert key == hardware.HardwareKey(None, False, False, frozenset())


def test_hostname_and_boot_id_are_not_part_of_the_key() -> None:
    a = wire.Claims(product_uuid=UUID, macs=(MAC,), hostname="a", boot_id="1")
    b = wire.Claims(product_uuid=UUID, macs=(MAC,), hostname="b", boot_id="2")
    assert hardware.hardware_key(a) == hardware.hardware_key(b)


def test_random_machines_have_distinct_trusted_keys(tmp_path: Path) -> None:
    keys = set()
    for seed in range(50):
        claims = hardware.read_claims(fakesys.random_machine(tmp_path / str(seed), seed))
        key = hardware.hardware_key(claims)
        assert key.trusted
        assert key.kinds == {"product_uuid", "serial", "mac"}
        keys.add(key.hex)
    assert len(keys) == 50


def test_random_machine_is_reproducible(tmp_path: Path) -> None:
    a = hardware.read_claims(fakesys.random_machine(tmp_path / "a", 7))
    b = hardware.read_claims(fakesys.random_machine(tmp_path / "b", 7))
    assert a == b


# --- expect bindings --------------------------------------------------------------


def test_normalize_expect_normalises_values() -> None:
    raw = {"productUuid": UUID.upper(), "serial": " abc123 ", "mac": "0CC47A123456", "gpuUuid": GPU}
    assert hardware.normalize_expect(raw) == {
        "productUuid": UUID,
        "serial": "ABC123",
        "mac": MAC,
        "gpuUuid": GPU.lower(),
    }
    assert hardware.normalize_expect({}) == {}


@pytest.mark.parametrize(
    ("obj", "named"),
    [
        ({"productUuid": "00000000-0000-0000-0000-000000000000"}, "productUuid"),
        ({"productUuid": "nope"}, "productUuid"),
        ({"serial": "To Be Filled By O.E.M."}, "serial"),
        ({"mac": "02:42:ac:11:00:02"}, "mac"),
        ({"mac": "01:00:5e:00:00:01"}, "mac"),
        ({"gpuUuid": ""}, "gpuUuid"),
        ({"hostname": "x"}, "hostname"),
        ({"serial": 5}, "serial"),
        ({"serial": "S" * 257}, "serial"),
        ([], "expect"),
        (None, "expect"),
    ],
)
def test_normalize_expect_rejects_invalid_values_naming_the_key(obj: object, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        hardware.normalize_expect(obj)


def test_empty_expect_matches() -> None:
    assert hardware.expect_matches({}, wire.Claims())


def test_expect_serial_matches_board_serial_case_insensitively() -> None:
    claims = wire.Claims(product_serial="P-1", board_serial="brd-42x", chassis_serial="C-3")
    assert hardware.expect_matches(hardware.normalize_expect({"serial": "BRD-42X"}), claims)
    assert hardware.expect_matches({"serial": "c-3"}, claims)
    assert not hardware.expect_matches({"serial": "BRD-43X"}, claims)


def test_expect_product_uuid_matches_whatever_the_format() -> None:
    claims = wire.Claims(product_uuid=UUID.upper().replace("-", ""))
    assert hardware.expect_matches(hardware.normalize_expect({"productUuid": UUID}), claims)


def test_expect_placeholder_uuid_never_matches() -> None:
    zero = "00000000-0000-0000-0000-000000000000"
    assert not hardware.expect_matches({"productUuid": zero}, wire.Claims(product_uuid=zero))


def test_expect_mac_must_be_among_the_machines_macs(tmp_path: Path) -> None:
    fakesys.make_machine(tmp_path, macs=[MAC], virtual_macs=[MAC2])
    claims = hardware.read_claims(tmp_path)
    assert hardware.expect_matches({"mac": "0C-C4-7A-12-34-56"}, claims)
    assert not hardware.expect_matches({"mac": MAC2}, claims)


def test_expect_gpu_uuid_matches_case_insensitively() -> None:
    claims = wire.Claims(gpu_uuids=(GPU.upper(),))
    assert hardware.expect_matches(hardware.normalize_expect({"gpuUuid": GPU}), claims)


def test_expect_every_named_identifier_must_match() -> None:
    claims = wire.Claims(product_uuid=UUID, product_serial="ABC123", macs=(MAC,))
    assert hardware.expect_matches({"productUuid": UUID, "serial": "abc123", "mac": MAC}, claims)
    assert not hardware.expect_matches({"productUuid": UUID, "mac": MAC2}, claims)


def test_expect_with_unknown_key_never_matches() -> None:
    assert not hardware.expect_matches({"hostname": "host"}, wire.Claims(hostname="host"))


# --- properties -------------------------------------------------------------------

_ODD = st.characters(categories=["Cs", "Cc", "Zs", "Lu", "Ll", "Nd", "Pd", "Po"])
_TEXT = st.one_of(
    st.text(max_size=256),
    st.text(_ODD, max_size=40),
    st.uuids().map(str),
    st.uuids().map(lambda u: u.hex.upper()),
    st.binary(min_size=6, max_size=6).map(lambda b: b.hex(":")),
    st.binary(min_size=6, max_size=6).map(lambda b: b.hex("-").upper()),
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.sampled_from(hardware.PLACEHOLDERS),
)
_LIST = st.lists(_TEXT, max_size=64).map(tuple)
_CLAIMS = st.builds(
    wire.Claims,
    product_uuid=_TEXT,
    product_serial=_TEXT,
    board_serial=_TEXT,
    chassis_serial=_TEXT,
    macs=_LIST,
    gpu_uuids=_LIST,
    hostname=_TEXT,
    boot_id=_TEXT,
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=10,
)
_ASCII_SWAP = str.maketrans(string.ascii_letters, string.ascii_uppercase + string.ascii_lowercase)


@given(_CLAIMS)
def test_hardware_key_and_json_round_trip_never_raise(claims: wire.Claims) -> None:
    key = hardware.hardware_key(claims)
    assert key.trusted == (len(key.kinds) >= 2)
    assert (key.hex is None) == (not key.kinds)
    assert wire.Claims.from_json(claims.to_json()) == claims


@given(_CLAIMS, st.randoms(use_true_random=False), st.sampled_from(["upper", "lower", "swap"]))
def test_key_is_independent_of_order_and_case(
    claims: wire.Claims, rnd: random.Random, case: str
) -> None:
    def recase(value: str) -> str:
        if case == "swap":
            return value.translate(_ASCII_SWAP)
        table = str.maketrans(
            string.ascii_letters,
            string.ascii_uppercase * 2 if case == "upper" else string.ascii_lowercase * 2,
        )
        return value.translate(table)

    macs = rnd.sample(list(claims.macs), len(claims.macs))
    gpus = rnd.sample(list(claims.gpu_uuids), len(claims.gpu_uuids))
    other = wire.Claims(
        product_uuid=recase(claims.product_uuid),
        product_serial=recase(claims.chassis_serial),
        board_serial=recase(claims.product_serial),
        chassis_serial=recase(claims.board_serial),
        macs=tuple(recase(m) for m in macs + macs[:1]),
        gpu_uuids=tuple(recase(g) for g in gpus),
    )
    assert hardware.hardware_key(other) == hardware.hardware_key(claims)


@given(_JSON)
def test_normalize_expect_raises_only_value_error(obj: object) -> None:
    try:
        expect = hardware.normalize_expect(obj)
    except ValueError:
        return
    assert set(expect) <= set(hardware.EXPECT_KEYS)
    assert hardware.normalize_expect(expect) == expect


@given(st.dictionaries(st.sampled_from(hardware.EXPECT_KEYS), _TEXT, max_size=4), _CLAIMS)
def test_expect_matches_never_raises(expect: dict[str, str], claims: wire.Claims) -> None:
    hardware.expect_matches(expect, claims)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=600), min_size=4, max_size=4))
def test_read_claims_of_arbitrary_bytes_round_trips(contents: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = fakesys.make_machine(Path(tmp), macs=[MAC], gpu_uuids=[GPU])
        names = ["sys/class/dmi/id/product_serial", "sys/class/net/eth0/address"]
        names += ["proc/sys/kernel/hostname", "proc/driver/nvidia/gpus/0000:07:00.0/information"]
        for name, data in zip(names, contents, strict=True):
            (root / name).write_bytes(data)
        claims = hardware.read_claims(root)
        assert wire.Claims.from_json(claims.to_json()) == claims
        hardware.hardware_key(claims)
