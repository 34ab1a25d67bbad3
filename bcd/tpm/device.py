"""One ESAPI connection to a TPM, with every transient handle flushed.

Synchronous: callers run it in a worker thread (``trio.to_thread.run_sync``). A
:class:`Tpm` serialises its operations with a lock. There may be no resource
manager between bcd and the TPM (swtpm, ``/dev/tpm0``) and a TPM has only a few
object slots, so every object loaded here is flushed when the operation ends, and
:func:`open_tpm` flushes whatever a previous process left behind.

tpm2-pytss exceptions never leave this package: they become :class:`TpmError`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tpm2_pytss import ESAPI, TPM2B_PUBLIC, TPM2B_SENSITIVE_CREATE, TPMT_PUBLIC
from tpm2_pytss.constants import ESYS_TR, TPM2_CAP, TPM2_HC, TPM2_PT_NV, TPMA_NV
from tpm2_pytss.TSS2_Exception import TSS2_Exception

from bcd.tpm import TpmError

OWNER = "owner"
ENDORSEMENT = "endorsement"
_HIERARCHIES = {OWNER: ESYS_TR.OWNER, ENDORSEMENT: ESYS_TR.ENDORSEMENT}

_RC_OBJECT_MEMORY = 0x902
_RC_SESSION_MEMORY = 0x903
_TCTI_LAYER = 0x0A0000
_LAYER_MASK = 0xFF0000
_DEFAULT_NV_BUFFER = 512


def describe(exc: TSS2_Exception, what: str, tcti: str) -> str:
    """One line for a failed TPM command."""
    rc = int(exc.rc)
    if rc & _LAYER_MASK == _TCTI_LAYER:
        return f"cannot reach the TPM at {tcti} ({what}: {exc})"
    if rc & 0xFFFF in (_RC_OBJECT_MEMORY, _RC_SESSION_MEMORY):
        return (
            f"the TPM has no free slot for {what}: another program holds transient "
            "handles or sessions"
        )
    return f"the TPM refused {what}: {exc}"


@dataclass(frozen=True, slots=True)
class Loaded:
    """A transient object: its ESYS handle, marshalled TPMT_PUBLIC and name."""

    handle: Any
    public: bytes
    name: bytes


class Tpm:
    """An open ESAPI context; use :func:`open_tpm`."""

    def __init__(self, esapi: ESAPI, tcti: str) -> None:
        self._esapi = esapi
        self.tcti = tcti
        self._lock = threading.RLock()
        self._nv_buffer_max = 0
        self._closed = False

    @property
    def esapi(self) -> Any:
        """The ESAPI context; use it only inside :meth:`op`."""
        if self._closed:
            raise TpmError("the TPM connection is closed")
        return self._esapi

    @contextmanager
    def op(self, what: str) -> Iterator[Any]:
        """Hold the connection for one operation; TSS2 failures become TpmError."""
        with self._lock:
            esapi = self.esapi
            try:
                yield esapi
            except TSS2_Exception as exc:
                raise TpmError(describe(exc, what, self.tcti)) from exc

    # --- handles --------------------------------------------------------------------

    def _list_handles(self, first: int) -> list[int]:
        handles: list[int] = []
        prop = first
        more = True
        while more:
            more, data = self.esapi.get_capability(TPM2_CAP.HANDLES, prop, 64)
            found = [int(h) for h in data.data.handles]
            handles.extend(found)
            if not found:
                break
            prop = found[-1] + 1
        return handles

    def flush_leftovers(self) -> int:
        """Flush every transient object and loaded session in the TPM; return how many."""
        count = 0
        with self.op("flushing leftover handles") as esapi:
            for first in (TPM2_HC.TRANSIENT_FIRST, TPM2_HC.LOADED_SESSION_FIRST):
                for handle in self._list_handles(int(first)):
                    tr = esapi.tr_from_tpmpublic(handle)
                    esapi.flush_context(tr)
                    count += 1
        return count

    def flush(self, handle: Any) -> None:
        with self.op("FlushContext") as esapi:
            esapi.flush_context(handle)

    @contextmanager
    def primary(self, hierarchy: str, template: bytes) -> Iterator[Loaded]:
        """CreatePrimary from a marshalled TPMT_PUBLIC template; flushed on exit."""
        public, used = TPMT_PUBLIC.unmarshal(template)
        if used != len(template):  # pragma: no cover - templates are built in bcd
            raise TpmError("a key template has trailing bytes")
        with self._lock:
            with self.op("CreatePrimary") as esapi:
                handle, out_public, _, _, _ = esapi.create_primary(
                    TPM2B_SENSITIVE_CREATE(),
                    TPM2B_PUBLIC(publicArea=public),
                    _HIERARCHIES[hierarchy],
                )
            try:
                with self.op("CreatePrimary"):
                    name = bytes(esapi.tr_get_name(handle))
                yield Loaded(handle, bytes(out_public.publicArea.marshal()), name)
            except BaseException:
                with contextlib.suppress(TSS2_Exception):  # report the first failure
                    esapi.flush_context(handle)
                raise
            with self.op("FlushContext"):
                esapi.flush_context(handle)

    # --- NV -------------------------------------------------------------------------

    def nv_indices(self) -> frozenset[int]:
        """The NV indices the TPM defines."""
        with self.op("listing NV indices"):
            return frozenset(self._list_handles(int(TPM2_HC.NV_INDEX_FIRST)))

    def _buffer_max(self) -> int:
        if not self._nv_buffer_max:
            _, data = self.esapi.get_capability(TPM2_CAP.TPM_PROPERTIES, TPM2_PT_NV.BUFFER_MAX, 1)
            props = [
                p.value for p in data.data.tpmProperties if p.property == TPM2_PT_NV.BUFFER_MAX
            ]
            self._nv_buffer_max = int(props[0]) if props else _DEFAULT_NV_BUFFER
        return self._nv_buffer_max

    def nv_read(self, index: int, limit: int = 16384) -> bytes:
        """The whole content of an NV index (at most ``limit`` bytes)."""
        with self.op(f"reading NV index 0x{index:08x}") as esapi:
            nvh = esapi.tr_from_tpmpublic(index)
            try:
                nv_public, _ = esapi.nv_read_public(nvh)
                attributes = int(nv_public.nvPublic.attributes)
                size = int(nv_public.nvPublic.dataSize)
                if size > limit:
                    raise TpmError(f"NV index 0x{index:08x} holds more than {limit} bytes")
                if attributes & TPMA_NV.AUTHREAD:
                    auth = nvh
                elif attributes & TPMA_NV.OWNERREAD:
                    auth = ESYS_TR.OWNER
                elif attributes & TPMA_NV.PPREAD:
                    auth = ESYS_TR.PLATFORM
                else:
                    raise TpmError(f"NV index 0x{index:08x} is not readable")
                step = self._buffer_max()
                out = b""
                while len(out) < size:
                    chunk = bytes(
                        esapi.nv_read(nvh, min(step, size - len(out)), len(out), auth_handle=auth)
                    )
                    if not chunk:  # pragma: no cover - a TPM answering nothing
                        raise TpmError(f"NV index 0x{index:08x} reads short")
                    out += chunk
                return out
            finally:
                esapi.tr_close(nvh)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._esapi.close()


_DEVICE_TCTIS = ("device", "libtss2-tcti-device.so", "libtss2-tcti-device.so.0")
_DEFAULT_DEVICE = "/dev/tpm0"


def missing_device(tcti: str) -> str | None:
    """Why a ``device:`` TCTI names no TPM (its device node does not exist), else None.

    Lets a caller that only probes for a TPM (``[tpm] mode = auto``) skip opening a
    TPM that cannot be there, and the TSS library's error lines with it. Any other
    TCTI (or a device that exists) gives None: open it to find out.
    """
    name, _, conf = tcti.partition(":")
    if name not in _DEVICE_TCTIS:
        return None
    path = conf or _DEFAULT_DEVICE
    return None if os.path.exists(path) else f"no TPM device {path}"


@contextmanager
def open_tpm(tcti: str) -> Iterator[Tpm]:
    """Open the TPM named by a tpm2-tools style TCTI string and flush its leftovers."""
    if not isinstance(tcti, str) or not tcti or "\0" in tcti:
        raise TpmError("the TPM's TCTI is not a TCTI string")
    try:
        esapi = ESAPI(tcti)
    except TSS2_Exception as exc:
        raise TpmError(f"cannot open the TPM at {tcti}: {exc}") from exc
    tpm = Tpm(esapi, tcti)
    try:
        tpm.flush_leftovers()
        yield tpm
    finally:
        tpm.close()
