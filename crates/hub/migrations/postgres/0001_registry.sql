-- The registry's metadata. Times are Unix seconds; flags are 0/1 integers (the same
-- Rust code reads them on SQLite and PostgreSQL).
CREATE TABLE users (
    id BIGSERIAL PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_at BIGINT NOT NULL
);

CREATE TABLE tokens (
    id BIGSERIAL PRIMARY KEY,
    user_id BIGINT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    -- sha256 of the token, hex; the token itself is never stored.
    hash TEXT NOT NULL UNIQUE,
    label TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE packages (
    id BIGSERIAL PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    owner_id BIGINT NOT NULL REFERENCES users(id),
    description TEXT NOT NULL DEFAULT '',
    tags TEXT NOT NULL DEFAULT '',
    readme TEXT NOT NULL DEFAULT '',
    private BIGINT NOT NULL DEFAULT 0,
    parent_id BIGINT REFERENCES packages(id),
    parent_version TEXT,
    downloads BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    UNIQUE (owner, name)
);

CREATE TABLE versions (
    id BIGSERIAL PRIMARY KEY,
    package_id BIGINT NOT NULL REFERENCES packages(id) ON DELETE CASCADE,
    version TEXT NOT NULL,
    major BIGINT NOT NULL,
    minor BIGINT NOT NULL,
    patch BIGINT NOT NULL,
    prerelease TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size BIGINT NOT NULL,
    manifest TEXT NOT NULL,
    spec TEXT NOT NULL,
    pushed_by BIGINT NOT NULL REFERENCES users(id),
    created_at BIGINT NOT NULL,
    UNIQUE (package_id, version)
);
CREATE INDEX versions_sha256 ON versions(sha256);

CREATE TABLE tags (
    package_id BIGINT NOT NULL REFERENCES packages(id) ON DELETE CASCADE,
    tag TEXT NOT NULL,
    version_id BIGINT NOT NULL REFERENCES versions(id) ON DELETE CASCADE,
    PRIMARY KEY (package_id, tag)
);

CREATE TABLE validations (
    version_id BIGINT PRIMARY KEY REFERENCES versions(id) ON DELETE CASCADE,
    status TEXT NOT NULL,
    checks TEXT NOT NULL,
    updated_at BIGINT NOT NULL
);

CREATE TABLE leaderboard (
    id BIGSERIAL PRIMARY KEY,
    version_id BIGINT NOT NULL REFERENCES versions(id) ON DELETE CASCADE,
    user_id BIGINT NOT NULL REFERENCES users(id),
    model TEXT NOT NULL,
    score DOUBLE PRECISION NOT NULL,
    ci_low DOUBLE PRECISION NOT NULL,
    ci_high DOUBLE PRECISION NOT NULL,
    episodes BIGINT NOT NULL,
    harness TEXT NOT NULL,
    details TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX leaderboard_version ON leaderboard(version_id, score);

-- Blobs being written: a blob with neither a version nor an upload row is garbage.
CREATE TABLE uploads (
    id BIGSERIAL PRIMARY KEY,
    sha256 TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

-- Full-text search over name, description, tags and README, weighted in that order.
ALTER TABLE packages ADD COLUMN search tsvector GENERATED ALWAYS AS (
    setweight(to_tsvector('english', owner || ' ' || replace(name, '_', ' ')), 'A') ||
    setweight(to_tsvector('english', tags), 'B') ||
    setweight(to_tsvector('english', description), 'B') ||
    setweight(to_tsvector('english', readme), 'C')
) STORED;
CREATE INDEX packages_search ON packages USING GIN (search);
