-- Challenge rounds (issue 4): the state of a JoinChallenge lives only here.
--
-- join_challenges: one row per challenge an attestor issued (the tpm attestor's
-- credential activation). Only hashes and public names: secret_sha256 is the
-- SHA-256 of the secret the answer must show, ak_name and ek_sha256 bind the
-- challenge to the machine's keys, csr_sha256 to the CSR the answer must present.
-- used_at is set when an answer consumed it; rows are pruned an hour after
-- not_after.
CREATE TABLE join_challenges (
  id TEXT PRIMARY KEY,
  attestor TEXT NOT NULL,
  secret_sha256 TEXT NOT NULL,
  ak_name TEXT NOT NULL,
  ek_sha256 TEXT NOT NULL,
  csr_sha256 TEXT NOT NULL,
  not_after BIGINT NOT NULL,
  used_at BIGINT,
  created_at BIGINT NOT NULL
);
CREATE INDEX join_challenges_not_after ON join_challenges (not_after);
