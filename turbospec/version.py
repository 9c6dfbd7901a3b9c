"""The package version (one place; the public API and the reports read it)."""

__version__ = "0.1.0"
