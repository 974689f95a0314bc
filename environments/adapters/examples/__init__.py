"""Environments written in other frameworks' own styles, served through their adapters in tests."""
