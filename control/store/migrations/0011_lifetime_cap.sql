-- The lifetime cap an attestor's admission set (Admit.max_lifetime_s, seconds; NULL: none),
-- kept with the node so its renewals are issued for no longer than its join was. A
-- re-join or reclaim sets it again from the new admission.
ALTER TABLE nodes ADD COLUMN max_lifetime_s INTEGER;
