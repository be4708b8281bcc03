"""What an operator sees: metrics (and the master's metrics process), logs, health checks."""
