"""The compiled backend: one static-shape draft/verify step, compiled with torch.compile
(fullgraph, CUDA graphs on CUDA), no host read inside a step (engine.py, step.py).

    import selfspec.compiled
    m = selfspec.compiled.load("gemma-3-270m", dtype="float32")     # or CompiledModel(selfspec.load(...))
    m.generate("def f(x):", max_new_tokens=64, strategy="early-exit", exit_layer=8, num_speculations=7)
"""

from selfspec.compiled.api import CompiledModel, load

__all__ = ["CompiledModel", "load"]
