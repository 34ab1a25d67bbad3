"""Build the bcd artifact for this machine's architecture, and its SHA-256.

    .venv/bin/python packaging/build_artifact.py --out dist [--version 0.1.0]

writes ``dist/bcd/<version>/linux-<arch>`` (the layout ``better-compute serve
--downloads dist`` serves) and ``linux-<arch>.sha256`` beside it, and prints both.

What goes in: bcd and attestors from this checkout, and every distribution bcd
needs (the closure of better-compute-bcd's requirements, without the control
plane's psycopg and psycopg-pool), copied file by file (their RECORD) from the
site-packages of the interpreter running this script: the project's venv, where
``make`` installed them. No network, no pip, about two seconds. The native modules
come with them: cryptography (abi3), tpm2-pytss (abi3, built here against the host's
tpm2-tss) and cffi (for this Python's minor version only), so the artifact runs on
the CPython versions recorded in its manifest (``python_tags``).

Reproducible: entries sorted, every timestamp 1980-01-01, fixed modes; the same
inputs give the same bytes (tests/test_packaging.py builds twice).

Only this machine's architecture can be built: tpm2-pytss has no wheel and is
compiled from source, so an arm64 artifact must be built on an arm64 machine with
``make`` (docs/installing.md). ``--extra-python 3.12`` (repeatable) adds the
version-specific native modules (cffi's backend) for another CPython from PyPI's
wheels of the same versions: the one option that needs the network.

``--with DIST`` (repeatable) bundles a further distribution beside bcd's own, such as
a third party's attestor plugin: a wheel, or a directory with a ``pyproject.toml``
that is built into one here (``pip wheel --no-deps --no-build-isolation --no-index``
in a copy of the directory, with this venv's setuptools: no network). Its files go
into ``lib/`` with its ``dist-info`` (so bcd finds its entry points), it is listed in
the manifest, and it must fit: every requirement it has is met by what the artifact
holds, it overwrites no file of another distribution, and it is pure Python or built
for this machine (its native modules narrow ``python_tags`` like cffi's). As the
launcher puts ``lib/`` first on ``sys.path`` of processes that run as root, it must
not shadow a module either: none of its top-level names (a package, or a module's
name before its first dot) may be another bundled distribution's or the standard
library's (``sys.stdlib_module_names``), it ships no ``.pth`` file and no name with a
backslash, and it registers no ``bcd.attestors`` entry point a bundled distribution
already registers.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import importlib.metadata as md
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NoReturn

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PROJECT = "better-compute-bcd"
PACKAGES = ("bcd", "attestors")
NOT_ON_THE_NODE = frozenset({"psycopg", "psycopg-pool", "psycopg-binary"})
ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
SHEBANG = b"#!/usr/bin/env python3\n"
EPOCH = (1980, 1, 1, 0, 0, 0)
UNITS = ("bcd.service", "bcd-helper.service", "bcd-join.service")
VERSION_RE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+(?:[.+-][0-9A-Za-z.]+)?$")
_NATIVE_TAG = re.compile(r"\.cpython-(\d+)-[^/]*\.so$")
_WHEEL_NAME = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-(?P<plat>[^-]+)\.whl$"
)
_STARTUP_HOOKS = frozenset({"sitecustomize", "usercustomize"})
_NOT_COPIED = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".git", ".venv")


class BuildError(Exception):
    """Why the artifact cannot be built here (one line)."""


@dataclass(frozen=True)
class Artifact:
    path: Path
    sha256: str
    version: str
    arch: str


def host_arch() -> str:
    machine = platform.machine()
    if machine not in ARCHES:
        raise BuildError(f"unsupported machine {machine!r} (amd64 and arm64 only)")
    return ARCHES[machine]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def node_distributions() -> list[md.Distribution]:
    """The installed distributions bcd needs, without better-compute-bcd itself."""
    seen: dict[str, md.Distribution] = {}
    todo = list(md.distribution(PROJECT).requires or [])
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen or name in NOT_ON_THE_NODE:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError as exc:
            raise BuildError(f"{req.name} is not installed here; run make first") from exc
        seen[name] = dist
        todo.extend(dist.requires or [])
    return [seen[k] for k in sorted(seen)]


def _dist_files(dist: md.Distribution) -> Iterator[tuple[str, Path]]:
    for rel in dist.files or []:
        parts = PurePosixPath(str(rel)).parts
        if not parts or parts[0] == ".." or "__pycache__" in parts:
            continue
        name = str(PurePosixPath(*parts))
        if name.endswith(".pyc") or name.endswith(("/RECORD", "/INSTALLER", "/direct_url.json")):
            continue
        yield name, Path(str(dist.locate_file(rel)))


def _tree(package: str) -> Iterator[tuple[str, Path]]:
    for path in sorted((REPO / package).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield path.relative_to(REPO).as_posix(), path


def _project_version() -> str:
    text = (REPO / "bcd" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if not m:
        raise BuildError("bcd/__init__.py has no __version__")
    return m.group(1)


def _dist_info(version: str) -> dict[str, bytes]:
    """A dist-info for better-compute-bcd: what importlib.metadata needs for the plugins."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = ["[console_scripts]", "bcd = bcd.cli:main", ""]
    groups = project.get("entry-points", {})
    for group in sorted(groups):
        if group != "bcd.attestors":
            continue
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in sorted(groups[group].items())]
        lines.append("")
    base = f"better_compute_bcd-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {version}\n"
    return {
        f"{base}/METADATA": metadata.encode(),
        f"{base}/entry_points.txt": "\n".join(lines).encode(),
        f"{base}/top_level.txt": "\n".join(PACKAGES).encode() + b"\n",
    }


def _stamp_version(data: bytes, version: str) -> bytes:
    new = f'__version__ = "{version}"'.encode()
    return re.sub(rb'^__version__ = "[^"]+"$', new, data, count=1, flags=re.M)


def _extra_native(dist: md.Distribution, python: str, cache: Path) -> dict[str, bytes]:
    """The version-specific native modules of ``dist``'s wheel for CPython ``python``.

    ``pip download`` (PyPI: the one step that needs the network) of the same version,
    for this machine's manylinux platform, cached in ``cache``.
    """
    major, _, minor = python.partition(".")
    if not (major == "3" and minor.isdigit() and int(minor) >= 11):
        raise BuildError(f"--extra-python {python!r}: a CPython version like 3.12")
    tag = f"cp3{minor}"
    machine = {"amd64": "x86_64", "arm64": "aarch64"}[host_arch()]
    name = dist.metadata["Name"]
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
         "--platform", f"manylinux2014_{machine}", "--python-version", python,
         "--implementation", "cp", "--abi", tag, "--dest", str(cache),
         f"{name}=={dist.version}"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise BuildError(f"cannot download {name} {dist.version} for {tag}: {why}")
    prefix = f"{_norm(name).replace('-', '_')}-{dist.version}-{tag}-{tag}-"
    wheels = [w for w in cache.glob("*.whl") if w.name.lower().startswith(prefix.lower())]
    if not wheels:
        raise BuildError(f"pip downloaded no {tag} wheel of {name} {dist.version}")
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(sorted(wheels)[-1]) as wheel:
        for member in wheel.namelist():
            m = _NATIVE_TAG.search(member)
            if m and f"cp{m.group(1)}" == tag:
                out[f"lib/{member}"] = wheel.read(member)
    return out


@dataclass(frozen=True)
class Extra:
    """A distribution ``--with`` adds: its name, version, requirements and files
    (``lib/``-relative names to bytes, RECORD left out as for the others)."""

    name: str
    version: str
    requires: tuple[str, ...]
    files: dict[str, bytes]


def wheel_of(source: Path, work: Path) -> Path:
    """``source`` itself when it is a wheel, else the wheel built from the directory."""
    if source.is_file() and source.suffix == ".whl":
        return source
    if not (source / "pyproject.toml").is_file():
        raise BuildError(
            f"--with {source}: neither a wheel (.whl) nor a directory with a pyproject.toml"
        )
    copy = work / "src"
    shutil.copytree(source, copy, ignore=_NOT_COPIED)  # the source tree stays untouched
    out = work / "wheel"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(out), str(copy)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    wheels = sorted(out.glob("*.whl")) if done.returncode == 0 else []
    if len(wheels) != 1:
        why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise BuildError(f"--with {source}: cannot build a wheel: {why}")
    return wheels[0]


def read_wheel(wheel: Path, source: Path | str | None = None) -> Extra:
    """The distribution in ``wheel``, checked to be installable into ``lib/`` here."""
    shown = source or wheel
    m = _WHEEL_NAME.match(wheel.name)
    if not m:
        raise BuildError(f"--with {shown}: {wheel.name} is not a wheel's file name")
    plat = m.group("plat")
    machine = {"amd64": "x86_64", "arm64": "aarch64"}[host_arch()]
    if plat != "any" and not all(p.endswith(machine) and "linux" in p for p in plat.split(".")):
        raise BuildError(f"--with {shown}: built for {plat}, not linux {machine}")
    files: dict[str, bytes] = {}
    metadata = b""
    try:
        with zipfile.ZipFile(wheel) as zf:
            for member in sorted(zf.namelist()):
                if member.endswith("/"):
                    continue
                parts = PurePosixPath(member).parts
                if ".." in parts or member.startswith("/"):
                    raise BuildError(f"--with {shown}: a path outside the wheel: {member}")
                if "\\" in member:
                    raise BuildError(f"--with {shown}: a name with a backslash: {member}")
                if member.endswith(".pth"):
                    raise BuildError(
                        f"--with {shown}: holds {member} (a .pth file), "
                        "which the artifact does not install"
                    )
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        raise BuildError(
                            f"--with {shown}: holds {member} (scripts, data or headers), "
                            "which the artifact does not install"
                        )
                    parts = parts[2:]
                name = str(PurePosixPath(*parts))
                if parts[0].endswith(".dist-info") and parts[-1] == "METADATA":
                    metadata = zf.read(member)
                if (
                    name.endswith(("/RECORD", "/INSTALLER", "/direct_url.json"))
                    or "__pycache__" in parts
                ):
                    continue
                files[f"lib/{name}"] = zf.read(member)
    except (OSError, zipfile.BadZipFile) as exc:
        raise BuildError(f"--with {shown}: not a readable wheel: {exc}") from exc
    meta = email.parser.BytesParser().parsebytes(metadata)
    if not meta.get("Name") or not meta.get("Version"):
        raise BuildError(f"--with {shown}: the wheel has no METADATA with a Name and Version")
    requires = tuple(meta.get_all("Requires-Dist") or ())
    return Extra(str(meta["Name"]), str(meta["Version"]), requires, files)


def top_level_names(files: dict[str, bytes]) -> set[str]:
    """The names ``files`` (``lib/``-relative) make importable from ``lib/``: each
    top-level package, and each top-level module up to its first dot (``ssl.py``,
    ``ssl.abi3.so``: ``ssl``); dist-info directories left out."""
    names = set()
    for name in files:
        parts = PurePosixPath(name).parts
        if len(parts) < 2 or parts[0] != "lib" or parts[1].endswith(".dist-info"):
            continue
        names.add(parts[1] if len(parts) > 2 else parts[1].split(".", 1)[0])
    return names


class _Metadata(md.Distribution):
    """One dist-info of ``files``, read through importlib.metadata's own parsers."""

    def __init__(self, files: dict[str, bytes], dist_info: str) -> None:
        self._files = files
        self._prefix = f"{dist_info}/"

    def read_text(self, filename: str) -> str | None:
        data = self._files.get(self._prefix + filename)
        return None if data is None else data.decode("utf-8", "replace")

    def locate_file(self, path: object) -> NoReturn:
        raise NotImplementedError("an artifact's dist-info has no files on disk")


def attestor_entry_points(files: dict[str, bytes]) -> dict[str, str]:
    """The ``bcd.attestors`` entry points the dist-infos in ``files`` register:
    entry point name -> distribution name."""
    found: dict[str, str] = {}
    infos = {str(PurePosixPath(n).parent) for n in files if n.endswith(".dist-info/METADATA")}
    for info in sorted(infos):
        dist = _Metadata(files, info)
        name = dist.metadata["Name"] or PurePosixPath(info).name
        try:
            eps = dist.entry_points.select(group="bcd.attestors")
        except ValueError as exc:
            raise BuildError(f"{name}: an unreadable entry_points.txt: {exc}") from exc
        for ep in eps:
            found.setdefault(ep.name, name)
    return found


def _check_shadowing(extra: Extra, bundled: dict[str, bytes]) -> None:
    """``extra`` shadows no module of another bundled distribution or of the standard
    library (``lib/`` comes first on the launcher's ``sys.path``), and registers no
    attestor another bundled distribution registers."""
    taken = top_level_names(bundled)
    for top in sorted(top_level_names(extra.files)):
        if top in taken:
            raise BuildError(
                f"--with {extra.name}: its top-level name {top} is another distribution's"
            )
        if top in sys.stdlib_module_names or top in _STARTUP_HOOKS:
            raise BuildError(
                f"--with {extra.name}: its top-level name {top} would shadow the standard library's"
            )
    registered = attestor_entry_points(bundled)
    for name in sorted(attestor_entry_points(extra.files)):
        if name in registered:
            raise BuildError(
                f"--with {extra.name}: attestor {name} is already registered by {registered[name]}"
            )


def _check_requirements(extra: Extra, held: dict[str, str]) -> None:
    """Every requirement of ``extra`` is met by a distribution the artifact holds."""
    versions = {_norm(name): version for name, version in held.items()}
    for line in extra.requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = versions.get(_norm(req.name))
        if have is None:
            raise BuildError(
                f"--with {extra.name}: requires {req.name}, which the artifact does not hold "
                f"(add it with --with)"
            )
        if not req.specifier.contains(have, prereleases=True):
            raise BuildError(f"--with {extra.name}: requires {req}, the artifact holds {have}")


def collect(
    version: str, extra_pythons: tuple[str, ...] = (), extras: tuple[Extra, ...] = ()
) -> tuple[dict[str, bytes], dict[str, str], list[str]]:
    """Every file of the artifact (name -> bytes), the distributions' versions, and the
    CPython tags every version-specific native module is there for ([] = any)."""
    files: dict[str, bytes] = {}
    dists: dict[str, str] = {PROJECT: version}
    tags: set[str] | None = None
    for dist in node_distributions():
        dists[dist.metadata["Name"]] = dist.version
        native = False
        for name, path in _dist_files(dist):
            files[f"lib/{name}"] = path.read_bytes()
            native = native or bool(_NATIVE_TAG.search(name))
        if native:  # modules for one CPython version (cffi's backend)
            own = {f"cp{m.group(1)}" for n, _ in _dist_files(dist) if (m := _NATIVE_TAG.search(n))}
            for python in extra_pythons:
                extra = _extra_native(dist, python, REPO / "build" / "wheels")
                files.update(extra)
                own |= set(python_tags(list(extra)))
            tags = own if tags is None else tags & own
    for package in PACKAGES:
        for name, path in _tree(package):
            data = path.read_bytes()
            if name == "bcd/__init__.py":
                data = _stamp_version(data, version)
            files[f"lib/{name}"] = data
    for name, data in _dist_info(version).items():
        files[f"lib/{name}"] = data
    for extra in extras:
        if _norm(extra.name) in {_norm(n) for n in dists}:
            raise BuildError(f"--with {extra.name}: the artifact already holds {extra.name}")
        clash = sorted(set(extra.files) & set(files))
        if clash:
            raise BuildError(
                f"--with {extra.name}: would overwrite {clash[0]} of another distribution"
            )
        _check_shadowing(extra, files)
        files.update(extra.files)
        dists[extra.name] = extra.version
        own = set(python_tags(list(extra.files)))
        if own:
            tags = own if tags is None else tags & own
    for extra in extras:
        _check_requirements(extra, dists)
    for unit in UNITS:
        files[f"share/systemd/{unit}"] = (REPO / "systemd" / unit).read_bytes()
    files["share/tmpfiles.d/bcd.conf"] = (REPO / "systemd" / "bcd.tmpfiles.conf").read_bytes()
    files["__main__.py"] = (REPO / "packaging" / "artifact_main.py").read_bytes()
    return files, dists, sorted(tags or ())


def python_tags(names: list[str]) -> list[str]:
    """The CPython tags every version-specific native module is there for ([] = any)."""
    tags = {f"cp{m.group(1)}" for n in names if (m := _NATIVE_TAG.search(n))}
    return sorted(tags)


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    buf.write(SHEBANG)
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, EPOCH)
            info.external_attr = 0o644 << 16
            info.create_system = 3
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[name], compresslevel=6)
    return buf.getvalue()


def build(
    out: Path,
    *,
    version: str | None = None,
    arch: str | None = None,
    extra_pythons: tuple[str, ...] = (),
    with_dists: tuple[Path, ...] = (),
) -> Artifact:
    """Write ``out/bcd/<version>/linux-<arch>`` and its ``.sha256``; ``with_dists`` are
    further distributions to bundle (wheels, or directories with a pyproject.toml)."""
    here = host_arch()
    arch = arch or here
    if arch not in ("amd64", "arm64"):
        raise BuildError(f"--arch {arch!r}: amd64 or arm64")
    if arch != here:
        raise BuildError(
            f"cannot build for {arch} on this {here} machine: tpm2-pytss has no {arch} wheel "
            "and is compiled from source, so build on an {arch} machine (docs/installing.md)"
        )
    version = version or _project_version()
    if not VERSION_RE.match(version):
        raise BuildError(f"--version {version!r} is not a version like 1.2.3")
    extras = []
    with tempfile.TemporaryDirectory(prefix="bcd-artifact-") as work:
        for i, source in enumerate(with_dists):
            (Path(work) / str(i)).mkdir()
            extras.append(read_wheel(wheel_of(source, Path(work) / str(i)), source))
    files, dists, tags = collect(version, extra_pythons, tuple(extras))
    manifest = {
        "name": "bcd",
        "version": version,
        "arch": arch,
        "requires_python": ">=3.11",
        "python_tags": tags,
        "distributions": dict(sorted(dists.items())),
    }
    files["bcd-artifact.json"] = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    data = _zip(files)
    digest = hashlib.sha256(data).hexdigest()
    target_dir = out / "bcd" / version
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / f"linux-{arch}"
    for path, content, mode in (
        (target, data, 0o755),
        (target_dir / f"linux-{arch}.sha256", f"{digest}  linux-{arch}\n".encode(), 0o644),
    ):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(content)
        tmp.chmod(mode)
        tmp.replace(path)
    return Artifact(target, digest, version, arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the bcd artifact for this machine")
    parser.add_argument("--out", required=True, help="the downloads directory (DIR/bcd/...)")
    parser.add_argument("--version", help="default: bcd/__init__.py's __version__")
    parser.add_argument("--arch", help="amd64 or arm64 (only this machine's can be built)")
    parser.add_argument(
        "--extra-python",
        action="append",
        default=[],
        metavar="3.X",
        help="also run on CPython 3.X: add the version-specific native modules (cffi's) "
        "from PyPI's wheels of the same versions (needs the network; repeatable)",
    )
    parser.add_argument(
        "--with",
        dest="with_dists",
        action="append",
        default=[],
        metavar="DIST",
        help="also bundle this distribution (a wheel, or a directory with a pyproject.toml), "
        "e.g. a third party's attestor plugin (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        built = build(
            Path(args.out),
            version=args.version,
            arch=args.arch,
            extra_pythons=tuple(args.extra_python),
            with_dists=tuple(Path(d) for d in args.with_dists),
        )
    except BuildError as exc:
        print(f"build_artifact: {exc}", file=sys.stderr)
        return 1
    print(f"{built.path}\nsha256 {built.sha256}\n{built.arch}={built.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
