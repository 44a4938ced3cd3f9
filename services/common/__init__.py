"""Shared foundation of every Tandem service: settings, auth, errors, logging,
health and metrics, Redis and Celery helpers, and the accelerator platform layer.

This package imports no service package.
"""
