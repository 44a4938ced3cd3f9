"""Tandem inference service."""
