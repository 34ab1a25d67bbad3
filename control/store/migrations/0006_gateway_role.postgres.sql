-- PostgreSQL only. The gateway's database role: better_compute_gateway (NOLOGIN; a
-- gateway logs in as a member of it) may read node certificates, whether a node is
-- retired and the schema version, and nothing else; it can write nothing at all, so
-- a stolen gateway cannot insert a token, approve a request or reset a use. (The
-- revocation notification is sent after the revoking commit, by the store, never
-- inside it: a full notification queue must not be able to fail a revocation.)
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'better_compute_gateway') THEN
    BEGIN
      CREATE ROLE better_compute_gateway NOLOGIN;
    EXCEPTION
      WHEN duplicate_object OR unique_violation THEN NULL;  -- made concurrently
      WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'the migrating role may not create roles: run CREATE ROLE better_compute_gateway NOLOGIN as a superuser, then migrate again';
    END;
  END IF;
  EXECUTE format('GRANT USAGE ON SCHEMA %I TO better_compute_gateway', current_schema());
  EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM better_compute_gateway', current_schema());
END
$$;

GRANT SELECT ON node_certs TO better_compute_gateway;
GRANT SELECT (id, retired_at) ON nodes TO better_compute_gateway;
GRANT SELECT ON schema_migrations TO better_compute_gateway;
