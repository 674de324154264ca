"""Storage: the table models, per-step rows, rollups, block histograms, retention and migrations."""
