"""MaxText runs with and without superoffload, recorded for tests and docs."""
