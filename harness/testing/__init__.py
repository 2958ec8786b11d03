"""Test support, shared by the repository's tests and scenarios and by anyone who runs the
harness's scenarios from pytest: the pytest plugin (`harness.testing.plugin`: session-wide
fixtures, one running topology per (topology, connectors, proxy) for the whole session) and the
live-topology helper the scenarios send and judge through.
"""
