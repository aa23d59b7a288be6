"""Small helpers shared by the daemon and the client: awaiting work to its end,
CPU counts, structured logs, crash points for the torture tests."""
