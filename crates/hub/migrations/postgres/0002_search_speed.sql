-- The best leaderboard score per package, kept with the package so sorting by it does
-- not compute a maximum per package per query; indexes for the listing orders.
ALTER TABLE packages ADD COLUMN best_score DOUBLE PRECISION;
UPDATE packages SET best_score = (
    SELECT MAX(l.score) FROM leaderboard l JOIN versions v ON v.id = l.version_id
    WHERE v.package_id = packages.id
);
CREATE INDEX packages_best_score ON packages(best_score);
CREATE INDEX packages_downloads ON packages(downloads);
CREATE INDEX packages_updated_at ON packages(updated_at);

-- Prefix search on the words as written, too: the English configuration drops stop
-- words and stems, so the prefix "too" (of "tool") or "phy" (of "physics") found
-- nothing. The vector now holds both forms; queries use the simple configuration.
DROP INDEX packages_search;
ALTER TABLE packages DROP COLUMN search;
ALTER TABLE packages ADD COLUMN search tsvector GENERATED ALWAYS AS (
    setweight(to_tsvector('english', owner || ' ' || replace(name, '_', ' ')), 'A') ||
    setweight(to_tsvector('simple', owner || ' ' || replace(name, '_', ' ')), 'A') ||
    setweight(to_tsvector('english', tags), 'B') ||
    setweight(to_tsvector('simple', tags), 'B') ||
    setweight(to_tsvector('english', description), 'B') ||
    setweight(to_tsvector('simple', description), 'B') ||
    setweight(to_tsvector('english', readme), 'C') ||
    setweight(to_tsvector('simple', readme), 'C')
) STORED;
CREATE INDEX packages_search ON packages USING GIN (search);
