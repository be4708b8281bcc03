"""Who may ask, and how often: API keys and their check, failed checks by address, rate limits."""
