"""Orchestration: runs of the state machine, fuzz sessions over worker processes, the example
database, failure artifacts, family plug-ins, the detection matrix and the bench."""
