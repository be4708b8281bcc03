"""Where animals and keys are kept, and what happens when the database misbehaves: the models,
every statement a request runs, keyset pages, what a worker keeps, the connection's settings,
deadlines, faults and failover. Imports nothing of the layers above (the web's included)."""
