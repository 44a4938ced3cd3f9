"""Declarative pipelines: small components behind protocols, wired by a validated definition."""
