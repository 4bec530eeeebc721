"""The application shell: the sidecar process, its HTTP API and the `seedancectl` CLI.

It composes the four packages (collectors -> policies -> tuner -> dashboards) and is the only
place that may import all of them; nothing imports it.
"""
