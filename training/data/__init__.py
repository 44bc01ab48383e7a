"""Data plane: sources, ingest, Arrow shards and the rank-aware loader."""
