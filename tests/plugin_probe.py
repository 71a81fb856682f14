"""A plug-in module that must not be imported unless trusted: importing it fails loudly,
so a test tells "refused before import" (the gate's message) from "imported"."""

raise RuntimeError("tests/plugin_probe.py was imported")
