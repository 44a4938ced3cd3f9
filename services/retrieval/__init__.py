"""Tandem retrieval service."""
