"""Prefect tasks: one small typed function per pipeline step, no ML logic."""
