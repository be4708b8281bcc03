"""What an operator runs: the `flask` commands, backups, the quick start and sample data."""
