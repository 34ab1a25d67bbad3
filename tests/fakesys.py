"""Simulated machines for the tests (see control.simulate)."""

from control.simulate import make_machine, random_mac, random_machine

__all__ = ["make_machine", "random_mac", "random_machine"]
