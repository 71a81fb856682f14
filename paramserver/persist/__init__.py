"""Checkpoints on disk: atomic safetensors + JSON manifests, read back with checks.
"""
