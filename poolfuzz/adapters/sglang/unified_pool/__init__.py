"""SGLang's unified memory pool (``--enable-unified-memory``, ``--family sglang:unified``)."""
