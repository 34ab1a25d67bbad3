"""A software TPM for the tests: swtpm provisioned in a temporary directory.

``SwTpm.provision(root)`` manufactures a TPM 2.0 as ``../shared/STACK-NOTES.md``
describes (a local CA made by swtpm_localca inside ``root``, an RSA-2048 and an ECC
P-384 EK with certificates in NV, a platform certificate, NVRAM locked, the sha256
PCR bank), then ``start()`` runs ``swtpm socket`` on two consecutive free TCP ports
on 127.0.0.1 (the swtpm TCTI expects the control port at port + 1). Nothing is
written outside ``root``.

swtpm has no resource manager and only three object slots, and it serves one
connection at a time: close every ESAPI context before ``restart()``/``clear()``,
and give each parallel test worker its own instance.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = ("swtpm", "swtpm_setup", "swtpm_localca", "tpm2_clear")
QUIET_TSS2_LOG = "all+NONE"


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def _port_pair() -> int:
    """A port P with P and P + 1 both free on 127.0.0.1 (as far as binding tells)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise RuntimeError("no two consecutive free TCP ports on 127.0.0.1")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaps counts as exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not any(
        line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines()
    )


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["TSS2_LOG"] = QUIET_TSS2_LOG
    env.update(extra or {})
    return env


@dataclass
class SwTpm:
    root: Path
    port: int = 0
    pid: int | None = None
    starts: int = field(default=0)

    # --- layout -----------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def ca_dir(self) -> Path:
        """swtpm_localca's state: the local CA's keys and certificates."""
        return self.root / "ca"

    @property
    def cert_dir(self) -> Path:
        """The EK certificates swtpm_setup wrote out (ek-rsa2048.crt, ek-secp384r1.crt)."""
        return self.root / "certs"

    @property
    def issuer_cert(self) -> Path:
        """The intermediate that signed the EK certificates (PEM)."""
        return self.ca_dir / "issuercert.pem"

    @property
    def root_cert(self) -> Path:
        """The local CA's self-signed root (PEM)."""
        return self.ca_dir / "swtpm-localca-rootca-cert.pem"

    @property
    def ca_bundle(self) -> Path:
        """The manufacturer CA bundle a server trusts: issuer then root (PEM)."""
        return self.root / "manufacturer-ca.pem"

    @property
    def pid_file(self) -> Path:
        return self.root / "swtpm.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "swtpm.log"

    @property
    def tcti(self) -> str:
        return f"swtpm:host=127.0.0.1,port={self.port}"

    # --- life cycle -------------------------------------------------------------------

    @classmethod
    def provision(cls, root: Path) -> SwTpm:
        """Manufacture a fresh TPM state under ``root`` (about a second); not started."""
        tpm = cls(root)
        for d in (tpm.state_dir, tpm.ca_dir, tpm.cert_dir):
            d.mkdir(parents=True, exist_ok=True)
        localca_conf = root / "swtpm-localca.conf"
        localca_conf.write_text(
            f"statedir = {tpm.ca_dir}\n"
            f"signingkey = {tpm.ca_dir / 'signkey.pem'}\n"
            f"issuercert = {tpm.issuer_cert}\n"
            f"certserial = {tpm.ca_dir / 'certserial'}\n"
        )
        localca_options = root / "swtpm-localca.options"
        localca_options.write_text(
            "--platform-manufacturer better-compute-tests\n"
            "--platform-version 2.1\n"
            "--platform-model swtpm\n"
        )
        setup_conf = root / "swtpm_setup.conf"
        setup_conf.write_text(
            "create_certs_tool = /usr/bin/swtpm_localca\n"
            f"create_certs_tool_config = {localca_conf}\n"
            f"create_certs_tool_options = {localca_options}\n"
            "active_pcr_banks = sha256\n"
        )
        result = subprocess.run(
            [
                "swtpm_setup",
                "--tpm2",
                "--tpmstate",
                str(tpm.state_dir),
                "--config",
                str(setup_conf),
                "--create-ek-cert",
                "--create-platform-cert",
                "--lock-nvram",
                "--pcr-banks",
                "sha256",
                "--overwrite",
                "--write-ek-cert-files",
                str(tpm.cert_dir),
                "--logfile",
                str(root / "swtpm_setup.log"),
            ],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            log = (root / "swtpm_setup.log").read_text(errors="replace")
            raise RuntimeError(f"swtpm_setup failed ({result.returncode}):\n{log}\n{result.stderr}")
        tpm.ca_bundle.write_bytes(tpm.issuer_cert.read_bytes() + tpm.root_cert.read_bytes())
        return tpm

    def _spawn(self) -> subprocess.CompletedProcess[str]:
        self.pid_file.unlink(missing_ok=True)
        return subprocess.run(
            [
                "swtpm",
                "socket",
                "--tpm2",
                "--server",
                f"type=tcp,port={self.port},bindaddr=127.0.0.1",
                "--ctrl",
                f"type=tcp,port={self.port + 1},bindaddr=127.0.0.1",
                "--tpmstate",
                f"dir={self.state_dir}",
                "--flags",
                "not-need-init,startup-clear",
                "--log",
                f"file={self.log_file},level=1",
                "--daemon",
                "--pid",
                f"file={self.pid_file}",
            ],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def start(self) -> None:
        """Start swtpm on the ports it had (after a restart) or on new free ones."""
        if self.pid is not None:
            raise RuntimeError("swtpm is running already")
        keep_port = self.port != 0
        deadline = time.monotonic() + 10
        while True:
            if not keep_port:
                self.port = _port_pair()
            result = self._spawn()
            if result.returncode == 0 and self.pid_file.exists():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"swtpm did not start: {result.stderr.strip()}")
            time.sleep(0.1)
        self.pid = int(self.pid_file.read_text().strip())
        self.starts += 1
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port + 1), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop swtpm and wait for its pid to exit (the state stays)."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if not _wait_exit(pid, 10):
            os.kill(pid, signal.SIGKILL)
            if not _wait_exit(pid, 5):  # pragma: no cover
                raise RuntimeError(f"swtpm (pid {pid}) does not exit")

    def restart(self) -> None:
        """Stop and start again with the same state and ports (the same TCTI)."""
        self.stop()
        self.start()

    def clear(self) -> None:
        """TPM2_Clear with the lockout hierarchy: a new owner seed (and endorsement intact)."""
        result = subprocess.run(
            ["tpm2_clear", "-c", "l"],
            env=_env({"TPM2TOOLS_TCTI": self.tcti}),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"tpm2_clear failed: {result.stderr.strip()}")
