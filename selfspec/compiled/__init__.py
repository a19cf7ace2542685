"""The compiled backend: one static-shape draft/verify step, compiled with torch.compile
(fullgraph, CUDA graphs on CUDA), no host read inside a step. See engine.py and step.py."""
