"""An example plug-in package: a custom task and a custom staleness policy."""
