"""Command-line interface: click commands, one per file, all output through cli.console."""
