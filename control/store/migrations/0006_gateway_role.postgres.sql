-- PostgreSQL only. (1) Every revocation notifies the gateways at once: a trigger on
-- node_certs sends pg_notify('bc_revoked', serial) when revoked_at is first set, so
-- a gateway LISTENing wakes its revocation poll at the revoking commit (the poll
-- every second stays behind it for a missed notification or a dropped connection).
-- (2) The gateway's database role: better_compute_gateway (NOLOGIN; a gateway logs
-- in as a member of it) may read node certificates, whether a node is retired and
-- the schema version, and nothing else; it can write nothing at all, so a stolen
-- gateway cannot insert a token, approve a request or reset a use.
CREATE FUNCTION bc_notify_revoked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('bc_revoked', NEW.serial);
  RETURN NEW;
END
$$;

CREATE TRIGGER node_certs_notify_revoked
  AFTER UPDATE OF revoked_at ON node_certs
  FOR EACH ROW
  WHEN (OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL)
  EXECUTE FUNCTION bc_notify_revoked();

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
