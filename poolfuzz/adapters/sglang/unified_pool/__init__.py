"""SGLang's unified memory pool (``--enable-unified-memory``), as the unified servers run on it."""
