"""MoonEP: balanced expert-parallel dispatch/combine with online redundant experts."""

__version__ = "0.1.0"
