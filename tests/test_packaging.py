"""packaging/build_artifact.py and the artifact's own ``unpack`` (packaging/artifact_main.py),
run with the host's python3, not the project's venv."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.installfixtures import BUILDER, HOST_PYTHON, REPO, Built, build_artifact

EXAMPLE_ATTESTOR = REPO / "tests" / "plugins" / "example_attestor"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if not HOST_PYTHON.exists():
        pytest.fail(f"{HOST_PYTHON} is missing (Debian's python3): the artifact runs with it")
    return build_artifact(tmp_path_factory.mktemp("downloads"), "0.1.0")


def _unpack(artifact: Path, dest: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HOST_PYTHON), "-I", "-S", str(artifact), "unpack", str(dest)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
    )


def test_the_build_is_reproducible_and_says_what_it_holds(built: Built, tmp_path: Path) -> None:
    again = build_artifact(tmp_path, "0.1.0")
    assert again.sha256 == built.sha256
    assert again.path.read_bytes() == built.path.read_bytes()
    sums = (built.path.parent / f"{built.path.name}.sha256").read_text()
    assert sums == f"{built.sha256}  {built.path.name}\n"
    assert built.path.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(built.path) as zf:
        names = zf.namelist()
        manifest = json.loads(zf.read("bcd-artifact.json"))
    assert manifest["version"] == "0.1.0"
    assert manifest["arch"] == built.arch
    assert manifest["python_tags"] == [f"cp{sys.version_info[0]}{sys.version_info[1]}"]
    dists = manifest["distributions"]
    for needed in ("cryptography", "trio", "jwcrypto", "tpm2-pytss", "tlslite-ng", "pluggy"):
        assert needed in dists
    assert not any(name.startswith("psycopg") for name in dists)  # the control plane's
    assert not any(n.startswith(("lib/control/", "lib/psycopg")) for n in names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert "share/systemd/bcd.service" in names
    assert "share/tmpfiles.d/bcd.conf" in names


def test_the_host_python_unpacks_it_and_runs_bcd(built: Built, tmp_path: Path) -> None:
    dest = tmp_path / "lib" / "0.1.0"
    dest.parent.mkdir()
    done = _unpack(built.path, dest)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"unpacked to {dest}"
    assert [p.name for p in dest.parent.iterdir()] == ["0.1.0"]  # no partial left
    launcher = dest / "bin" / "bcd"
    assert launcher.read_text().splitlines()[0] == f"#!{HOST_PYTHON} -IS"
    version = subprocess.run(
        [str(launcher), "version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert version.stdout == "bcd 0.1.0\n", version.stderr
    # the plugins load from the artifact's own metadata; the code is compiled already
    doctor = subprocess.run(
        [str(launcher), "doctor", "--config", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "ok    plugins   attestors:" in doctor.stdout
    assert "join-token" in doctor.stdout
    assert list((dest / "lib" / "bcd").glob("__pycache__/cli.*.pyc"))
    # readable and runnable by others (the bcd user), writable by none
    for path in [dest, *dest.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        assert mode & 0o022 == 0, path
        assert mode & 0o004, path

    again = _unpack(built.path, dest)
    assert again.returncode == 1
    assert again.stderr == f"bcd artifact: {dest} exists; unpack never writes over a directory\n"


def test_another_architecture_cannot_be_built_here(tmp_path: Path) -> None:
    other = "arm64" if os.uname().machine in ("x86_64", "amd64") else "amd64"
    done = subprocess.run(
        [sys.executable, str(BUILDER), "--out", str(tmp_path), "--arch", other],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith(f"build_artifact: cannot build for {other} on this")
    assert "tpm2-pytss has no" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_interpreter_the_native_modules_were_not_built_for_is_refused(
    built: Built, tmp_path: Path
) -> None:
    # the same artifact with a manifest naming another CPython
    with zipfile.ZipFile(built.path) as src:
        manifest = json.loads(src.read("bcd-artifact.json"))
        manifest["python_tags"] = ["cp399"]
        other = tmp_path / "other"
        with zipfile.ZipFile(other, "w") as dst:
            for info in src.infolist():
                data = src.read(info.filename)
                if info.filename == "bcd-artifact.json":
                    data = json.dumps(manifest).encode()
                dst.writestr(info, data)
    done = _unpack(other, tmp_path / "dest")
    assert done.returncode == 1
    assert done.stderr.startswith(
        "bcd artifact: this bcd artifact holds native modules for cp399 only, and "
        f"{HOST_PYTHON} is cp3"
    )
    assert not (tmp_path / "dest").exists()


def test_unpack_refuses_an_interpreter_another_user_could_change(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "artifact_main", Path(__file__).parents[1] / "packaging" / "artifact_main.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._writable_by_others("/usr/bin/python3") is None
    loose = tmp_path / "python3"
    loose.write_text("")
    loose.chmod(0o755)
    assert module._writable_by_others(str(loose)) is not None  # /tmp is world-writable
    owned = tmp_path / "mine"
    owned.mkdir(mode=0o755)
    (owned / "python3").write_text("")
    os.chown(owned / "python3", 65534, 65534)
    assert module._writable_by_others(str(owned / "python3")) == str(owned / "python3")


# --- --with DIST: a further distribution, such as a third party's attestor ----------


def _builder() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_artifact", BUILDER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_artifact", module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A hand-made wheel: ``files`` plus a dist-info for ``acme-x`` 1.0."""
    meta = "Metadata-Version: 2.1\nName: acme-x\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("acme_x-1.0.dist-info/METADATA", meta)
        zf.writestr("acme_x-1.0.dist-info/RECORD", "")
    return path


def test_with_bundles_a_third_party_attestor_the_unpacked_bcd_loads(tmp_path: Path) -> None:
    built = build_artifact(tmp_path / "a", "0.1.0", EXAMPLE_ATTESTOR)
    again = build_artifact(tmp_path / "b", "0.1.0", EXAMPLE_ATTESTOR)
    assert again.path.read_bytes() == built.path.read_bytes()  # still reproducible
    assert not (EXAMPLE_ATTESTOR / "build").exists()  # built in a copy
    with zipfile.ZipFile(built.path) as zf:
        names = zf.namelist()
        manifest = json.loads(zf.read("bcd-artifact.json"))
        entry_points = zf.read("lib/bcd_example_attestor-0.1.0.dist-info/entry_points.txt")
    assert manifest["distributions"]["bcd-example-attestor"] == "0.1.0"
    assert "lib/bcd_example_attestor/__init__.py" in names
    assert b"serial-allowlist = bcd_example_attestor" in entry_points
    assert not any(n.endswith("/RECORD") for n in names)

    dest = tmp_path / "unpacked"
    assert _unpack(built.path, dest).returncode == 0
    doctor = subprocess.run(
        [str(dest / "bin" / "bcd"), "doctor", "--config", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    (line,) = [ln for ln in doctor.stdout.splitlines() if "plugins" in ln]
    assert line.startswith("ok    plugins   attestors:"), doctor.stdout
    assert "serial-allowlist" in line


@pytest.mark.parametrize(
    ("files", "requires", "problem"),
    [
        ({"acme_x/__init__.py": ""}, ("acme-missing>=1",),
         "--with acme-x: requires acme-missing, which the artifact does not hold (add it with --with)"),
        ({"acme_x/__init__.py": ""}, ("pluggy<1",), "--with acme-x: requires pluggy<1, the artifact holds"),
        ({"bcd/cli.py": "print('mine')"}, (),
         "--with acme-x: would overwrite lib/bcd/cli.py of another distribution"),
        ({"acme_x-1.0.data/scripts/acme": ""}, (),
         "holds acme_x-1.0.data/scripts/acme (scripts, data or headers), which the artifact does not install"),
        ({"../escape.py": ""}, (), "a path outside the wheel: ../escape.py"),
        # lib/ comes first on sys.path of root processes: nothing may shadow a module
        ({"bcd/tls.abi3.so": ""}, (), "--with acme-x: its top-level name bcd is another distribution's"),
        ({"bcd/plugins/__init__.py": ""}, (), "its top-level name bcd is another distribution's"),
        ({"attestors.py": ""}, (), "its top-level name attestors is another distribution's"),
        ({"cryptography/acme_backdoor.py": ""}, (), "its top-level name cryptography is another distribution's"),
        ({"_cffi_backend.abi3.so": ""}, (), "its top-level name _cffi_backend is another distribution's"),
        ({"ssl.py": ""}, (), "--with acme-x: its top-level name ssl would shadow the standard library's"),
        ({"json/__init__.py": ""}, (), "its top-level name json would shadow the standard library's"),
        ({"acme_x-1.0.data/purelib/os.py": ""}, (), "its top-level name os would shadow the standard library's"),
        ({"sitecustomize.py": ""}, (), "its top-level name sitecustomize would shadow"),
        ({"acme_x.pth": "import acme_x"}, (), "holds acme_x.pth (a .pth file), which the artifact does not install"),
        ({"acme_x\\evil.py": ""}, (), "--with acme_x-1.0-py3-none-any.whl: a name with a backslash: acme_x\\evil.py"),
        ({"acme_x/__init__.py": "", "acme_x-1.0.dist-info/entry_points.txt": "[bcd.attestors]\njoin-token = acme_x\n"},
         (), "--with acme-x: attestor join-token is already registered by better-compute-bcd"),
    ],
)  # fmt: skip
def test_with_refuses_a_distribution_that_does_not_fit(
    tmp_path: Path, files: dict[str, str], requires: tuple[str, ...], problem: str
) -> None:
    wheel = _wheel(tmp_path / "acme_x-1.0-py3-none-any.whl", files, requires)
    builder = _builder()
    with pytest.raises(builder.BuildError) as info:
        builder.build(tmp_path / "out", with_dists=(wheel,))
    assert problem in str(info.value).replace(str(tmp_path) + "/", "")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_with_bundles_a_distribution_of_its_own_names_and_attestors(tmp_path: Path) -> None:
    """What does not shadow anything fits: its own package, its own module, its own
    attestor name, an auditwheel ``.libs`` directory."""
    files = {
        "acme_x/__init__.py": "",
        "acme_x_helpers.py": "",
        "acme_x.libs/libacme.so": "",
        "acme_x-1.0.dist-info/entry_points.txt": "[bcd.attestors]\nacme = acme_x\n",
    }
    builder = _builder()
    extra = builder.read_wheel(_wheel(tmp_path / "acme_x-1.0-py3-none-any.whl", files))
    bundled, dists, _ = builder.collect("0.1.0", (), (extra,))
    assert dists["acme-x"] == "1.0"
    assert builder.attestor_entry_points(bundled)["acme"] == "acme-x"
    assert builder.attestor_entry_points(bundled)["join-token"] == "better-compute-bcd"
    assert {"acme_x", "acme_x_helpers", "acme_x.libs", "bcd", "attestors"} <= (
        builder.top_level_names(bundled)
    )


def test_with_refuses_what_is_neither_a_wheel_nor_a_project(tmp_path: Path) -> None:
    builder = _builder()
    with pytest.raises(builder.BuildError) as info:
        builder.build(tmp_path / "out", with_dists=(tmp_path,))
    assert str(info.value) == (
        f"--with {tmp_path}: neither a wheel (.whl) nor a directory with a pyproject.toml"
    )
    other = "aarch64" if os.uname().machine == "x86_64" else "x86_64"
    wheel = _wheel(tmp_path / f"acme_x-1.0-cp311-cp311-manylinux_2_17_{other}.whl", {})
    with pytest.raises(builder.BuildError) as info:
        builder.build(tmp_path / "out", with_dists=(wheel,))
    assert (
        str(info.value)
        == f"--with {wheel}: built for manylinux_2_17_{other}, not linux {os.uname().machine}"
    )
    done = subprocess.run(
        [sys.executable, str(BUILDER), "--out", str(tmp_path / "out"), "--with", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        1,
        f"build_artifact: --with {tmp_path}: neither a wheel (.whl) nor a directory with a "
        "pyproject.toml\n",
    )
