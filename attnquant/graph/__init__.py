"""Run time: MAX graph modules and ops that serve what the load planned."""
