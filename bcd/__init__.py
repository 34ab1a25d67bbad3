"""bcd: the better-compute node agent."""

__version__ = "0.1.0"
