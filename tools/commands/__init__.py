"""The CLI's subcommands, one module each (registered by :mod:`kvbridge.tools.cli`)."""
