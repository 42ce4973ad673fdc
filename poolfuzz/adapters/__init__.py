"""Adapters that let the harness drive pool families from other code bases (see plugins)."""
