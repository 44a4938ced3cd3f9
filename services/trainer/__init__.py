"""Tandem trainer service."""
