-- Renewal (issue 3): spent proofs of possession, the per-node renewal count, and
-- the index the gateway's revocation poller reads.
--
-- renew_proofs: one row per accepted proof, keyed by SHA-256 of the canonical
-- (low-S) pop_sig; a proof seen in the last 120 seconds is a replay. Rows are
-- pruned per node at its next renewal.
CREATE TABLE renew_proofs (
  proof_sha256 TEXT PRIMARY KEY,
  node_id TEXT NOT NULL,
  used_at BIGINT NOT NULL
);
CREATE INDEX renew_proofs_node ON renew_proofs (node_id, used_at);
-- renewals: one row per issued renewal, the sliding window of at most 6 per node
-- and hour; rows older than an hour are pruned per node.
CREATE TABLE renewals (
  serial TEXT PRIMARY KEY,
  node_id TEXT NOT NULL,
  renewed_at BIGINT NOT NULL
);
CREATE INDEX renewals_node ON renewals (node_id, renewed_at);
CREATE INDEX node_certs_revoked ON node_certs (revoked_at) WHERE revoked_at IS NOT NULL;
