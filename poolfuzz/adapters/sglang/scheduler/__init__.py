"""SGLang's own Scheduler on the CPU (``--family sglang:scheduler``, ``sglang:hicache`` and ``sglang:decode``): the
servers, the model-runner stand-in, the streaming sessions' clients, and the factories."""
