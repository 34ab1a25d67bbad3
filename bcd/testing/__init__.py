"""Helpers for the tests of bcd's plugins, bcd's own and third parties'.

:mod:`bcd.testing.conformance` checks an attestor plugin against the contract of
:mod:`bcd.attestor_api` (docs/plugin-authors.md, "Testing a plugin").
"""
