"""llmrs: compile a Llama 3.x model into one plan file and run it on CPUs and GPUs.

    plan = llmrs.compile("model/")        # or a .gguf; returns the plan's path
    model = llmrs.load(plan)              # runtime/model.py's Model
    for piece in model.generate("Once upon a time", max_tokens=32):
        print(piece, end="")
"""
from .api import CompileError, builtin_model, compile, load

__version__ = "0.2.0"
__all__ = ["CompileError", "builtin_model", "compile", "load"]
