"""Pinned TLS to the gateway: the serving CA is the only trust anchor.

The node holds the serving CA certificate (``serving-ca.pem``, whose SPKI pin is
``serving_ca_spki_pin``: :mod:`bcd.servingca`); :func:`pinned_context` is a standard
``ssl`` client context with that certificate as its only anchor, so OpenSSL refuses
an unpinned gateway inside the handshake, before the node's certificate is sent. A
refusal is explained by :func:`verify_server_chain` (cryptography's X.509 path
validation over the chain the gateway presented): a wrong clock, a wrong
``server_name``, or an unpinned chain. :func:`probe_anchor` reads the serving CA
from a certless handshake, for a node installed before the file existed. The
system trust store is never consulted.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import ssl
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from bcd import pki
from bcd.errors import PeerVerificationError, TransportError
from bcd.tlsstream import SocketTLSStream

_MAX_CHAIN = 8
_X509_V_ERR_CERT_NOT_YET_VALID = 9
_X509_V_ERR_CERT_HAS_EXPIRED = 10
_X509_V_ERR_HOSTNAME_MISMATCH = 62
_X509_V_ERR_IP_ADDRESS_MISMATCH = 64
_NOT_PINNED = (
    "the gateway's certificate does not chain to the pinned serving CA (serving_ca_spki_pin)"
)


def os_reason(exc: OSError) -> str:
    """A short reason for a failed connect (trio groups the per-address errors)."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        for err in cause.exceptions:
            if isinstance(err, OSError) and (err.errno or err.strerror):
                return os.strerror(err.errno) if err.errno else str(err.strerror)
    return str(exc.strerror or exc or type(exc).__name__)


def _subject(name: str) -> x509.DNSName | x509.IPAddress:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _spki_pin(cert: x509.Certificate) -> str | None:
    try:
        der = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    except Exception:  # unsupported or malformed key: it cannot be the pinned CA
        return None
    return pki.pin_of_der_spki(der)


def _verifies(
    leaf: x509.Certificate,
    intermediates: list[x509.Certificate],
    anchor: x509.Certificate,
    name: str,
    now: datetime,
) -> Exception | None:
    """Verify ``leaf`` for ``name`` up to ``anchor`` alone; return the failure, if any."""
    try:
        verifier = (
            PolicyBuilder().store(Store([anchor])).time(now).build_server_verifier(_subject(name))
        )
        verifier.verify(leaf, intermediates)
    except (VerificationError, ValueError, TypeError) as exc:
        return exc
    return None


def _own_name(leaf: x509.Certificate) -> str | None:
    """A name the leaf is valid for, to tell a name mismatch from a broken chain."""
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return None
    for dns in san.get_values_for_type(x509.DNSName):
        return dns.replace("*", "x", 1) if dns.startswith("*.") else dns
    for ip in san.get_values_for_type(x509.IPAddress):
        return str(ip)
    return None


def verify_server_chain(chain_der: list[bytes], server_name: str, pin: str, now: datetime) -> None:
    """Check a presented chain (leaf first) against ``pin`` and ``server_name``.

    Returns ``None`` when the leaf verifies up to a certificate of the chain whose
    SPKI pin is ``pin``; raises :class:`TransportError` otherwise, and never
    anything else.
    """
    try:
        _check_chain(chain_der, server_name, pin, now)
    except TransportError:
        raise
    except Exception as exc:  # a certificate cryptography could not take apart
        raise PeerVerificationError(_NOT_PINNED) from exc


def _check_chain(chain_der: list[bytes], server_name: str, pin: str, now: datetime) -> None:
    not_pinned = PeerVerificationError(_NOT_PINNED)
    if not chain_der or len(chain_der) > _MAX_CHAIN:
        raise not_pinned
    try:
        certs = [x509.load_der_x509_certificate(der) for der in chain_der]
    except (ValueError, TypeError) as exc:
        raise PeerVerificationError("the gateway's certificate chain does not parse") from exc
    anchors = [c for c in certs if (p := _spki_pin(c)) is not None and pki.pins_equal(p, pin)]
    if not anchors:
        raise not_pinned
    anchor, leaf = anchors[0], certs[0]
    intermediates = [c for c in certs[1:] if c is not anchor]
    when = now.astimezone(UTC) if now.tzinfo else now.replace(tzinfo=UTC)
    failure = _verifies(leaf, intermediates, anchor, server_name, when)
    if failure is None:
        return
    # Tell the usual causes apart for the message.
    not_before, not_after = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    if not not_before <= when <= not_after:
        raise PeerVerificationError(
            f"the gateway's certificate is not valid at {when:%Y-%m-%dT%H:%M:%SZ} "
            f"(valid {not_before:%Y-%m-%dT%H:%M:%SZ} to {not_after:%Y-%m-%dT%H:%M:%SZ}); "
            "check the clock"
        ) from failure
    own = _own_name(leaf)
    if (
        own is not None
        and own != server_name
        and _verifies(leaf, intermediates, anchor, own, when) is None
    ):
        raise PeerVerificationError(
            f"the gateway's certificate is not valid for {server_name} "
            "(set server_name in config.toml to the name the gateway serves)"
        ) from failure
    raise PeerVerificationError(f"{_NOT_PINNED}: {failure}") from failure


@contextlib.contextmanager
def _memfd(name: str, data: bytes) -> Iterator[str]:
    """A path under /proc/self/fd for ``data`` that never touches a disk."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Anchor:
    """The serving CA: ``pem`` is its certificate, whose SPKI pin is ``pin``."""

    pin: str
    pem: str = field(repr=False)


def anchor_of(
    pem: str, pin: str, now: datetime | None = None, *, check_dates: bool = True
) -> Anchor:
    """``pem`` as the trust anchor for ``pin``: one CA certificate whose SPKI pin is ``pin``.

    OpenSSL does not check an anchor's signature but does check its dates and
    constraints, so those are checked here (at ``now``, the current time by default):
    basicConstraints CA:TRUE, keyCertSign when keyUsage is present, valid now. It need
    not be self-signed (a pinned intermediate anchors a chain). ``check_dates`` False
    skips the dates, for serving-ca.pem (:func:`bcd.servingca.read_anchor`): an anchor
    gone out of date there is replaced on the first dial (:func:`connect_pinned`).
    Raises :class:`ValueError` naming what is wrong.
    """
    try:
        certs = x509.load_pem_x509_certificates(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError("it is not a PEM certificate") from exc
    if len(certs) != 1:
        raise ValueError(f"it holds {len(certs)} certificates, not one")
    cert = certs[0]
    found = _spki_pin(cert)
    if found is None or not pki.pins_equal(found, pin):
        raise ValueError("its SPKI pin is not serving_ca_spki_pin")
    _check_ca(cert, (datetime.now(UTC) if now is None else now) if check_dates else None)
    return Anchor(pin=pin, pem=cert.public_bytes(serialization.Encoding.PEM).decode("ascii"))


def _check_ca(cert: x509.Certificate, now: datetime | None) -> None:
    """What OpenSSL checks of a trust anchor: a CA, allowed to sign certificates, valid now."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = constraints.ca
    except x509.ExtensionNotFound:
        is_ca = False
    except ValueError as exc:
        raise ValueError(f"its extensions do not parse ({exc})") from exc
    if not is_ca:
        raise ValueError("it is not a CA certificate (basicConstraints CA:TRUE is missing)")
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.key_cert_sign:
        raise ValueError("its keyUsage does not allow signing certificates (keyCertSign)")
    if now is None:
        return
    when = now.astimezone(UTC) if now.tzinfo else now.replace(tzinfo=UTC)
    not_before, not_after = cert.not_valid_before_utc, cert.not_valid_after_utc
    if not not_before <= when <= not_after:
        raise ValueError(
            f"it is not valid at {when:%Y-%m-%dT%H:%M:%SZ} (valid "
            f"{not_before:%Y-%m-%dT%H:%M:%SZ} to {not_after:%Y-%m-%dT%H:%M:%SZ})"
        )


def _base_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # a write never has to read (bcd.tlsstream)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


_PEM_END = "-----END CERTIFICATE-----"


def presented_leaf(chain_pem: str) -> str:
    """The first certificate of ``chain_pem`` (leaf first): what a node presents over
    mutual TLS. Every listener a node dials holds the node CA and its root as trust
    anchors (the gateway's ``client_ca_pem``), so the CAs a node's chain carries after
    its leaf are never needed to verify it (a gateway bundle without the node CA is
    refused at load: ``control.gatewaypki.load_bundle``); sent, they cost the listener
    0.4-0.5 ms of CPU per handshake and 10.9 KB of OpenSSL state per connection, parsed
    and kept for the connection's life (``bench/leafonly.py``). A text with no end marker is
    returned as it is, to fail to load as it did."""
    end = chain_pem.find(_PEM_END)
    return chain_pem if end < 0 else chain_pem[: end + len(_PEM_END)] + "\n"


def pinned_context(anchor: Anchor, client_cert: tuple[str, bytes] | None = None) -> ssl.SSLContext:
    """A standard client context whose only trust anchor is the serving CA.

    ``CERT_REQUIRED``, the host name checked against ``server_hostname``,
    ``VERIFY_X509_PARTIAL_CHAIN`` so a pinned intermediate anchors the chain (the pinned
    certificate is the only one loaded, so no other can), and ``VERIFY_X509_STRICT``
    (RFC 5280 as :func:`verify_server_chain` and Python 3.13's defaults hold it, on
    every Python); the system store is never loaded. OpenSSL checks the chain when the
    server's Certificate arrives and aborts the handshake on a failure, before the
    client Certificate (``client_cert``: chain PEM, PKCS#8 key PEM; only its leaf,
    :func:`presented_leaf`) is sent.
    """
    ctx = _base_context()
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN | ssl.VERIFY_X509_STRICT
    try:
        ctx.load_verify_locations(cadata=anchor.pem)
    except (ssl.SSLError, ValueError) as exc:
        raise PeerVerificationError("the serving CA certificate does not load") from exc
    if client_cert is not None:
        chain_pem, key_pem = client_cert
        try:
            with (
                _memfd("bcd-chain", presented_leaf(chain_pem).encode("ascii")) as cert_path,
                _memfd("bcd-key", key_pem) as key_path,
            ):
                ctx.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError, UnicodeEncodeError) as exc:
            raise TransportError("the node certificate or key does not load") from exc
    return ctx


# The contexts :func:`cached_context` built, per owner (the loaded identity whose
# certificate and key they hold) and per anchor: a context is a value of its owner's
# entry only, so it goes when the owner does (a renewed identity is a new owner).
_BUILT: weakref.WeakKeyDictionary[object, tuple[str, str, ssl.SSLContext]] = (
    weakref.WeakKeyDictionary()
)
# Certless contexts (a join's) per anchor certificate; a node has one anchor, a few
# when its serving CA was replaced, so the bound is never reached but by a host that
# joins through many control planes.
_CERTLESS: dict[str, ssl.SSLContext] = {}
_CERTLESS_MAX = 8


def cached_context(
    anchor: Anchor, client_cert: tuple[str, bytes] | None = None, owner: object | None = None
) -> ssl.SSLContext:
    """:func:`pinned_context`, built once and kept: per ``owner`` for a ``client_cert``
    (the loaded identity it is the chain and key of: weakly referenced, the context
    goes with it; a chain other than the kept context's is built anew), per anchor
    when certless. Building one parses the anchor, the chain and the key (about 1.2 ms
    of CPU with a client certificate, more than the node's share of the handshake);
    a context is only read by the handshakes that share it. Without ``owner`` a client
    certificate's context is built anew."""
    if client_cert is None:
        ctx = _CERTLESS.get(anchor.pem)
        if ctx is None:
            if len(_CERTLESS) >= _CERTLESS_MAX:
                _CERTLESS.clear()
            ctx = _CERTLESS[anchor.pem] = pinned_context(anchor)
        return ctx
    if owner is None:
        return pinned_context(anchor, client_cert)
    built = _BUILT.get(owner)
    if built is None or built[:2] != (anchor.pem, client_cert[0]):  # another chain: anew
        built = (anchor.pem, client_cert[0], pinned_context(anchor, client_cert))
        _BUILT[owner] = built
    return built[2]


def _probe_context() -> ssl.SSLContext:
    """A certless context that verifies nothing itself (the chain is checked after)."""
    ctx = _base_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class StaleAnchor(PeerVerificationError):
    """OpenSSL refused the chain, yet it verifies against the pin: the stored anchor is
    stale (the CA re-certified with the same key). ``anchor`` is the certificate of the
    presented chain carrying the pin (it passed :func:`anchor_of`); the message is what
    the refusal says when the anchor is not replaced."""

    def __init__(self, message: str, anchor: Anchor) -> None:
        super().__init__(message)
        self.anchor = anchor


def _anchor_in(chain: list[bytes], pin: str) -> Anchor | None:
    """The certificate of ``chain`` whose SPKI pin is ``pin``, as an anchor; None if none
    is one (:func:`anchor_of`)."""
    for der in chain:
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            continue
        found = _spki_pin(cert)
        if found is not None and pki.pins_equal(found, pin):
            try:
                return anchor_of(cert.public_bytes(serialization.Encoding.PEM).decode(), pin)
            except ValueError:
                return None
    return None


def _refused_chain(
    stream: SocketTLSStream, err: ssl.SSLCertVerificationError, server_name: str, pin: str
) -> PeerVerificationError:
    """Why OpenSSL refused the chain, in the words of :func:`verify_server_chain`.

    The chain the gateway presented is still readable after the aborted handshake;
    the pure check names a wrong clock or ``server_name`` apart from an unpinned chain.
    A chain the pure check accepts is a :class:`StaleAnchor` when it carries an anchor.
    """
    try:
        chain = stream.unverified_chain_der()
    except Exception:  # cannot read it: say what OpenSSL said
        chain = []
    fresh: Anchor | None = None
    if chain:
        try:
            verify_server_chain(chain, server_name, pin, datetime.now(UTC))
        except PeerVerificationError as exc:
            return exc
        except TransportError as exc:  # pragma: no cover - verify_server_chain raises the above
            return PeerVerificationError(str(exc))
        fresh = _anchor_in(chain, pin)
    refused = _openssl_refusal(err, server_name)
    return refused if fresh is None else StaleAnchor(str(refused), fresh)


def _openssl_refusal(err: ssl.SSLCertVerificationError, server_name: str) -> PeerVerificationError:
    reason = (err.verify_message or "verification failed").strip()
    if err.verify_code in (_X509_V_ERR_CERT_NOT_YET_VALID, _X509_V_ERR_CERT_HAS_EXPIRED):
        return PeerVerificationError(
            f"the gateway's certificate is not valid now ({reason}); check the clock"
        )
    if err.verify_code in (_X509_V_ERR_HOSTNAME_MISMATCH, _X509_V_ERR_IP_ADDRESS_MISMATCH):
        return PeerVerificationError(
            f"the gateway's certificate is not valid for {server_name} "
            "(set server_name in config.toml to the name the gateway serves)"
        )
    return PeerVerificationError(f"{_NOT_PINNED}: {reason}")


async def _dial(
    host: str,
    port: int,
    server_name: str,
    ctx: ssl.SSLContext,
    pin: str,
    timeout: float,  # noqa: ASYNC109 - covers connect and handshake separately
) -> SocketTLSStream:
    """Connect, and handshake with OpenSSL on the socket (:mod:`bcd.tlsstream`)."""
    where = f"{host}:{port}"
    try:
        with trio.fail_after(timeout):
            tcp = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError as exc:
        raise TransportError(f"cannot reach the gateway at {where}: timed out") from exc
    except OSError as exc:
        raise TransportError(f"cannot reach the gateway at {where}: {os_reason(exc)}") from exc
    try:
        stream = SocketTLSStream(tcp, ctx, server_hostname=server_name)
    except trio.BrokenResourceError as exc:  # the socket closed by the constructor
        cause = exc.__cause__
        if isinstance(cause, ConnectionError) or (
            isinstance(cause, OSError) and cause.errno == errno.ENOTCONN
        ):
            reason = "the gateway closed the connection before it"
        elif isinstance(cause, OSError):
            reason = os_reason(cause)
        else:  # a server_name OpenSSL cannot take (config.py rules them out)
            reason = f"{cause.__class__.__name__ if cause else 'refused'}"
        raise TransportError(f"TLS handshake with the gateway at {where} failed: {reason}") from exc
    try:
        try:
            with trio.fail_after(timeout):
                await stream.do_handshake()
        except trio.TooSlowError as exc:
            raise TransportError(f"TLS handshake with the gateway at {where} timed out") from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
            if isinstance(cause, ssl.SSLCertVerificationError):
                raise _refused_chain(stream, cause, server_name, pin) from exc
            if isinstance(cause, ssl.SSLError):
                reason = cause.reason or cause.__class__.__name__
            elif isinstance(cause, OSError):  # a reset mid-handshake, say
                reason = os_reason(cause)
            else:
                reason = cause.__class__.__name__
            raise TransportError(
                f"TLS handshake with the gateway at {where} failed: {reason}"
            ) from exc
    except BaseException:
        stream.close()
        raise
    return stream


async def connect_pinned(
    host: str,
    port: int,
    server_name: str,
    anchor: Anchor,
    *,
    client_cert: tuple[str, bytes] | None = None,
    timeout: float = 15.0,  # noqa: ASYNC109 - covers connect and handshake separately
    on_stale_anchor: Callable[[Anchor], None] | None = None,
    owner: object | None = None,
) -> SocketTLSStream:
    """Connect and handshake with the serving CA as the only trust anchor.

    ``client_cert`` is (chain PEM, PKCS#8 key PEM) for mutual TLS; it is sent only
    to a gateway whose chain verified (:func:`pinned_context`). The context is
    :func:`cached_context`'s, kept per ``owner`` (the loaded identity ``client_cert``
    is of) and anchor. Any failure closes
    the connection and raises :class:`TransportError` (a
    :class:`PeerVerificationError` for the chain, never retried), except one: when
    OpenSSL refuses a chain that verifies against the pin (:class:`StaleAnchor`, the
    CA re-certified with the same key), ``on_stale_anchor`` gets the presented anchor
    and the handshake is tried once more with it.
    """
    try:
        return await _dial(
            host, port, server_name, cached_context(anchor, client_cert, owner), anchor.pin, timeout
        )
    except StaleAnchor as stale:
        if on_stale_anchor is None or stale.anchor.pem == anchor.pem:
            raise
        fresh = stale.anchor
    # No client certificate went out on the refused attempt (OpenSSL aborted first).
    on_stale_anchor(fresh)
    return await _dial(
        host, port, server_name, cached_context(fresh, client_cert, owner), fresh.pin, timeout
    )


async def probe_anchor(
    host: str,
    port: int,
    server_name: str,
    pin: str,
    *,
    timeout: float = 15.0,  # noqa: ASYNC109 - covers connect and handshake separately
) -> Anchor:
    """The serving CA certificate, read from the chain a gateway presents.

    A certless handshake (no client certificate is sent), then the chain is checked
    against ``pin`` with :func:`verify_server_chain`; the certificate of the chain
    whose SPKI pin is ``pin`` is the anchor. No request byte is sent.
    """
    stream = await _dial(host, port, server_name, _probe_context(), pin, timeout)
    try:
        try:
            chain = stream.unverified_chain_der()
        except Exception as exc:
            raise PeerVerificationError(
                "cannot read the certificate chain the gateway presented"
            ) from exc
        verify_server_chain(chain, server_name, pin, datetime.now(UTC))
        anchor = _anchor_in(chain, pin)
        if anchor is None:
            raise PeerVerificationError(
                "the serving CA certificate the gateway presented is not a usable trust "
                "anchor (not a CA certificate valid now)"
            )
        return anchor
    finally:
        await trio.aclose_forcefully(stream)
