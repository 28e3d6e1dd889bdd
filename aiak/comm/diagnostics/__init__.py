"""Watching communication go wrong: a collective that waits too long names the ranks that have not reached it
(`stall`), and the debug mode that compares the ranks' collectives and raises instead of hanging
(`deadlock`)."""
