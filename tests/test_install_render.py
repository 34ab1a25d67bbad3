"""`better-compute daemon install-script` (control/installscript.py) and the control
plane's downloads route (control/downloads.py)."""

from __future__ import annotations

import http.client
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from bcd import wire
from control.installscript import InstallScriptError, build_values, render, sh_quote
from tests.installfixtures import REPO, start_control_plane
from tests.world import BIN, ControlPlane, cli_env, run

SHA = "ab" * 32
POOL = "pool_" + "0" * 26
SITE = "site_" + "1" * 26


@pytest.fixture(scope="module")
def pins_and_jwk(memory_pki) -> tuple[dict[str, str], dict[str, object]]:  # type: ignore[no-untyped-def]
    jwk = memory_pki.well_known_join()["encryptionJwk"]
    return memory_pki.pins(), jwk


def _values(pins_and_jwk: tuple[dict[str, str], dict[str, object]], **over: str):  # type: ignore[no-untyped-def]
    pins, jwk = pins_and_jwk
    args = {
        "pool": POOL,
        "site": SITE,
        "gateway_url": "https://gw.example.com",
        "base_url": "https://compute.example.com",
        "bcd_version": "0.1.0",
        "sha256": f"amd64={SHA}",
        **over,
    }
    return build_values(pins=pins, join_jwk=jwk, **args)


@pytest.mark.parametrize(
    "value",
    ["plain", "it's", "'", "''", "$(touch /tmp/pwned)", "`id`", "a\nb", "\\", '"; rm -rf /', "!*?"],
)
def test_a_quoted_value_reaches_the_shell_as_it_is(value: str) -> None:
    done = subprocess.run(
        ["sh", "-c", f"printf '%s' {sh_quote(value)}"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    assert done.stdout == value


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sha256", "amd64=" + "0" * 63, "--sha256 amd64: not a SHA-256"),
        ("sha256", "amd64=" + "g" * 64, "--sha256 amd64: not a SHA-256"),
        ("sha256", "riscv=" + SHA, "--sha256: unknown architecture 'riscv'"),
        ("sha256", f"amd64={SHA},amd64={SHA}", "--sha256: amd64 is given twice"),
        ("sha256", SHA, "--sha256: expected ARCH=HEX"),
        ("sha256", f"amd64={SHA}';id;'", "--sha256 amd64: not a SHA-256"),
        ("pool", "pool_$(id)", "--pool: not a pool id"),
        ("site", "site_x' ; reboot ; '", "--site: not a site id"),
        ("bcd_version", "0.1.0; rm -rf /", "--bcd-version: not a version"),
        ("bcd_version", "../../etc", "--bcd-version: not a version"),
        ("base_url", "http://compute.example.com", "http:// is allowed only for a loopback"),
        ("base_url", "ftp://compute.example.com", "--base-url: must be https://host[:port]"),
        ("base_url", "https://compute.example.com/x'$(id)", "--base-url: scheme, host and port"),
        ("base_url", "https://user@compute.example.com", "--base-url: no user, query or fragment"),
        ("base_url", "https://compute.example.com:99999", "--base-url: the port is not"),
        ("base_url", "https://comp$(id).example.com", "--base-url: not a valid host name"),
        ("base_url", "https://compute.example.com\n; id", "--base-url: not a URL"),
        ("gateway_url", "http://gw.example.com", "--gateway-url:"),
        ("gateway_url", "https://gw.example.com/path", "--gateway-url:"),
    ],
)
def test_a_bad_input_is_refused_naming_the_flag(
    pins_and_jwk: tuple[dict[str, str], dict[str, object]], field: str, value: str, message: str
) -> None:
    with pytest.raises(InstallScriptError, match=None) as info:
        _values(pins_and_jwk, **{field: value})
    assert message in str(info.value)


def test_the_rendered_script_carries_the_values_and_parses(
    pins_and_jwk: tuple[dict[str, str], dict[str, object]], tmp_path: Path
) -> None:
    values = _values(pins_and_jwk, base_url="http://127.0.0.1:8080", sha256=f"arm64={SHA}")
    script = render(values)
    path = tmp_path / "install-bcd.sh"
    path.write_text(script)
    assert subprocess.run(["sh", "-n", str(path)], timeout=10, check=False).returncode == 0
    # Everything the block assigns, read back by a real shell.
    block = script[script.index("BCD_VERSION=") : script.index("\nPATH=")]
    names = ["BCD_VERSION", "BASE_URL", "BASE_PATH", "POOL", "SITE", "SHA256_AMD64"]
    names += ["SHA256_ARM64", "CONFIG_TOML", "JOIN_JWK"]
    shown = subprocess.run(
        ["sh", "-c", block + "\n" + "".join(f'printf "%s\\0" "${n}"\n' for n in names)],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout.split("\0")[:-1]
    got = dict(zip(names, shown, strict=True))
    assert got["BCD_VERSION"] == "0.1.0"
    assert got["BASE_URL"] == "http://127.0.0.1:8080"
    assert got["BASE_PATH"] == "/api/compute"
    assert (got["POOL"], got["SITE"]) == (POOL, SITE)
    assert (got["SHA256_AMD64"], got["SHA256_ARM64"]) == ("", SHA)
    assert got["CONFIG_TOML"] == values.config_toml
    assert "[helper]" in got["CONFIG_TOML"]
    assert wire.loads_object(got["JOIN_JWK"].encode()) == pins_and_jwk[1]
    assert "@@RENDERED@@" not in script
    # the repository's install-bcd.sh is the template itself
    assert (REPO / "install-bcd.sh").resolve() == (REPO / "control" / "install-bcd.sh")


def test_the_cli_renders_to_a_file_and_refuses_bad_input_in_one_line(
    sqlite_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = sqlite_control_plane
    base = [str(BIN / "better-compute"), "daemon", "install-script", "--pool", POOL]
    base += ["--site", SITE, "--gateway-url", "https://gw.example.com", "--bcd-version", "0.1.0"]
    out = tmp_path / "install-bcd.sh"
    good = [*base, "--base-url", "https://compute.example.com", "--sha256", f"amd64={SHA}"]
    done = run([*good, "--out", str(out)], env=cli_env(cp.home))
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o755
    text = out.read_text()
    for pin in cp.pins().values():
        assert pin in text
    to_stdout = run(good, env=cli_env(cp.home))
    assert to_stdout.stdout == text
    bad = run(
        [*base, "--base-url", "http://compute.example.com", "--sha256", f"amd64={SHA}"],
        env=cli_env(cp.home),
    )
    assert bad.returncode == 1
    assert bad.stderr == (
        "better-compute: INVALID_ARGUMENT: --base-url: http:// is allowed only for a loopback "
        "address; use https://\n"
    )
    no_secret = run(good, env=cli_env(cp.home, secret=False))
    assert no_secret.returncode == 1
    assert no_secret.stderr.startswith("better-compute: INVALID_CONFIG: set the PKI secret")


@pytest.fixture
def serving(tmp_path: Path, pki_template: Path) -> Iterator[tuple[ControlPlane, bytes]]:
    downloads = tmp_path / "downloads"
    artifact = downloads / "bcd" / "1.2.3" / "linux-amd64"
    artifact.parent.mkdir(parents=True)
    data = bytes(range(256)) * 4099  # a little over 1 MiB: several chunks
    artifact.write_bytes(data)
    (downloads / "secret.txt").write_text("not for download")
    (downloads / "bcd" / "1.2.3" / "linux-arm64").mkdir()  # not a regular file
    cp = start_control_plane(
        tmp_path / "cp", pki_template, f"sqlite:///{tmp_path / 'store.db'}", downloads
    )
    try:
        yield cp, data
    finally:
        cp.stop()


def _get(api: str, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    parsed = urlsplit(api)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=30)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_the_control_plane_serves_the_artifact_and_nothing_else(
    serving: tuple[ControlPlane, bytes],
) -> None:
    cp, data = serving
    status, headers, body = _get(cp.api, "/api/compute/downloads/bcd/1.2.3/linux-amd64")
    assert status == 200
    assert headers["content-type"] == "application/octet-stream"
    assert body == data
    for path in (
        "/api/compute/downloads/bcd/1.2.4/linux-amd64",  # no such version
        "/api/compute/downloads/bcd/1.2.3/linux-arm64",  # a directory, not a file
        "/api/compute/downloads/bcd/1.2.3/linux-riscv64",
        "/api/compute/downloads/bcd/1.2.3/linux-amd64/",
        "/api/compute/downloads/bcd/1.2.3/../../secret.txt",
        "/api/compute/downloads/bcd/..%2f..%2fsecret.txt/linux-amd64",
        "/api/compute/downloads/bcd/1.2.3%2f..%2f..%2f/linux-amd64",
        "/api/compute/downloads/secret.txt",
        "/api/compute/downloads/bcd/%2e%2e/linux-amd64",
        "/api/compute/downloads/bcd//linux-amd64",
    ):
        status, _, body = _get(cp.api, path)
        assert status == 404, path
        assert b"not for download" not in body
        assert wire.loads_object(body)["code"] == "NOT_FOUND"
    assert _get(cp.api, "/api/compute/downloads/bcd/1.2.3/linux-amd64", "POST")[0] == 404


def test_without_downloads_nothing_is_served(sqlite_control_plane: ControlPlane) -> None:
    status, _, _ = _get(sqlite_control_plane.api, "/api/compute/downloads/bcd/0.1.0/linux-amd64")
    assert status == 404


def test_rotate_join_key_changes_only_the_join_encryption_key(
    pki_template: Path, tmp_path: Path
) -> None:
    import shutil

    shutil.copytree(pki_template / "pki", tmp_path / "pki")
    env = cli_env(tmp_path)
    before = run([str(BIN / "better-compute"), "pki", "pins", "--json"], env=env)
    done = run([str(BIN / "better-compute"), "pki", "rotate-join-key"], env=env)
    assert done.returncode == 0, done.stderr
    after = run([str(BIN / "better-compute"), "pki", "pins", "--json"], env=env)
    old, new = wire.loads_object(before.stdout.encode()), wire.loads_object(after.stdout.encode())
    assert old["join_encryption_key_pin"] != new["join_encryption_key_pin"]
    assert {k: v for k, v in old.items() if k != "join_encryption_key_pin"} == {
        k: v for k, v in new.items() if k != "join_encryption_key_pin"
    }
    retired = list((tmp_path / "pki").glob("join-encryption.key.retired-*"))
    assert len(retired) == 1
    assert retired[0].stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "pki" / "join-encryption.key").stat().st_mode & 0o777 == 0o600


def test_the_serving_ca_certificate_is_checked_against_its_pin(  # type: ignore[no-untyped-def]
    pins_and_jwk, memory_pki
) -> None:
    from bcd import pki as bcd_pki
    from control.pki import build_pki

    pem = bcd_pki.cert_pem(memory_pki.serving_ca)
    values = _values(pins_and_jwk, serving_ca_pem=pem)
    assert values.serving_ca_pem + "\n" == pem
    assert f"SERVING_CA_PEM={sh_quote(pem.rstrip())}" in render(values)
    other = build_pki("td.example", datetime.now(UTC)).serving_ca
    with pytest.raises(InstallScriptError) as caught:
        _values(pins_and_jwk, serving_ca_pem=bcd_pki.cert_pem(other))
    assert str(caught.value) == (
        "the PKI's serving CA certificate: its SPKI pin is not serving_ca_spki_pin"
    )
