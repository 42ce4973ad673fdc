"""SGLang's KV and request pools as a server builds them (``family.py``: the pools one server runs on, and what the
release can build of a config's modes), and the doors (writes, reads, paged calls) and views through which the checks
reach them."""
