pytest_plugins = ["lightning_boost.testing.pytest_plugin"]
