"""poolfuzz: property-based correctness harness for the GPU memory pools of LLM serving engines."""

__version__ = "0.1.0"
