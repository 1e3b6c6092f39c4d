"""The prepared GPU command and the parts it runs (see run.sh)."""
