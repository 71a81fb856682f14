"""Helpers every layer may use: value coercion, dtypes, flat buffers, the plug-in
registry, process titles. Imports nothing of paramserver but its errors.
"""
