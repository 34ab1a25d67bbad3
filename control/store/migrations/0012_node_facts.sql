-- What the operator sees of a node beside its state (docs/operators.md, "Node states and
-- facts"): when a gateway last saw it on a session (the API's clock, unix ms; NULL:
-- never), and the daemon version its latest Hello (else its join request) named (NULL:
-- none named). The gateway's database role is granted nothing new: gateways report
-- sessions upstream, to the API, which writes these.
ALTER TABLE nodes ADD COLUMN last_seen_at BIGINT;
ALTER TABLE nodes ADD COLUMN daemon_version TEXT;
