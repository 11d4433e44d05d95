"""Shared fixtures. Each fixture module owns one concept; see tests/fixtures/."""

pytest_plugins = ["tests.fixtures.xvfb"]
