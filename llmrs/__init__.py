"""llmrs: compile a Llama 3.x model into one plan file and run it on CPUs and GPUs."""
__version__ = "0.1.0"
