"""The attestor plugin contract: what a plugin author imports.

An attestor proves to JoinService that a machine may join. Each attestor has a
name (``join-token`` — sent as ``""`` on the wire —, ``tpm``, ``discovery``,
``x509pop``, or a third party's) and two halves, both implemented as hooks below:
the node half builds evidence (and answers challenge rounds), the server half
judges it inside the join transaction. Each half may also check its own settings:
the server half the control plane's ``--attestor-setting`` values at start, the node
half its table ``[attestors.<name>]`` of ``config.toml``.

Plugins are Python modules registered under the entry-point group ``bcd.attestors``
(``[project.entry-points."bcd.attestors"]``), marked with :data:`hookimpl`. The
built-in attestors load exactly that way. A hook implementation may accept any
subset of a hook's arguments, so the contract grows by adding arguments, never by
breaking plugins. Each hook is called with the attestor's name, and only on the
plugin that claims that name (:func:`bcd_attestor_names`).

This module is the public face (docs/plugin-authors.md): the hookspecs and the
records and verdicts they use. The plugin manager that loads and calls plugins is
:mod:`bcd.plugins`; the conformance checks for a plugin's own tests are
:mod:`bcd.testing.conformance`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import pluggy
from cryptography.hazmat.primitives.asymmetric import ec

from bcd import wire

PROJECT = "bcd"
ENTRY_POINT_GROUP = "bcd.attestors"
JOIN_TOKEN = "join-token"  # noqa: S105 - a name, not a secret

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def wire_name(attestor: str) -> str:
    """The name on the wire: join-token travels as ``""``."""
    return "" if attestor == JOIN_TOKEN else attestor


def canonical_name(wire_attestor: str) -> str:
    return JOIN_TOKEN if wire_attestor in ("", JOIN_TOKEN) else wire_attestor


# --- what the node half receives and returns -------------------------------------


@dataclass(frozen=True, slots=True)
class NodeJoinContext:
    """What the node half of an attestor may use to build its evidence.

    ``credential`` is the join credential read by ``bcd join`` (a token), or None
    for attestors that need none. ``encryption_key`` is the JoinService encryption
    key, already checked against ``join_encryption_key_pin``.
    """

    credential: str | None = field(repr=False)
    csr_der: bytes
    encryption_key: ec.EllipticCurvePublicKey | None
    now_s: int
    role: str
    tcti: str = "device:/dev/tpmrm0"
    """The host's TPM (``[tpm] tcti``), for attestors that open it (``bcd join`` runs as root)."""
    node_key_record: Mapping[str, Any] | None = None
    """When the node key is held in the TPM: the record node.key holds (its JSON object,
    :class:`bcd.tpm.record.NodeKeyRecord`), from which the TPM derives the key; else None."""
    claims: wire.Claims | None = None
    """The hardware claims ``bcd join`` read (under ``--sysfs-root``) and sends."""
    identity_chain_der: tuple[bytes, ...] = ()
    """On a re-join of the machine's existing identity (``bcd join --attestor x509pop``):
    that identity's certificate chain, leaf first, as DER; else empty."""
    identity_signer: Callable[[bytes], bytes] | None = field(default=None, repr=False)
    """On such a re-join: signs a SHA-256 digest with the existing identity's key (a file
    key, or the TPM-held key through the TPM) and returns the P1363 signature (r || s,
    64 bytes); else None. The key itself is never handed to a plugin."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The attestor's own table of ``config.toml`` (``[attestors.<name>]``), as TOML
    read it and as :func:`AttestorSpec.bcd_node_check_settings` accepted it; empty
    when the file has none."""


@dataclass(frozen=True, slots=True)
class NodeEvidence:
    """The node half's answer: the sealed token (join-token only) and evidence."""

    sealed_token: str | None = field(repr=False)
    evidence: dict[str, Any]


# --- what the server half receives and returns -----------------------------------


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A join token row as the server half sees it (locked for this transaction)."""

    token_id: str
    tenant_id: str
    pool_id: str
    site_id: str
    role: str
    secret_sha256: str
    uses_left: int
    expires_at_ms: int
    revoked: bool
    expect: Mapping[str, str]
    allow_reclaim: bool
    hosted: str | None


@dataclass(frozen=True, slots=True)
class PoolRecord:
    """A pool as the server half sees it (to admit into a pool it was configured with)."""

    pool_id: str
    tenant_id: str
    site_id: str
    agent: str


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A node as the server half sees it (``lookup_node_by_hardware_key``)."""

    node_id: str
    tenant_id: str
    site_id: str
    pool_id: str
    role: str
    identity_generation: int
    retired: bool


@dataclass(frozen=True, slots=True)
class VouchRecord:
    """A site agent's word that a machine booted on its site (``discovery_vouches``).

    ``mac`` is lowercase ``aa:bb:cc:dd:ee:ff``; ``vouched_by`` is the site agent's
    node id; ``boot_lease_epoch`` the boot (DHCP lease) it vouched for; ``used`` is
    true once a join was admitted on it (a vouch admits one join per boot).
    """

    vouch_id: str
    site_id: str
    mac: str
    ip: str | None
    workflow_id: str | None
    vouched_by: str
    boot_lease_epoch: int
    expires_at_ms: int
    used: bool


@dataclass(frozen=True, slots=True)
class ChallengeRecord:
    """A challenge an attestor issued, as stored in ``join_challenges``.

    Only hashes and public names are stored: ``secret_sha256`` is the lowercase hex
    SHA-256 of the secret the answer must show, ``ak_name`` and ``ek_sha256`` bind
    the challenge to the machine's keys (lowercase hex), ``csr_sha256`` to the CSR.
    """

    challenge_id: str
    attestor: str
    secret_sha256: str
    ak_name: str
    ek_sha256: str
    csr_sha256: str
    not_after_ms: int
    used: bool


@dataclass(frozen=True, slots=True)
class NodeCertRecord:
    """A node certificate JoinService issued (its ``node_certs`` row) and its node.

    ``identity_generation`` is the certificate's, ``node_generation`` the node's
    current one; ``statements`` and ``allowed_kinds`` are the row's; ``revoked`` is
    the certificate's revocation, ``node_retired`` the node's. ``tenant_id``,
    ``pool_id`` and ``node_role`` are the node's (``role`` is the certificate's).
    """

    serial: str
    node_id: str
    tenant_id: str
    site_id: str
    pool_id: str
    role: str
    node_role: str
    identity_generation: int
    node_generation: int
    statements: tuple[str, ...]
    allowed_kinds: tuple[str, ...]
    not_after_ms: int
    spki_sha256: str
    revoked: bool
    node_retired: bool
    newest: bool = True
    """No later certificate of the node exists (a renewal or re-join replaced it)."""


@dataclass(frozen=True, slots=True)
class JoinRequestRecord:
    """A join request as the server half sees it: the machine's newest request for
    this attestor that names the presented CSR (``join_requests``).

    ``usable`` is true when it is approved, not consumed, and its approval has not
    expired at ``compute_now()``: a retry with this CSR may then be admitted (once).
    """

    request_id: str
    state: str
    usable: bool


class ServerJoinContext(Protocol):
    """What JoinService lends the server half, inside the join's one transaction."""

    now_ms: int
    """``compute_now()``: the database's time, against which expiry is judged."""

    seal: wire.OpenedSeal | None
    """The opened sealed token (typ, kid, CSR binding and iat already checked)."""

    peer_ip: str | None
    """The IP address the join came from as the gateway saw it (normalised), or None."""

    settings: Mapping[str, str]
    """The control plane's attestor settings, ``<attestor>.<key>`` to a string (from
    ``better-compute serve --attestor-setting tpm.ek_ca=FILE`` and the named flags such
    as ``--tpm-ek-ca``). Read only your own prefix; a missing key means not configured."""

    def lock_join_token(self, token_id: str) -> TokenRecord | None:
        """Lock the token row for this transaction and return it (None if unknown)."""

    def consume_join_token(self, token_id: str) -> None:
        """Take one use of the token; undone if the join is refused later."""

    def lookup_pool(self, pool_id: str) -> PoolRecord | None:
        """The pool with this id (None if unknown); JoinService still applies its rules."""

    def save_challenge(
        self,
        *,
        secret_sha256: str,
        ak_name: str,
        ek_sha256: str,
        csr_sha256: str,
        not_after_ms: int,
    ) -> str:
        """Store a new challenge for this attestor; return its id (``jc_…``).

        It is committed with the ``challenge`` answer: state lives only in the store.
        """

    def lock_challenge(self, challenge_id: str) -> ChallengeRecord | None:
        """Lock a challenge row for this transaction and return it (None if unknown)."""

    def consume_challenge(self, challenge_id: str) -> None:
        """Mark the challenge used; undone if the join is refused later."""

    def lookup_node_by_hardware_key(
        self, hardware_key: str, tenant_id: str | None = None
    ) -> NodeRecord | None:
        """The node of ``tenant_id`` whose trusted hardware key is ``hardware_key`` (None
        if none). Hardware keys are judged within a tenant: two tenants may each hold a
        node claiming one key; without ``tenant_id`` the oldest such node is returned."""

    def lookup_vouch(self, site_id: str, mac: str) -> VouchRecord | None:
        """The newest vouch of a site agent of ``site_id`` for ``mac`` (None if none;
        check ``expires_at_ms`` against ``now_ms`` and ``used`` yourself)."""

    def consume_vouch(self, vouch_id: str) -> None:
        """Mark the vouch used; undone if the join is refused later."""

    def lookup_node_cert(self, der: bytes) -> NodeCertRecord | None:
        """The node_certs row that is byte for byte ``der`` (a leaf's DER), with its node;
        None when no issued certificate is exactly these bytes (or its node is gone)."""

    def lookup_join_request(self, machine_key: str) -> JoinRequestRecord | None:
        """The machine's newest join request for this attestor with the presented CSR.

        An attestor with a challenge asks this before its round: an approved request
        lets it go on (and its :class:`Admit` then names it in ``join_request_id``).
        """


@dataclass(frozen=True, slots=True)
class Admit:
    """The server half admits the machine into ``pool_id`` with ``role``.

    ``expect``, ``allow_reclaim`` and ``hosted`` come from the credential; JoinService
    applies the expect, placeholder, reclaim and pool rules after this.
    """

    tenant_id: str
    pool_id: str
    site_id: str
    role: str
    expect: Mapping[str, str] = field(default_factory=dict)
    allow_reclaim: bool = False
    hosted: str | None = None
    node_key: str = "unattested"
    statements: tuple[str, ...] = ()
    allowed_kinds: tuple[str, ...] = ()
    credential_id: str | None = None
    hardware_key: str | None = None
    """A trusted hardware key the attestor proved (lowercase hex SHA-256, e.g. of the
    TPM's EK public area), used instead of the one derived from the claims: it finds
    the node a machine reclaims. A reclaim with ``statements`` also needs the node's
    latest certificate to carry the same statements (the same AK)."""
    join_request_id: str | None = None
    """An approved join request this join spends: JoinService checks that it is
    approved, unconsumed, unexpired and for the presented CSR, and consumes it in the
    join transaction (else the join is refused ``request-not-approved``)."""
    node_id: str | None = None
    """A re-join of this existing node (x509pop): JoinService reclaims exactly that node
    (same id, identity generation + 1, every older certificate revoked ``rejoined``),
    with no hardware-key lookup and no ``allow_reclaim``; it must still be in
    ``tenant_id``/``site_id``/``pool_id`` and not retired (else ``reclaim``)."""
    max_lifetime_s: int | None = None
    """The attestor's cap on the certificate's lifetime, in seconds (the seed: "an
    attestor may shorten either"). JoinService issues for the shorter of this and the
    pool's (or the default) lifetime; it never lengthens it. ``None``: no cap; else a
    whole number of at least 1,800 (``control.admission.MIN_LIFETIME_S``: a shorter
    leaf would use up the node's renewals of the hour; anything else fails the join
    ``plugin-error``). The node keeps the cap for its renewals; a re-join of the node
    (``node_id``) keeps the shorter of its cap and this one."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """The server half refuses. ``reason`` is the attestor's own (``token-secret``);
    JoinService prefixes the attestor name. ``tenant_id`` is set only once the caller
    proved a secret of that tenant, which routes the refusal event there."""

    reason: str
    tenant_id: str | None = None


@dataclass(frozen=True, slots=True)
class Challenge:
    """The server half asks the node for another round (a JoinChallenge).

    ``challenge`` (a JSON object) reaches the node half's :func:`bcd_node_answer` as
    is; the node answers with the same CSR in a JoinRequest with ``round`` = this
    ``round`` (1 to 3, above the request's) and its ``answer``, no later than
    ``not_after_ms`` (unix milliseconds). Nothing is issued and nothing consumed;
    keep whatever the next round needs in the store (``ctx.save_challenge``).
    """

    round: int
    challenge: dict[str, Any]
    not_after_ms: int


@dataclass(frozen=True, slots=True)
class Defer:
    """The server half wants a person to decide (a JoinPending).

    JoinService looks up the machine's request with the presented CSR: a rejected one
    refuses the join (``request-rejected``); an approved, unconsumed, unexpired one
    admits it with ``admit`` (when given), consuming the approval in the join
    transaction; else it records the request (or refreshes the machine's pending one
    with this CSR) and answers a signed ``pending`` body. Nothing is issued and no
    token is spent.

    ``machine_key`` names the machine: the trusted hardware key or EK hash
    (lowercase hex), else ``<site>|<mac>``. ``hardware_key``, ``mac``, ``ip``,
    ``workflow_id``, ``vouched_by`` and ``boot_lease_epoch`` are what the attestor saw.
    """

    machine_key: str
    pool_id: str
    hardware_key: str | None = None
    mac: str | None = None
    ip: str | None = None
    workflow_id: str | None = None
    vouched_by: str | None = None
    boot_lease_epoch: int | None = None
    admit: Admit | None = None
    retry_after_s: int = 5


Verdict = Admit | Refuse | Challenge | Defer


_ALLOWED_KIND = re.compile(r"^[a-z][a-z0-9-]*(\.[a-z0-9-]+)*(\.\*)?$")
ALLOWED_KIND_MAX = 128


def valid_allowed_kind(kind: object) -> bool:
    """An entry of ``Admit.allowed_kinds``: an exact command kind (``exec.run``) or a
    prefix (``exec.*``): lowercase dot-separated words of a-z, 0-9 and ``-``."""
    return (
        isinstance(kind, str) and len(kind) <= ALLOWED_KIND_MAX and bool(_ALLOWED_KIND.match(kind))
    )


def kind_allowed(allowed_kinds: tuple[str, ...] | list[str], kind: str) -> bool:
    """Whether a certificate restricted to ``allowed_kinds`` accepts command ``kind``.

    No restriction (an empty list) accepts every kind; ``a.*`` accepts ``a.b`` and
    ``a.b.c`` but not ``a`` itself.
    """
    if not allowed_kinds:
        return True
    for entry in allowed_kinds:
        if entry.endswith(".*"):
            if kind.startswith(entry[:-1]):
                return True
        elif kind == entry:
            return True
    return False


# --- the hookspecs: the contract ---------------------------------------------------


class AttestorSpec:
    @hookspec
    def bcd_attestor_names(self) -> list[str]:  # type: ignore[empty-body]
        """Return the names of the attestors this plugin provides."""

    @hookspec(firstresult=True)
    def bcd_node_evidence(self, attestor: str, ctx: NodeJoinContext) -> NodeEvidence | None:
        """Node half: build the evidence for a join with ``attestor``.

        Return None if ``attestor`` is not yours. Raise ``bcd.errors.BcdError`` with a
        message for the operator when evidence cannot be built. Never log a secret.
        """

    @hookspec(firstresult=True)
    def bcd_node_answer(
        self, attestor: str, challenge: dict[str, Any], ctx: NodeJoinContext
    ) -> dict[str, Any] | None:
        """Node half: answer a challenge round of ``attestor``.

        ``challenge`` is the ``challenge`` object of a verified (signed) JoinChallenge,
        still untrusted input shaped by the server half: check it. Return the
        ``answer`` object sent with the same CSR in the next JoinRequest, or None if
        ``attestor`` is not yours. Raise ``bcd.errors.BcdError`` when no answer can be
        made. ``bcd join`` calls this at most 3 times per join and never once the
        challenge's ``not_after`` has passed.
        """

    @hookspec(firstresult=True)
    def bcd_server_verify(
        self, attestor: str, request: wire.JoinRequest, ctx: ServerJoinContext
    ) -> Verdict | None:
        """Server half: judge ``request`` inside the join transaction.

        Return None if ``attestor`` is not yours, else :class:`Admit`,
        :class:`Refuse`, :class:`Challenge` (another round; ``request.round`` and
        ``request.answer`` carry the node's answer to the previous one) or
        :class:`Defer` (a join request a person decides). Compare
        secrets in constant time. Exceptions are treated as a refusal with reason
        ``plugin-error`` and logged without their text reaching the client.
        """

    @hookspec(firstresult=True)
    def bcd_server_check_settings(
        self, attestor: str, settings: Mapping[str, str]
    ) -> list[str] | None:
        """Server half: what is wrong with the control plane's settings for ``attestor``.

        ``settings`` are all attestor settings (``<attestor>.<key>`` to a string, as in
        :attr:`ServerJoinContext.settings`): read only your own prefix. Called once at
        ``better-compute serve``'s start, before anything listens; return one line per
        problem, naming the setting as the operator gives it (``--attestor-setting
        acme.allowlist ...``), an empty list when they are fine, or None if
        ``attestor`` is not yours. The first problem stops ``serve`` (``INVALID_CONFIG``).
        An exception is logged and ignored: check again in :func:`bcd_server_verify`.
        """

    @hookspec(firstresult=True)
    def bcd_node_check_settings(self, attestor: str, table: Mapping[str, Any]) -> list[str] | None:
        """Node half: what is wrong with ``attestor``'s table in ``config.toml``.

        ``table`` is ``[attestors.<attestor>]`` as TOML read it (any TOML values: check
        every key and type; refuse keys you do not know). Called whenever bcd loads a
        configuration holding that table; return one line per problem, naming the key
        (``"greeting" must be a string``), an empty list when it is fine, or None if
        ``attestor`` is not yours. bcd reports the first as a configuration error of the
        file. The accepted table reaches :func:`bcd_node_evidence` and
        :func:`bcd_node_answer` as :attr:`NodeJoinContext.settings`. An attestor that
        does not implement this hook takes no table.
        """
