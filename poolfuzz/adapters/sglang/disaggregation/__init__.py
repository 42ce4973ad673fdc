"""Prefill-decode disaggregation: PD transfer registration and the decode side's pre-allocation gate (SGLang's own
decode server, which runs on the scheduler path, is ``scheduler/decode_server.py``)."""
