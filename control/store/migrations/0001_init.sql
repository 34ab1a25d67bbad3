-- One schema for SQLite and PostgreSQL: ids and JSON as TEXT, times as BIGINT unix ms,
-- booleans as INTEGER 0/1, DER as base64 TEXT.
CREATE TABLE tenants (
  id TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  is_root INTEGER NOT NULL DEFAULT 0,
  created_at BIGINT NOT NULL
);
CREATE UNIQUE INDEX tenants_one_root ON tenants (is_root) WHERE is_root = 1;
CREATE TABLE api_credentials (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants (id),
  secret_sha256 TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  revoked_at BIGINT
);
CREATE TABLE sites (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants (id),
  name TEXT NOT NULL,
  custom INTEGER NOT NULL DEFAULT 0,
  created_at BIGINT NOT NULL
);
CREATE TABLE pools (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants (id),
  site_id TEXT NOT NULL REFERENCES sites (id),
  name TEXT NOT NULL,
  agent TEXT NOT NULL,
  policy TEXT NOT NULL DEFAULT '{}',
  created_at BIGINT NOT NULL
);
CREATE TABLE join_tokens (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants (id),
  pool_id TEXT NOT NULL REFERENCES pools (id),
  site_id TEXT NOT NULL REFERENCES sites (id),
  role TEXT NOT NULL,
  secret_sha256 TEXT NOT NULL,
  max_uses INTEGER NOT NULL,
  uses_left INTEGER NOT NULL,
  expect TEXT NOT NULL DEFAULT '{}',
  allow_reclaim INTEGER NOT NULL DEFAULT 0,
  hosted TEXT,
  idempotency_key TEXT,
  created_at BIGINT NOT NULL,
  expires_at BIGINT NOT NULL,
  revoked_at BIGINT
);
CREATE UNIQUE INDEX join_tokens_idempotency ON join_tokens (tenant_id, idempotency_key);
CREATE INDEX join_tokens_pool ON join_tokens (pool_id, created_at);
CREATE TABLE nodes (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL REFERENCES tenants (id),
  site_id TEXT NOT NULL REFERENCES sites (id),
  pool_id TEXT NOT NULL REFERENCES pools (id),
  role TEXT NOT NULL,
  state TEXT NOT NULL,
  identity_generation INTEGER NOT NULL,
  hardware_key TEXT,
  hardware_key_trusted INTEGER NOT NULL DEFAULT 0,
  claims TEXT NOT NULL DEFAULT '{}',
  attestor TEXT NOT NULL,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  retired_at BIGINT
);
CREATE UNIQUE INDEX nodes_trusted_hardware ON nodes (hardware_key) WHERE hardware_key_trusted = 1;
CREATE INDEX nodes_pool ON nodes (pool_id);
CREATE TABLE node_certs (
  serial TEXT PRIMARY KEY,
  node_id TEXT NOT NULL REFERENCES nodes (id),
  identity_generation INTEGER NOT NULL,
  role TEXT NOT NULL,
  spki_sha256 TEXT NOT NULL,
  der TEXT NOT NULL,
  statements TEXT NOT NULL DEFAULT '[]',
  allowed_kinds TEXT NOT NULL DEFAULT '[]',
  not_before BIGINT NOT NULL,
  not_after BIGINT NOT NULL,
  revoked_at BIGINT,
  revoke_reason TEXT,
  created_at BIGINT NOT NULL
);
CREATE INDEX node_certs_node ON node_certs (node_id);
CREATE TABLE events (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  type TEXT NOT NULL,
  payload TEXT NOT NULL,
  created_at BIGINT NOT NULL
);
CREATE INDEX events_tenant ON events (tenant_id, created_at);
CREATE TABLE audit (
  id TEXT PRIMARY KEY,
  tenant_id TEXT NOT NULL,
  action TEXT NOT NULL,
  subject TEXT NOT NULL,
  payload TEXT NOT NULL,
  created_at BIGINT NOT NULL
);
CREATE TABLE refusal_windows (
  rate_key TEXT PRIMARY KEY,
  window_start BIGINT NOT NULL,
  emitted INTEGER NOT NULL,
  suppressed INTEGER NOT NULL
);
