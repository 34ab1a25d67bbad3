"""Spent proofs of possession: a signature by a node's key is accepted once.

Renewals (``pop_sig`` over the CSR) and vouches (``pop_sig`` over the vouch) are each
signed with ``client_time`` and accepted within 60 s of ``compute_now()``; what
stops a replay inside that window is ``renew_proofs``, which keeps each accepted
proof's canonical hash for :data:`REPLAY_WINDOW_MS`. The two messages are domain
separated (``bc-renew-pop-v1``, ``bc-vouch-pop-v1``), so one never passes for the
other.
"""

from __future__ import annotations

import hashlib

from control.admission import CLOCK_SKEW_MS
from control.store import Tx

__all__ = ["CLOCK_SKEW_MS", "REPLAY_WINDOW_MS", "proof_sha256", "spend_proof"]
REPLAY_WINDOW_MS = 120_000
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def proof_sha256(pop_sig: bytes) -> str:
    """SHA-256 of the proof in canonical (low-S) form.

    ECDSA signatures are malleable: (r, s) and (r, n - s) both verify, so a replay
    of a flipped signature must count as the same proof.
    """
    if len(pop_sig) == 64:
        r, s = pop_sig[:32], int.from_bytes(pop_sig[32:], "big")
        if 0 < s < _P256_ORDER:
            pop_sig = r + min(s, _P256_ORDER - s).to_bytes(32, "big")
    return hashlib.sha256(pop_sig).hexdigest()


def spend_proof(tx: Tx, proof: str, node_id: str, now_ms: int) -> bool:
    """Record the proof; False when it was already accepted in the last 120 s."""
    tx.defer(
        "DELETE FROM renew_proofs WHERE node_id = ? AND used_at < ?",
        (node_id, now_ms - REPLAY_WINDOW_MS),
    )
    changed = tx.execute(
        "INSERT INTO renew_proofs (proof_sha256, node_id, used_at) VALUES (?, ?, ?) "
        "ON CONFLICT (proof_sha256) DO UPDATE SET node_id = excluded.node_id, "
        "used_at = excluded.used_at WHERE renew_proofs.used_at < ?",
        (proof, node_id, now_ms, now_ms - REPLAY_WINDOW_MS),
    )
    return changed == 1
