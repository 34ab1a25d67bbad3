-- Discovery (issue 5): a site agent's word that a machine booted on its site. One
-- row per site and MAC: a newer boot (boot_lease_epoch) replaces it, an older one
-- is refused. used_at is set by the join it admitted (a vouch admits one join per
-- boot); expires_at bounds how long after the boot it counts.
CREATE TABLE discovery_vouches (
  id TEXT PRIMARY KEY,
  site_id TEXT NOT NULL REFERENCES sites (id),
  mac TEXT NOT NULL,
  ip TEXT,
  workflow_id TEXT,
  vouched_by TEXT NOT NULL,
  boot_lease_epoch BIGINT NOT NULL,
  created_at BIGINT NOT NULL,
  updated_at BIGINT NOT NULL,
  expires_at BIGINT NOT NULL,
  used_at BIGINT
);
CREATE UNIQUE INDEX discovery_vouches_machine ON discovery_vouches (site_id, mac);
-- Each vouch a site agent made (the rate limit counts calls, not machines: vouching
-- one MAC again and again updates one row); pruned after a minute.
CREATE TABLE discovery_vouch_calls (
  vouched_by TEXT NOT NULL,
  at BIGINT NOT NULL
);
CREATE INDEX discovery_vouch_calls_agent ON discovery_vouch_calls (vouched_by, at);
-- A join asked again after its answer was lost finds its certificate by the CSR's key.
CREATE INDEX node_certs_spki ON node_certs (spki_sha256);
