"""Tandem agent service."""
