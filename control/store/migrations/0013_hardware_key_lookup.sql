-- JoinService asks, on every join with a trusted hardware key, whether another tenant's
-- live node claims the same key. The only index on the key was (tenant_id,
-- hardware_key), so PostgreSQL answered by walking that whole index, one entry per
-- node: 7.9 ms at 40,000 nodes, and most of PostgreSQL's CPU per join at 100,000
-- (bench/fleet.py; docs/decisions.md, "A fleet of 100,000 (issue 14), the third
-- session"). An index on the key alone makes it one seek. Building it reads the nodes
-- once and blocks writes to them while it runs (seconds at 100,000 nodes).
CREATE INDEX nodes_hardware_key ON nodes (hardware_key) WHERE hardware_key_trusted = 1;
