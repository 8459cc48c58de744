"""Starting Bulkhead: the `bulkhead` command, `bulkhead up` and the process launcher.

Imports the components it starts only when a subcommand runs, so it stays torch-free until then.
"""
