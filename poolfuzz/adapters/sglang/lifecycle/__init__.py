"""The pools one SGLang server runs on, as the scheduler-path drivers build them (``family.py``), and what the release
can build of a config's modes (extra buffer, speculative scratch)."""
