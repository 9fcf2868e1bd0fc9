"""The package's version: one definition, read by the package root, ``model/`` (which imports
nothing above it) and setup.cfg (``attr:``)."""

__version__ = "0.1.0"
