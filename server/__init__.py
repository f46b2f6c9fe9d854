"""Aerie's command line and OpenAI-compatible HTTP server."""
