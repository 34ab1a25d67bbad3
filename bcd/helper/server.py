"""``bcd helper``: the root process that alone opens the TPM and serves the node over a socket.

The socket (``[helper] socket``) is a Unix stream socket, 0660 root:<the [helper]
user's group>, in a directory owned by root and writable only by root (created
0755 when missing). It is bound under a temporary name, given its owner and mode,
then renamed into place, so it never appears with other permissions and a stale
socket from a killed helper is replaced in one step; a socket a live helper still
answers on is left alone and the start fails.

Every connection's peer is read with SO_PEERCRED: only root and the ``[helper]``
user may use the helper; anyone else gets a ``forbidden`` answer, is logged and
disconnected. Requests (:mod:`bcd.helper.protocol`) are answered in order, one
line each; a bad request gets an error answer and the connection stays usable, a
line over 64 KiB is refused and the connection closed. Nothing internal reaches a
peer: a failure that is not a :class:`~bcd.tpm.TpmError` is logged and answered
``internal``.

The TPM: one connection (:func:`bcd.tpm.device.open_tpm`, which flushes what an
earlier process left loaded), used from a worker thread under one lock. Keys are
derived only from the node-key template (a record with another template does not
parse) and from bcd's AK template; every object loaded is flushed when its call
ends. Nothing is cached, so ``tpm.release`` only validates its record and answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import secrets
import signal
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import trio

from bcd import systemd, wire
from bcd.config import Config, TpmMode
from bcd.errors import BcdError
from bcd.helper import HelperError
from bcd.helper.protocol import (
    FORBIDDEN,
    INTERNAL,
    KEY_MISMATCH,
    MAX_LINE,
    NO_TPM,
    TOO_LARGE,
    TPM_FAILED,
    AkCall,
    AkResult,
    CertifyCall,
    CertifyResult,
    InfoCall,
    InfoResult,
    LineBuffer,
    NodeKeyCall,
    NodeKeyResult,
    ProtocolError,
    ReleaseResult,
    Request,
    Result,
    SignCall,
    SignResult,
    encode_error,
    encode_result,
    parse_request,
)
from bcd.identity import JOIN_RECORD_FILE
from bcd.pki import spki_der
from bcd.tpm import TpmError, TpmKeyMismatch
from bcd.tpm.ak import ak_public, certify
from bcd.tpm.device import Tpm, open_tpm
from bcd.tpm.nodekey import public_key_of, sign

log = logging.getLogger("bcd.helper")

SOCKET_MODE = 0o660
DIR_MODE = 0o755
IDLE_TIMEOUT = 120.0
MAX_CONNECTIONS = 32
HANG_UP_DRAIN = 1.0
_SUN_PATH_MAX = 107
_UCRED = struct.Struct("3i")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HelperSettings:
    """What the helper serves and to whom, resolved from config.toml."""

    socket: Path
    allowed_uids: frozenset[int]
    socket_gid: int
    tcti: str
    tpm_mode: TpmMode = "required"
    node_id: str = ""


MAX_JOIN_RECORD = 64 * 1024
NODE_ID = re.compile(r"node_[0-9a-z]{26}")


def read_join_record(hostconfig_dir: Path, signing_key_pin: str) -> str:
    """The node id of root's join record (``join-response.jws``), verified under the pin.

    "" when there is none yet (bcd join has not run as root). A record that is not a
    root-owned regular file, that others can write, or whose signature or body does
    not verify stops the helper: it must not serve keys for a node it cannot name.
    """
    path = hostconfig_dir / JOIN_RECORD_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise HelperError(f"cannot read root's join record {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise HelperError(
                f"root's join record {path} is not a regular file owned by root and "
                "writable only by root; run bcd join again as root"
            )
        data = f.read(MAX_JOIN_RECORD + 1)
    try:
        if len(data) > MAX_JOIN_RECORD:
            raise wire.WireError("too large")
        body = wire.verify_response(data.decode("ascii").strip(), signing_key_pin)
        node_id = body.get("node_id")
        if body.get("kind") not in ("joined", "renewed") or not isinstance(node_id, str):
            raise wire.WireError("not a join answer")
        if not NODE_ID.fullmatch(node_id):
            raise wire.WireError("not a node id")
    except (wire.WireError, UnicodeDecodeError, ValueError) as exc:
        raise HelperError(
            f"root's join record {path} does not verify under join_signing_key_pin; "
            "run bcd join again as root"
        ) from exc
    return node_id


def settings_from_config(cfg: Config) -> HelperSettings:
    """Resolve ``[helper]`` and ``[tpm]``: the helper user's uid and group, the socket."""
    if cfg.helper is None:
        raise HelperError(
            f"{cfg.path} has no [helper] table; bcd helper serves only a node configured with one"
        )
    try:
        user = pwd.getpwnam(cfg.helper.user)
    except KeyError as exc:
        raise HelperError(
            f"no user named {cfg.helper.user!r} ([helper] user in {cfg.path})"
        ) from exc
    return HelperSettings(
        socket=cfg.helper.socket,
        allowed_uids=frozenset({0, user.pw_uid}),
        socket_gid=user.pw_gid,
        tcti=cfg.tpm.tcti,
        tpm_mode=cfg.tpm.mode,
        node_id=read_join_record(cfg.helper.hostconfig_dir, cfg.join_signing_key_pin),
    )


# --- the TPM side -----------------------------------------------------------------


class TpmService:
    """The helper's one TPM connection; each call runs in a worker thread under a lock.

    ``tpm`` is None when the machine's TPM is off or unusable (``unavailable`` says
    why); every TPM method is then answered ``no-tpm``.
    """

    def __init__(self, tpm: Tpm | None, unavailable: str = "", node_id: str = "") -> None:
        self._tpm = tpm
        self._unavailable = unavailable
        self._lock = trio.Lock()
        self.node_id = node_id
        """The node of root's join record ("" without one), which ``helper.info`` tells."""

    async def _run(self, fn: Callable[[Tpm], T]) -> T:
        tpm = self._tpm
        if tpm is None:
            raise ProtocolError(NO_TPM, self._unavailable)
        async with self._lock:
            return await trio.to_thread.run_sync(fn, tpm)

    async def answer(self, request: Request) -> Result:
        call = request.call
        if isinstance(call, NodeKeyCall):
            public = await self._run(lambda t: public_key_of(t, call.record))
            return NodeKeyResult(public.public_area, spki_der(public.public_key))
        if isinstance(call, SignCall):
            return SignResult(await self._run(lambda t: sign(t, call.record, call.digest)))
        if isinstance(call, AkCall):
            return AkResult(*await self._run(ak_public))
        if isinstance(call, CertifyCall):
            attest, signature = await self._run(
                lambda t: certify(t, call.record, call.qualifying_data)
            )
            return CertifyResult(attest, signature)
        if isinstance(call, InfoCall):
            return InfoResult(self.node_id.encode("ascii"))
        # tpm.release: nothing is cached (every handle is flushed when its call ends),
        # so there is nothing to forget; the record was validated when it parsed.
        if self._tpm is None:
            raise ProtocolError(NO_TPM, self._unavailable)
        return ReleaseResult()


# --- connections --------------------------------------------------------------------


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """The peer's (pid, uid, gid) as the kernel recorded them when it connected."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(data)
    return pid, uid, gid


class HelperServer:
    """Serves connections: the peer check, then requests answered in order."""

    def __init__(self, service: TpmService, allowed_uids: frozenset[int]) -> None:
        self._service = service
        self._allowed = allowed_uids
        self._connections = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        """One connection; never raises (a failure is logged and the connection closed)."""
        try:
            async with stream:
                if self._connections >= MAX_CONNECTIONS:
                    log.warning("refused a connection: %d connections are open", MAX_CONNECTIONS)
                    return
                self._connections += 1
                try:
                    await self._serve(stream)
                finally:
                    self._connections -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("a helper connection failed")

    async def _serve(self, stream: trio.SocketStream) -> None:
        pid, uid, gid = peer_credentials(stream.socket)
        if uid not in self._allowed:
            log.warning("refused pid %d (uid %d, gid %d): not the [helper] user", pid, uid, gid)
            await stream.send_all(
                encode_error(None, FORBIDDEN, f"uid {uid} may not use bcd helper")
            )
            await _hang_up(stream)
            return
        buffer = LineBuffer()
        while True:
            try:
                line = buffer.next_line()
            except ProtocolError as exc:
                log.warning("pid %d (uid %d) sent a line over the limit; closing", pid, uid)
                await stream.send_all(encode_error(None, TOO_LARGE, str(exc)))
                await _hang_up(stream)
                return
            if line is None:
                data = b""
                with trio.move_on_after(IDLE_TIMEOUT):
                    data = await stream.receive_some(16384)
                if not data:
                    return  # closed by the peer, or idle too long
                buffer.feed(data)
                continue
            await stream.send_all(await self._answer(line, pid, uid))

    async def _answer(self, line: bytes, pid: int, uid: int) -> bytes:
        try:
            request = parse_request(line)
        except ProtocolError as exc:
            log.info("pid %d (uid %d): bad request: %s", pid, uid, exc)
            return encode_error(exc.request_id, exc.code, str(exc))
        method = request.call.method
        try:
            return encode_result(request.id, await self._service.answer(request))
        except ProtocolError as exc:
            return encode_error(request.id, exc.code, str(exc))
        except TpmKeyMismatch as exc:
            log.warning("%s for pid %d: %s", method, pid, exc)
            return encode_error(request.id, KEY_MISMATCH, str(exc))
        except TpmError as exc:
            log.warning("%s for pid %d failed: %s", method, pid, exc)
            return encode_error(request.id, TPM_FAILED, str(exc))
        except Exception:
            log.exception("%s for pid %d failed", method, pid)
            return encode_error(request.id, INTERNAL, f"bcd helper failed on {method}; see its log")


async def _hang_up(stream: trio.SocketStream) -> None:
    """End the connection after a last answer without resetting it.

    Closing a socket with unread input makes the kernel reset the connection, and
    the peer may then lose the answer; so the input is drained for a moment first.
    """
    await stream.send_eof()
    drained = 0
    with trio.move_on_after(HANG_UP_DRAIN):
        while drained <= MAX_LINE:
            data = await stream.receive_some(16384)
            if not data:
                break
            drained += len(data)


# --- the socket ---------------------------------------------------------------------


def _check_directory(directory: Path) -> None:
    """Create the socket's directory 0755, or check an existing one is root's alone."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(parents=True, mode=DIR_MODE)
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise HelperError(f"{directory} (the helper socket's directory) is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise HelperError(
            f"{directory} (the helper socket's directory) must be owned by root and "
            "writable by no one else"
        )


def _check_stale(path: Path) -> None:
    """Leave nothing or a dead socket at ``path``; refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise HelperError(f"{path} exists and is not a socket; remove it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale: the rename in bind_socket replaces it
        except OSError as exc:
            raise HelperError(f"cannot tell whether {path} is in use: {exc.strerror}") from exc
    raise HelperError(f"another bcd helper is serving at {path}")


async def bind_socket(path: Path, gid: int) -> tuple[trio.socket.SocketType, tuple[int, int]]:
    """A listening socket at ``path`` (0660 root:``gid``); returns it and its (dev, inode)."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise HelperError(f"the helper socket path {path} is too long for a Unix socket")
    _check_directory(path.parent)
    await trio.to_thread.run_sync(_check_stale, path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    if len(os.fsencode(tmp)) > _SUN_PATH_MAX:
        raise HelperError(f"the helper socket path {path} is too long for a Unix socket")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(str(tmp))
        try:
            os.chown(tmp, 0, gid, follow_symlinks=False)
            os.chmod(tmp, SOCKET_MODE, follow_symlinks=False)
            st = os.lstat(tmp)
            sock.listen(64)
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        sock.close()
        raise HelperError(f"cannot listen at {path}: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock, (st.st_dev, st.st_ino)


def _remove_socket(path: Path, identity: tuple[int, int]) -> None:
    """Unlink ``path`` if it is still the socket this helper bound."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)


# --- serving ------------------------------------------------------------------------


def _open(tcti: str) -> tuple[contextlib.ExitStack, Tpm]:
    stack = contextlib.ExitStack()
    tpm = stack.enter_context(open_tpm(tcti))
    return stack, tpm


async def _open_service(settings: HelperSettings, stack: contextlib.AsyncExitStack) -> TpmService:
    if settings.tpm_mode == "off":
        log.info("the TPM is off in config.toml; TPM calls are refused")
        return TpmService(
            None, "the TPM is off in config.toml ([tpm] mode = off)", settings.node_id
        )
    try:
        tpm_stack, tpm = await trio.to_thread.run_sync(_open, settings.tcti)
    except TpmError as exc:
        if settings.tpm_mode == "required":
            raise HelperError(f"the TPM is required but cannot be used: {exc}") from exc
        log.warning("no usable TPM (%s); TPM calls are refused", exc)
        return TpmService(None, f"this machine's TPM cannot be used: {exc}", settings.node_id)

    async def close_tpm() -> None:
        with trio.CancelScope(shield=True):  # the helper stops by being cancelled
            await trio.to_thread.run_sync(tpm_stack.close)

    stack.push_async_callback(close_tpm)
    log.info("opened the TPM at %s (leftover handles flushed)", settings.tcti)
    return TpmService(tpm, node_id=settings.node_id)


async def serve_helper(
    settings: HelperSettings,
    *,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open the TPM, listen at the socket and serve until cancelled; then clean up.

    ``task_status.started`` is called (with the socket path) once the socket accepts.
    """
    async with contextlib.AsyncExitStack() as stack:
        service = await _open_service(settings, stack)
        sock, identity = await bind_socket(settings.socket, settings.socket_gid)
        stack.callback(_remove_socket, settings.socket, identity)
        listener = trio.SocketListener(sock)
        stack.push_async_callback(listener.aclose)
        server = HelperServer(service, settings.allowed_uids)
        if settings.node_id:
            log.info(
                "serving node %s (root's join record) at %s", settings.node_id, settings.socket
            )
        else:
            log.warning("no join record yet (bcd join as root writes it); serving at %s",
                        settings.socket)  # fmt: skip
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, server.handle, [listener])
            task_status.started(settings.socket)


async def _main(settings: HelperSettings) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            socket_path = await nursery.start(serve_helper, settings)
            systemd.notify("READY=1", f"STATUS=serving the TPM at {socket_path}")
            async for signum in signals:
                log.info("received %s; stopping", signal.Signals(signum).name)
                systemd.notify("STOPPING=1")
                nursery.cancel_scope.cancel()
                break


def run_helper(cfg: Config, warn: Callable[[str], None], *, level: int = logging.INFO) -> int:
    """``bcd helper``: serve until SIGTERM or SIGINT (0); 1 when it cannot start.

    Runs as root, logging at ``level`` (``--log-level``). A reason it cannot start is
    one line to ``warn`` (bcd helper prints it on stderr).
    """
    logging.getLogger().setLevel(level)
    outcome = 0
    try:
        if os.geteuid() != 0:
            raise HelperError("bcd helper runs as root")
        trio.run(_main, settings_from_config(cfg))
    except* BcdError as group:
        warn(f"bcd helper: {_first(group)}")
        outcome = 1
    return outcome


def _first(group: BaseExceptionGroup[BcdError]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
