"""The checking core: traceable contents, per-slot checksums, the ledger, the engine that plays a
serving node over a family and its reference, its checks, and the Hypothesis state machine."""
