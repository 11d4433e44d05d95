"""Shared fixtures. Each fixture module owns one concept; see tests/fixtures/."""

pytest_plugins = ["tests.fixtures.worker", "tests.fixtures.xvfb", "tests.fixtures.tiny_models", "tests.fixtures.tk_windows",
                  "tests.fixtures.dbus_session", "tests.fixtures.imap_server", "tests.fixtures.vllm_server"]
