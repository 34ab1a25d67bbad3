-- The signed RevocationNotice made where a certificate is revoked (an API replica, under
-- the join-signing key), which the gateways push as it is: a gateway can relay a
-- notice but not forge one.
ALTER TABLE node_certs ADD COLUMN revoke_notice TEXT;
