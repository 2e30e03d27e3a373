-- Sorting by score is `best_score DESC NULLS LAST`, which the ascending index cannot
-- serve by walking backwards (that gives NULLS FIRST): an index in that order.
DROP INDEX packages_best_score;
CREATE INDEX packages_best_score ON packages (best_score DESC NULLS LAST);
