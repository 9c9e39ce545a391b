"""Cluster-wide coordination in Redis, each store a Protocol with an in-memory twin."""
