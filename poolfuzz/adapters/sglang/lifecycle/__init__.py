"""The pools path (``--family sglang``): the request lifecycle the harness drives on SGLang's pools, in the call order the adapter gives it; the scheduler path (``scheduler/``) runs SGLang's own."""
