"""The harness: a serving engine over a real family and its reference, per-slot checksums,
the invariants, the Hypothesis state machine and the command line."""
