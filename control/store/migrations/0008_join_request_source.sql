-- The address a join request's join came from (the gateway's view of the machine),
-- so pending requests can be bounded per source address; and an index for the
-- newest-first list.
ALTER TABLE join_requests ADD COLUMN source_ip TEXT;
CREATE INDEX join_requests_pool_state ON join_requests (pool_id, state, created_at);
