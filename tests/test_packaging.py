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

import pytest

from tests.installfixtures import BUILDER, HOST_PYTHON, Built, build_artifact


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
