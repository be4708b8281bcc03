"""gunicorn's side of the process: its own error answers, and shedding what waited too long."""
