"""Deployment scripts; the Python ones run from the repository root as `python -m deploy.x`."""
