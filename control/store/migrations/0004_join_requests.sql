-- Join requests (issue 5): a deferring attestor's record of a machine awaiting a
-- decision. machine_key is the trusted hardware key or EK hash, else site and MAC;
-- csr_sha256 is the CSR the retry must present. At most one pending request per
-- machine in a pool; an approval admits one join until expires_at, and consumed_at
-- is set by that join's transaction.
CREATE TABLE join_requests (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants (id),
  pool_id TEXT NOT NULL REFERENCES pools (id),
  site_id TEXT NOT NULL,
  attestor TEXT NOT NULL,
  machine_key TEXT NOT NULL,
  claims TEXT NOT NULL,
  hardware_key TEXT,
  mac TEXT,
  ip TEXT,
  workflow_id TEXT,
  csr_sha256 TEXT NOT NULL,
  vouched_by TEXT,
  boot_lease_epoch BIGINT,
  state TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  decided_at BIGINT,
  decided_by TEXT,
  reason TEXT,
  expires_at BIGINT,
  consumed_at BIGINT
);
CREATE UNIQUE INDEX join_requests_one_pending ON join_requests (pool_id, machine_key)
  WHERE state = 'pending';
CREATE INDEX join_requests_machine ON join_requests (machine_key, csr_sha256);
CREATE INDEX join_requests_pool ON join_requests (pool_id, state, created_at);
