"""Persistence layers: LMDB (default) and in-memory storage, and the timeout layer on top."""
