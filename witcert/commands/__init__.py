"""Subcommands of the `witcert` CLI, one module each (see witcert/cli.py)."""
