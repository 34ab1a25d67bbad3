"""Real temporary users for the tests (root only): made with useradd, removed after.

No fake passwd or group files: a test that needs a user in a group, or files owned
by another user, creates a real one named ``bcdtest<random>`` and removes it (and
its primary group) in a ``finally``. Without useradd the test is skipped.
"""

from __future__ import annotations

import pwd
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def temporary_user(groups: tuple[str, ...] = ()) -> Iterator[pwd.struct_passwd]:
    """A new system user (no home, no login) in ``groups``; deleted when the block ends."""
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not available to create a real temporary user")
    name = f"bcdtest{secrets.token_hex(4)}"
    command = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
    if groups:
        command += ["--groups", ",".join(groups)]
    subprocess.run([*command, "--user-group", name], check=True, capture_output=True, timeout=30)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=True, capture_output=True, timeout=30)
