"""``__main__.py`` of the bcd artifact: ``python3 ARTIFACT unpack DEST`` (stdlib only).

The artifact is a zip file behind a ``#!/usr/bin/env python3`` line. It holds
``bcd-artifact.json`` (the manifest), ``lib/`` (bcd and every distribution it needs,
native extension modules included) and ``share/`` (the systemd units and tmpfiles.d
entry). Native modules cannot be imported from a zip, and a service under
``ProtectSystem=strict`` cannot unpack itself at run time, so install-bcd.sh runs
``unpack`` once, as root, into a new versioned directory:

* ``DEST`` must not exist; everything is written to ``DEST.partial-<pid>`` first and
  renamed into place only when complete and checked, so a failure leaves nothing;
* directories 0755 and files 0644 (the unprivileged bcd user reads them), owned by
  whoever runs it;
* ``bin/bcd``, a launcher whose ``#!`` line names the interpreter running ``unpack``
  with ``-I -S`` (isolated: no PYTHON* variables, no user or host site-packages, so
  only ``lib/`` is imported);
* the pure-Python modules compiled to ``__pycache__`` (the service cannot write there);
* checked: ``bin/bcd version`` must print this version. Whether the TPM libraries
  (tpm2-tss) load is reported as a warning line, not a failure.

``python3 ARTIFACT info`` prints the manifest.
"""

from __future__ import annotations

import compileall
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

MANIFEST = "bcd-artifact.json"
PREFIXES = ("lib/", "share/")

LAUNCHER = '''#!{python} -IS
"""bcd {version} (linux-{arch}), unpacked by install-bcd.sh; runs with {python}."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "lib"))
from bcd.cli import main

sys.exit(main())
'''

TPM_PROBE = "import sys; sys.path.insert(0, sys.argv[1]); import tpm2_pytss"


class UnpackError(Exception):
    """Why the artifact could not be unpacked (one line, printed as is)."""


def _fail(message: str) -> int:
    print(f"bcd artifact: {message}", file=sys.stderr)
    return 1


def _archive() -> zipfile.ZipFile:
    here = os.path.dirname(os.path.abspath(__file__))  # the zip file itself
    try:
        return zipfile.ZipFile(here)
    except (OSError, zipfile.BadZipFile) as exc:
        raise UnpackError(f"{here} is not a readable bcd artifact ({exc})") from exc


def read_manifest(archive: zipfile.ZipFile) -> dict[str, object]:
    try:
        manifest = json.loads(archive.read(MANIFEST))
    except (KeyError, ValueError) as exc:
        raise UnpackError(f"the artifact has no valid {MANIFEST}") from exc
    if not isinstance(manifest, dict):
        raise UnpackError(f"the artifact has no valid {MANIFEST}")
    return manifest


def check_interpreter(manifest: dict[str, object]) -> None:
    """This interpreter must be CPython 3.11+ with a tag the native modules were built for."""
    if sys.version_info < (3, 11) or sys.implementation.name != "cpython":
        raise UnpackError(
            f"bcd needs CPython 3.11 or newer; {sys.executable} is "
            f"{sys.implementation.name} {sys.version.split()[0]}"
        )
    tags = manifest.get("python_tags")
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if isinstance(tags, list) and tags and tag not in tags:
        raise UnpackError(
            f"this bcd artifact holds native modules for {', '.join(map(str, tags))} only, and "
            f"{sys.executable} is {tag}; use a python3 of that version (install-bcd.sh takes "
            "the first of python3, python3.13, python3.12, python3.11 that is 3.11 or newer) "
            "or an artifact built for this Python (docs/installing.md)"
        )


def _members(archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    members = []
    for info in archive.infolist():
        name = PurePosixPath(info.filename)
        if name.is_absolute() or ".." in name.parts or "\\" in info.filename:
            raise UnpackError(f"the artifact holds an unsafe name {info.filename!r}")
        if info.filename.startswith(PREFIXES):
            members.append(info)
    return members


def _extract(archive: zipfile.ZipFile, members: list[zipfile.ZipInfo], root: Path) -> None:
    for info in members:
        target = root / info.filename
        if info.is_dir():
            target.mkdir(mode=0o755, parents=True, exist_ok=True)
            continue
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as out, archive.open(info) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(target, 0o644)
    for directory, _dirs, _files in os.walk(root):
        os.chmod(directory, 0o755)  # noqa: S103 - the bcd user reads the code


def _runnable_by_others(path: str) -> bool:
    """Whether a user who is neither owner nor in the group can run ``path``."""
    real = Path(os.path.realpath(path))
    try:
        if not os.stat(real).st_mode & 0o001:
            return False
        return all(os.stat(p).st_mode & 0o001 for p in real.parents)
    except OSError:
        return False


def _writable_by_others(path: str) -> str | None:
    """The first of ``path`` (resolved) and its parents that anyone but root may change.

    bcd-helper and bcd-join run this interpreter as root: if another user can replace
    it or its standard library, that user runs code as root.
    """
    real = Path(os.path.realpath(path))
    for p in (real, *real.parents):
        try:
            st = os.stat(p)
        except OSError:
            return str(p)
        if st.st_uid != 0 or st.st_mode & 0o022:
            return str(p)
    return None


def _launcher(root: Path, manifest: dict[str, object]) -> Path:
    python = sys.executable
    if not python or any(c.isspace() for c in python) or len(python) > 200:
        raise UnpackError(f"the interpreter path {python!r} cannot be used in a #! line")
    import sysconfig

    for what in (python, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]):
        loose = _writable_by_others(what)
        if loose is not None:
            raise UnpackError(
                f"{loose} can be changed by a user other than root, and the root services "
                f"would run {python} from it; use a system-wide python3 (owned by root)"
            )
    if not _runnable_by_others(python):
        raise UnpackError(
            f"{python} cannot be run by other users (the bcd user runs bcd node with it); "
            "use a system-wide python3"
        )
    launcher = root / "bin" / "bcd"
    launcher.parent.mkdir(mode=0o755, exist_ok=True)
    text = LAUNCHER.format(python=python, version=manifest["version"], arch=manifest["arch"])
    launcher.write_text(text)
    os.chmod(launcher, 0o755)  # noqa: S103 - the bcd user runs it
    return launcher


def _check(launcher: Path, lib: Path, version: str) -> list[str]:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
    done = subprocess.run(
        [str(launcher), "version"], capture_output=True, text=True, env=env, timeout=120
    )
    if done.returncode != 0 or done.stdout.strip() != f"bcd {version}":
        detail = (done.stderr.strip().splitlines() or [done.stdout.strip()])[-1:]
        raise UnpackError(
            f"the unpacked bcd does not run with {sys.executable}: {' '.join(detail)}"
        )
    probe = subprocess.run(
        [sys.executable, "-I", "-S", "-c", TPM_PROBE, str(lib)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
        return [
            "warning: the TPM libraries do not load (" + why + "); bcd runs with file keys "
            "until tpm2-tss is installed (docs/installing.md)"
        ]
    return []


def unpack(dest: Path) -> list[str]:
    """Unpack into ``dest`` (which must not exist); returns warning lines."""
    dest = dest.absolute()
    if os.path.lexists(dest):
        raise UnpackError(f"{dest} exists; unpack never writes over a directory")
    with _archive() as archive:
        manifest = read_manifest(archive)
        check_interpreter(manifest)
        members = _members(archive)
        partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
        old_umask = os.umask(0o022)
        try:
            partial.mkdir(mode=0o755)
            _extract(archive, members, partial)
            launcher = _launcher(partial, manifest)
            lib = partial / "lib"
            compileall.compile_dir(str(lib), quiet=2, workers=0, ddir=str(dest / "lib"))
            warnings = _check(launcher, lib, str(manifest["version"]))
            (partial / MANIFEST).write_bytes(archive.read(MANIFEST))
            os.chmod(partial / MANIFEST, 0o644)
            os.rename(partial, dest)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            os.umask(old_umask)
    return warnings


def main(argv: list[str]) -> int:
    usage = "usage: python3 ARTIFACT unpack DEST | python3 ARTIFACT info"
    try:
        if argv[:1] == ["info"] and len(argv) == 1:
            with _archive() as archive:
                print(json.dumps(read_manifest(archive), indent=2, sort_keys=True))
            return 0
        if argv[:1] == ["unpack"] and len(argv) == 2:
            for warning in unpack(Path(argv[1])):
                print(warning, file=sys.stderr)
            print(f"unpacked to {Path(argv[1]).absolute()}")
            return 0
    except UnpackError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot unpack: {exc}")
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
