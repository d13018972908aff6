"""Launchers that run a job outside Kubernetes (the local one on Ray)."""
