-- Tokens may expire and may be revoked. A revoked token keeps its row, so a request
-- that sends it is told so instead of "unknown token".
ALTER TABLE tokens ADD COLUMN expires_at BIGINT;
ALTER TABLE tokens ADD COLUMN revoked_at BIGINT;
