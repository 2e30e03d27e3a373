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
