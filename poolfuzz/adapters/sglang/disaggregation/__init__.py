"""Prefill-decode disaggregation: PD transfer registration, the decode side's pre-allocation gate and SGLang's own decode server (``--family sglang:decode``)."""
