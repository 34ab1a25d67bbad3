"""Run install-bcd.sh for real, as root, without touching this machine's /etc, /usr/local,
/var or /run.

Each run is a new mount namespace (``unshare --mount --propagation private``) in which
those four directories are overlayfs mounts whose upper directories live in the test's
tmp directory. Whatever the script writes lands in the upper directories (where the
test reads it afterwards); the next run mounts the same upper directories again, so a
second run sees the first run's install, as on a real host. Nothing else is isolated:
the network (the control plane on loopback), /tmp and /root are the host's.

The machine is a simulated one (control.simulate.random_machine: a product UUID, a
serial and a MAC, so the join trusts its hardware key): its ``sys/class`` is
bind-mounted over /sys/class, which also hides any TPM. No systemd runs in the
namespace, so ``systemctl`` is a recording stand-in, first on PATH and bind-mounted
over the real one: it appends its arguments, one line per call, to
``systemctl.log``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from control.simulate import random_machine

MOUNTS = {"etc": "/etc", "usr-local": "/usr/local", "var": "/var", "run": "/run"}
STANDARD_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
UNSHARE = ("unshare", "--mount", "--propagation", "private")

SETUP = """
set -eu
sandbox=$1
shift
for pair in etc:/etc usr-local:/usr/local var:/var run:/run; do
    name=${pair%%:*}
    target=${pair#*:}
    mount -t overlay "bcd-test-$name" \
        -o "lowerdir=$target,upperdir=$sandbox/upper/$name,workdir=$sandbox/work/$name" "$target"
done
mount --bind "$sandbox/machine/sys/class" /sys/class
# Whatever PATH a test gives, the real systemctl is never reached from here.
for real in /usr/bin/systemctl /bin/systemctl; do
    if [ -f "$real" ]; then mount --bind "$sandbox/bin/systemctl" "$real"; fi
done
exec "$@"
"""

SYSTEMCTL = """#!/bin/sh
printf '%s\\n' "$*" >> {log}
"""


def missing() -> str | None:
    """Why the sandbox cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the install tests run install-bcd.sh as root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        return f"unshare --mount does not work here: {probe.stderr.decode().strip()}"
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "overlay" not in filesystems:
        subprocess.run(["modprobe", "overlay"], capture_output=True, timeout=30, check=False)
        if "overlay" not in Path("/proc/filesystems").read_text():
            return "overlayfs is not available (modprobe overlay)"
    return None


@dataclass
class Sandbox:
    root: Path

    @classmethod
    def make(cls, root: Path, seed: int = 1) -> Sandbox:
        random_machine(root / "machine", seed)
        for name in MOUNTS:
            (root / "upper" / name).mkdir(parents=True)
            (root / "work" / name).mkdir(parents=True)
        bin_dir = root / "bin"
        bin_dir.mkdir()
        systemctl = bin_dir / "systemctl"
        systemctl.write_text(SYSTEMCTL.format(log=root / "systemctl.log"))
        systemctl.chmod(0o755)
        (root / "tmp").mkdir(mode=0o700)
        return cls(root)

    def upper(self, path: str) -> Path:
        """Where ``path`` (absolute, under one of the four) lands in the upper dirs."""
        for name, mount in MOUNTS.items():
            if path == mount or path.startswith(mount + "/"):
                return self.root / "upper" / name / path[len(mount) :].lstrip("/")
        raise ValueError(f"{path} is not under {', '.join(MOUNTS.values())}")

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a new mount namespace over the upper dirs; PATH has the stand-ins."""
        child_env = {
            "PATH": f"{self.root / 'bin'}:{STANDARD_PATH}",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "TMPDIR": str(self.root / "tmp"),
            **(env or {}),
        }
        return subprocess.run(
            [*UNSHARE, "sh", "-c", SETUP, "sandbox", str(self.root), *argv],
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            env=child_env,
            timeout=timeout,
            check=False,
        )

    def systemctl_calls(self) -> list[str]:
        log = self.root / "systemctl.log"
        return log.read_text().splitlines() if log.exists() else []

    def files(self) -> dict[str, str]:
        """Every path in the upper dirs (as the host path it stands for) and its kind."""
        found: dict[str, str] = {}
        for name, mount in MOUNTS.items():
            base = self.root / "upper" / name
            for dirpath, dirnames, filenames in os.walk(base):
                for entry in [*dirnames, *filenames]:
                    path = Path(dirpath) / entry
                    rel = path.relative_to(base).as_posix()
                    kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
                    found[f"{mount}/{rel}"] = kind
        return found

    def contains(self, needle: bytes) -> list[str]:
        """The files in the upper dirs (and the sandbox's tmp) whose bytes hold ``needle``."""
        hits = []
        for base in (self.root / "upper", self.root / "tmp"):
            for dirpath, _dirs, filenames in os.walk(base):
                for name in filenames:
                    path = Path(dirpath) / name
                    if path.is_symlink() or not path.is_file():
                        continue
                    if needle in path.read_bytes():
                        hits.append(str(path))
        return hits
