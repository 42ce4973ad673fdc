"""SGLang's own Scheduler on the CPU (``--family sglang:scheduler`` and ``sglang:hicache``): the server, its model-runner stand-in, its sessions' clients, and the factories."""
