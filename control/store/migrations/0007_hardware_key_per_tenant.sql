-- Trusted hardware keys are unique within a tenant, not across tenants: a tenant that
-- joins first with another tenant's machine identifiers must not lock that tenant's
-- machine out (JoinService reports two tenants claiming one key to the root tenant).
DROP INDEX nodes_trusted_hardware;
CREATE UNIQUE INDEX nodes_trusted_hardware ON nodes (tenant_id, hardware_key) WHERE hardware_key_trusted = 1;
