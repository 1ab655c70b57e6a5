"""Stages: the models that run inside worker processes."""
