-- Retention (control/retention.py) deletes by age: index the ages it reads.
CREATE INDEX events_created ON events (created_at);
CREATE INDEX join_requests_decided ON join_requests (decided_at) WHERE decided_at IS NOT NULL;
CREATE INDEX discovery_vouches_expires ON discovery_vouches (expires_at);
CREATE INDEX renewals_renewed ON renewals (renewed_at);
CREATE INDEX renew_proofs_used ON renew_proofs (used_at);
